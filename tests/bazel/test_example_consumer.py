"""examples/consumer: another workspace that `bazel_dep`s on cubinstore (bzlmod, Bazel 7,
`local_path_override`), defines its own family with `cubin_instantiations` and builds its own
manifest with `cubin_manifest`, the toolkit coming from cubinstore's repository rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._workspace import COMPILE, MANIFEST, BuildResult, Workspace, copy_workspace
from .conftest import Bazel7Tools, Tools

pytestmark = pytest.mark.bazel

CONSUMER = Path("examples") / "consumer"


@pytest.fixture(scope="module")
def consumer(bazel7_tools: Bazel7Tools, bazel_tools: Tools,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    base = tmp_path_factory.mktemp("consumer")
    copy_workspace(base / "checkout", venv=bazel_tools.venv)
    ws = Workspace(root=base / "checkout" / CONSUMER, output_base=base / "output_base",
                   bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        yield ws
    finally:
        ws.shutdown()


@pytest.fixture(scope="module")
def built(consumer: Workspace) -> tuple[BuildResult, dict]:
    result = consumer.build(("//:manifest",), disk_cache=None)
    manifest = json.loads((consumer.root / "bazel-bin" / "manifest.json").read_bytes())
    return result, manifest


def test_consumer_builds_its_own_family_with_cubinstores_rules(built: tuple[BuildResult, dict]) -> None:
    result, manifest = built
    ids = sorted(k["id"] for k in manifest["kernels"])
    assert ids == ["scale/f32/sm_80", "scale/f32/sm_90a", "scale/f64/sm_80", "scale/f64/sm_90a", "tile/block128/sm_90a", "wheel/v1/sm_90a"]
    assert {k["target"] for k in manifest["kernels"]} == set(result.by_label())
    assert result.misses() == set(result.by_label())
    assert result.by_label(MANIFEST) == {"//:manifest": False}
    entries = {k["id"]: k["entries"] for k in manifest["kernels"]}
    # The manifest tool read the parameter layout from the consumer's own CUBIN.
    assert entries["scale/f64/sm_80"]["scale_f64"]["params"] == ["i32", "f64", "ptr"]
    assert entries["scale/f64/sm_80"]["scale_f64"]["offsets"] == [0, 8, 16]
    # CuTe through cubinstore's public alias; the entry named by its C++ name, resolved to its symbol.
    (tile,) = entries["tile/block128/sm_90a"].values()
    assert tile["name"] == "consumer::rowscale<128>" and tile["params"] == ["i32", "i32", "ptr", "ptr"]
    # Another library's headers, found by package name through the module extension.
    assert entries["wheel/v1/sm_90a"]["scale_half"]["params"] == ["i32", "f32", "ptr"]


def test_consumer_compiles_with_the_toolkit_of_cubinstores_module(
        built: tuple[BuildResult, dict], consumer: Workspace) -> None:
    result, manifest = built
    # nvcc is cubinstore's @local_cuda, seen from the consumer under its canonical name.
    nvcc = {s.arguments[0] for s in result.spawns if s.mnemonic == COMPILE}
    assert len(nvcc) == 1
    (path,) = nvcc
    assert path.startswith("external/cubinstore~") and path.endswith("local_cuda/bin/nvcc"), path
    for kernel in manifest["kernels"]:
        package, name = kernel["target"][2:].split(":")
        assert (consumer.root / "bazel-bin" / package / f"{name}.cubin").stat().st_size == kernel["size"]


def test_a_local_header_folder_through_the_extension(bazel7_tools: Bazel7Tools, bazel_tools: Tools,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("consumer-local")
    vendor = base / "vendor" / "include"
    (vendor / "vendor").mkdir(parents=True)
    (vendor / "vendor" / "factor.cuh").write_text("#pragma once\n#define VENDOR_FACTOR 3\n")
    copy_workspace(base / "checkout", venv=bazel_tools.venv)
    root = base / "checkout" / CONSUMER
    with open(root / "MODULE.bazel", "a") as f:
        f.write(f'headers.local(name = "vendor", path = "{vendor}")\nuse_repo(headers, "vendor")\n')
    (root / "vendored").mkdir()
    (root / "vendored" / "k.cu").write_text(
        '#include <vendor/factor.cuh>\nextern "C" __global__ void triple(int n, float* x) {\n'
        "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) x[i] *= VENDOR_FACTOR;\n}\n")
    (root / "vendored" / "BUILD.bazel").write_text(
        'load("@cubinstore//tools:defs.bzl", "cubin_instantiations")\n\n'
        'cubin_instantiations(\n    name = "vendored",\n    srcs = ["k.cu"],\n    archs = ["sm_90a"],\n'
        '    entries = {"triple": ["i32", "ptr"]},\n    grid = {"v": [1]},\n    deps = ["@vendor//:headers"],\n)\n')
    ws = Workspace(root=root, output_base=base / "output_base", bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        result = ws.build(("//vendored",), disk_cache=None)
        assert {s.label for s in result.spawns if s.mnemonic == COMPILE} == {"//vendored:vendored_1_sm_90a"}
        assert (root / "bazel-bin" / "vendored" / "vendored_1_sm_90a.cubin").read_bytes()[:4] == b"\x7fELF"
    finally:
        ws.shutdown()
