"""Issue 31 on real Bazel, in a throwaway package of the matrix workspace: a family's `ptx = [...]`
adds PtxCompile actions and PTX kernels to its manifest without changing any CUBIN's action key;
the manifest records each kernel's toolkit and minimum driver; the Starlark PTX arch grammar is
the Python one (`cubinstore.manifest.ptx.PtxArch`)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator

import pytest

from cubinstore.manifest import Manifest
from cubinstore.manifest.ptx import PtxArch
from cubinstore.manifest.toolkit import min_driver

from ._workspace import COMPILE
from .conftest import Matrix

pytestmark = pytest.mark.bazel

ARCHS = ["compute_90", "compute_90a", "compute_100f", "compute_9", "compute_90b", "sm_90", "compute90", "compute_090"]

MIRROR_BZL = """\
load("//tools/private:types.bzl", "is_ptx_arch")

def _impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".json")
    ctx.actions.write(out, json.encode({a: is_ptx_arch(a) for a in ctx.attr.archs}))
    return [DefaultInfo(files = depset([out]))]

mirror = rule(implementation = _impl, attrs = {"archs": attr.string_list()})
"""

BUILD = """\
load("//tools:defs.bzl", "cubin_instantiations", "cubin_manifest")
load(":mirror.bzl", "mirror")

mirror(name = "table", archs = {archs})

cubin_instantiations(
    name = "probe",
    srcs = ["probe.cu"],
    archs = ["sm_80"],
    defines = ["V={{v}}"],
    entries = {{"probe": ["ptr", "i32"]}},
    grid = {{"v": [1, 2]}},{ptx}
)

cubin_manifest(name = "manifest", families = [":probe"])
"""

PROBE_CU = 'extern "C" __global__ void probe(float* p, int n) { if (threadIdx.x < n) p[threadIdx.x] = V; }\n'


def _build_file(ptx: str = "") -> str:
    return BUILD.format(archs=json.dumps(ARCHS), ptx=f"\n    ptx = {ptx}," if ptx else "")


@pytest.fixture(scope="module")
def package(matrix: Matrix) -> Iterator[Matrix]:
    pkg = matrix.ws.root / "ptx_probe"
    pkg.mkdir()
    (pkg / "mirror.bzl").write_text(MIRROR_BZL)
    (pkg / "BUILD.bazel").write_text(_build_file())
    (pkg / "probe.cu").write_text(PROBE_CU)
    try:
        yield matrix
    finally:
        shutil.rmtree(pkg)


def _valid(arch: str) -> bool:
    try:
        PtxArch.parse(arch)
        return True
    except Exception:
        return False


def _cubin_keys(matrix: Matrix) -> dict[str, str]:
    graph = matrix.ws.aquery(f'mnemonic("{COMPILE}", //ptx_probe:all)')
    targets = {t["id"]: t["label"] for t in graph["targets"]}
    return {targets[a["targetId"]]: a["actionKey"] for a in graph["actions"]}


def test_the_starlark_ptx_arch_grammar_is_the_python_one(package: Matrix) -> None:
    package.ws.run("build", ["--color=no", "--curses=no", "//ptx_probe:table"])
    table = json.loads((package.ws.root / "bazel-bin/ptx_probe/table.json").read_text())
    assert table == {a: _valid(a) for a in ARCHS}
    assert sum(table.values()) == 3  # the comparison is not vacuous


def test_ptx_adds_kernels_and_changes_no_cubin_key(package: Matrix) -> None:
    ws = package.ws
    before = _cubin_keys(package)
    assert len(before) == 2
    with ws.edit("ptx_probe/BUILD.bazel", lambda _: _build_file('["compute_90"]')):
        assert _cubin_keys(package) == before  # the CUBINs' command lines, env and inputs: untouched
        result = ws.build(["//ptx_probe:manifest"], disk_cache=package.disk_cache)
        assert set(result.by_label("PtxCompile")) == {"//ptx_probe:probe_v1_compute_90", "//ptx_probe:probe_v2_compute_90"}
        manifest = Manifest.from_path(ws.root / "bazel-bin/ptx_probe/manifest.json")
        ptx = {k.id: k for k in manifest if k.is_ptx}
        assert sorted(ptx) == ["probe/v1/compute_90", "probe/v2/compute_90"]
        for spec in manifest:
            assert spec.toolkit is not None and spec.min_driver == min_driver(spec.toolkit, ptx=spec.is_ptx)
        data = (ws.root / "bazel-bin/ptx_probe/probe_v2_compute_90.ptx").read_bytes()
        spec = ptx["probe/v2/compute_90"]
        assert (str(spec.digest), spec.size) == ("sha256:" + hashlib.sha256(data).hexdigest(), len(data))
        assert b".target sm_90" in data and spec.entry("probe").offsets == (0, 8)
