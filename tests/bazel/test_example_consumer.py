"""examples/consumer: another workspace that `bazel_dep`s on cubinstore (bzlmod, Bazel 7,
`local_path_override`), defines its own family with `cubin_instantiations` and builds its own
manifest with `cubin_manifest`, the toolkit coming from cubinstore's repository rule; a copy of
it at another path builds from the first one's disk cache without running an action."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Built:
    result: BuildResult
    manifest_bytes: bytes
    disk_cache: Path  # empty before this build, which wrote every action's result to it

    @property
    def manifest(self) -> dict:
        return json.loads(self.manifest_bytes)


@pytest.fixture(scope="module")
def built(consumer: Workspace) -> Built:
    disk_cache = consumer.output_base.parent / "disk_cache"
    disk_cache.mkdir()
    result = consumer.build(("//:manifest",), disk_cache=disk_cache)
    return Built(result, (consumer.root / "bazel-bin" / "manifest.json").read_bytes(), disk_cache)


def test_consumer_builds_its_own_family_with_cubinstores_rules(built: Built) -> None:
    result, manifest = built.result, built.manifest
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
    ((symbol, tile),) = entries["tile/block128/sm_90a"].items()
    assert symbol == "_ZN8consumer8rowscaleILi128EEEviiNS_6AffineE14CUtensorMap_stPf"
    assert tile["name"] == "consumer::rowscale<128>"
    # A struct by value and a tensor map after the scalars: the tensor map at its 128-byte
    # alignment in sm_90's parameter bank (0x210 + 112 = 640), as the CUBIN laid them out.
    assert tile["params"] == ["i32", "i32", "struct:12:4", "tensormap", "ptr"]
    assert tile["offsets"] == [0, 4, 8, 112, 240]
    assert tile["launch"] == {"block": [128, 1, 1], "shared_mem": 0, "grid": ["cdiv(args[1], 128)", "args[0]"]}
    # Another library's headers, found by package name through the module extension.
    assert entries["wheel/v1/sm_90a"]["scale_half"]["params"] == ["i32", "f32", "ptr"]


def test_consumer_compiles_with_the_toolkit_of_cubinstores_module(built: Built, consumer: Workspace) -> None:
    result, manifest = built.result, built.manifest
    # nvcc is cubinstore's @local_cuda, seen from the consumer under its canonical name.
    nvcc = {s.program for s in result.spawns if s.mnemonic == COMPILE}
    assert len(nvcc) == 1
    (path,) = nvcc
    assert path.startswith("external/cubinstore~") and path.endswith("local_cuda/bin/nvcc"), path
    for kernel in manifest["kernels"]:
        package, name = kernel["target"][2:].split(":")
        assert (consumer.root / "bazel-bin" / package / f"{name}.cubin").stat().st_size == kernel["size"]


def test_a_copy_of_the_consumer_at_another_depth_runs_no_action(
        built: Built, consumer: Workspace, bazel7_tools: Bazel7Tools, bazel_tools: Tools,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("consumer-relocated")
    copy_workspace(base / "srv" / "releases" / "current" / "checkout", venv=bazel_tools.venv)
    ws = Workspace(root=base / "srv" / "releases" / "current" / "checkout" / CONSUMER,
                   output_base=base / "output_base", bazel=bazel7_tools.bazel, bzlmod=True)
    assert len(ws.root.parts) != len(consumer.root.parts)
    try:
        result = ws.build(("//:manifest",), disk_cache=built.disk_cache)
        manifest = (ws.root / "bazel-bin" / "manifest.json").read_bytes()
    finally:
        ws.shutdown()
    # Every compile and the manifest come from the first copy's disk cache: no path of either
    # checkout, output base or of cubinstore's repository under it is in an action key.
    assert set(result.by_label()) == set(built.result.by_label())
    assert result.misses() == set(), f"recompiled after relocation (log: {result.log})"
    assert result.by_label(MANIFEST) == {"//:manifest": True}
    assert [s.mnemonic for s in result.spawns if not s.cache_hit] == []
    assert manifest == built.manifest_bytes


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
        assert {s.label for s in result.spawns if s.mnemonic == COMPILE} == {"//vendored:vendored_v1_sm_90a"}
        assert (root / "bazel-bin" / "vendored" / "vendored_v1_sm_90a.cubin").read_bytes()[:4] == b"\x7fELF"
    finally:
        ws.shutdown()


def test_the_consumer_alone_outside_any_checkout_builds_from_the_cache(
        built: Built, bazel7_tools: Bazel7Tools, bazel_tools: Tools,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # What a team does: its own repository holds only its workspace (no cubinstore around it);
    # cubinstore comes from wherever the team keeps it (a registry; here a checkout elsewhere,
    # named by --override_module, which replaces the example's local_path_override).
    base = tmp_path_factory.mktemp("consumer-alone")
    vendor = copy_workspace(base / "vendor" / "cubinstore", venv=bazel_tools.venv)
    app = base / "team" / "kernels"
    shutil.copytree(vendor / CONSUMER, app, symlinks=True)
    assert not (app.parent / "tools").exists() and not (app / ".." / ".." / "MODULE.bazel").exists()
    # Its one-line .bazelrc names where cubinstore lives (README step 2), as does the offline
    # registry line this host needs; nothing of cubinstore is copied into the team's tree.
    (app / ".bazelrc").write_text(f"import {vendor}/tools/cubinstore.bazelrc\n"
                                  f"common:bazel7 --registry=file://{vendor}/third_party/registry\n")
    ws = Workspace(root=app, output_base=base / "output_base", bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        result = ws.build(("//:manifest",), disk_cache=built.disk_cache,
                          flags=(f"--override_module=cubinstore={vendor}",))
        manifest = (app / "bazel-bin" / "manifest.json").read_bytes()
    finally:
        ws.shutdown()
    assert set(result.by_label()) == set(built.result.by_label())
    assert result.misses() == set(), f"recompiled outside the checkout (log: {result.log})"
    assert manifest == built.manifest_bytes
