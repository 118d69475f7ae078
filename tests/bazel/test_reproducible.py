"""Compile twice: every instantiation of //kernels:all, built in two fresh checkouts with fresh
output bases and no cache, gives byte-identical CUBINs and the same manifest. That includes a
TU written the way JIT libraries generate theirs (everything `static`, instantiated from a
`static` function, an anonymous namespace), whose internal symbol names would otherwise carry
nvcc's process id."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from ._workspace import ALL_TARGETS, BuildResult, Workspace, output_path, replace_once
from .conftest import Tools

pytestmark = pytest.mark.bazel

JIT_STYLE_TU = """\
// Generated per point, as JIT libraries do: nothing here has external linkage.
namespace {
__device__ int bias = {bias};
}
static __device__ __noinline__ float scale(float x) { return x * {bias} + bias; }
template <int B>
__global__ static void jit_kernel(float* p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = scale(p[i]) + B;
}
static void __instantiate_kernel() {
  auto k = reinterpret_cast<void*>(&jit_kernel<{bias}>);
  (void)k;
}
"""
JIT_STYLE_BUILD = """\
load("//tools:defs.bzl", "cubin_instantiations")

cubin_instantiations(
    name = "jitstyle",
    archs = ["sm_90a", "sm_80"],
    entries = {"jit_kernel<{bias}>": ["ptr", "i32"]},
    grid = {"bias": [1, 2]},
    launch = {"block": [128], "grid": ["cdiv(args[1], 128)"]},
    src_template = "jitstyle.cu.tmpl",
    visibility = ["//kernels:__pkg__"],
)
"""


def _add_jit_style_family(ws: Workspace) -> None:
    (ws.root / "kernels/jitstyle").mkdir()
    (ws.root / "kernels/jitstyle/jitstyle.cu.tmpl").write_text(JIT_STYLE_TU)
    (ws.root / "kernels/jitstyle/BUILD.bazel").write_text(JIT_STYLE_BUILD)
    path = ws.root / "kernels/BUILD.bazel"
    path.write_text(replace_once('"//kernels/axpy",', '"//kernels/axpy",\n        "//kernels/jitstyle",')(path.read_text()))


@pytest.fixture(scope="module")
def cold_builds(bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[Workspace, BuildResult]]]:
    builds = []
    try:
        for depth in (1, 3):
            base = tmp_path_factory.mktemp("reproducible")
            ws = Workspace.create(base.joinpath(*["d"] * depth, "cubinstore"), base / "output_base",
                                  bazel_tools.bazel, bazel_tools.venv)
            _add_jit_style_family(ws)
            builds.append((ws, ws.build(ALL_TARGETS, disk_cache=None)))
        yield builds
    finally:
        for ws, _ in builds:
            ws.shutdown()


def test_two_cold_builds_compile_every_instantiation(cold_builds: list[tuple[Workspace, BuildResult]]) -> None:
    for ws, result in cold_builds:
        compiles = result.by_label()
        assert compiles and not result.hits(), f"{ws.root}: expected only real compiles, got {len(result.hits())} hits"
        families = {k["family"] for k in result.manifest_json()["kernels"]}
        assert {"jitstyle", "tgemm", "transpose", "axpy", "gemm"} <= families


def test_two_cold_builds_give_identical_cubins_and_manifests(cold_builds: list[tuple[Workspace, BuildResult]]) -> None:
    (first_ws, first), (second_ws, second) = cold_builds
    assert first.manifest == second.manifest
    kernels = first.manifest_json()["kernels"]
    for ws in (first_ws, second_ws):
        for kernel in kernels:
            data = output_path(ws.root, kernel).read_bytes()
            assert "sha256:" + hashlib.sha256(data).hexdigest() == kernel["digest"], f"{kernel['id']} in {ws.root}"


def test_the_jit_style_tu_has_internal_symbols_and_is_still_reproducible(
        cold_builds: list[tuple[Workspace, BuildResult]]) -> None:
    ws, result = cold_builds[0]
    jit = [k for k in result.manifest_json()["kernels"] if k["family"] == "jitstyle"]
    assert len(jit) == 4
    data = (ws.root / "bazel-bin/kernels/jitstyle/jitstyle_bias1_sm_90a.cubin").read_bytes()
    # The internal names carry the module id: the case that varied with nvcc's process id.
    assert b"_INTERNAL_" in data
    (entry,) = next(k for k in jit if k["id"] == "jitstyle/bias1/sm_90a")["entries"].values()
    assert entry["name"] == "jit_kernel<1>" and entry["launch"]["grid"] == ["cdiv(args[1], 128)"]
