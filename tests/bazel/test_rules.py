"""The rules' smaller promises, in a throwaway package of the matrix workspace: the Starlark
mirror of cubinstore._core.abi computes what Python computes, a copt replaces a default flag
instead of repeating it, two manifests fit in one package, and per-point headers re-key only
the points that include them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from cubinstore.internals import abi as _abi

from ._workspace import COMPILE, replace_once
from .conftest import Matrix

pytestmark = pytest.mark.bazel

ARCHS = ["sm_80", "sm_90a", "sm_100f", "sm_121", "sm_05", "sm_1000", "sm_9", "sm_90b", "compute_90", "sm_90af"]
TYPES = ["i32", "tensormap", "bf16", "struct:12:4", "struct:48:8", "struct:12:8", "struct:0:4", "struct:5000:8", "int"]
COPTS = [[], ["-std=c++20"], ["-O2", "-lineinfo"], ["--std=c++20", "-O0"]]
PATHS = ["kernels/axpy/axpy.cu", "kernels/tgemm/tgemm_bf16_bm128.cu", "a-b/c d.cu"]

MIRROR_BZL = """\
load("//tools/private:types.bzl", "is_arch", "is_param_type", "merge_flags", "module_anchor")

def _impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".json")
    ctx.actions.write(out, json.encode({
        "archs": {a: is_arch(a) for a in ctx.attr.archs},
        "types": {t: is_param_type(t) for t in ctx.attr.types},
        "flags": [merge_flags(json.decode(c)) for c in ctx.attr.copts],
        "anchors": {p: module_anchor(p) for p in ctx.attr.paths},
    }))
    return [DefaultInfo(files = depset([out]))]

mirror = rule(implementation = _impl, attrs = {
    "archs": attr.string_list(), "types": attr.string_list(),
    "copts": attr.string_list(), "paths": attr.string_list(),
})
"""

FAMILY_BUILD = """\
load("//tools:defs.bzl", "cubin_instantiations", "cubin_manifest")
load(":mirror.bzl", "mirror")

mirror(name = "table", archs = {archs}, types = {types}, copts = {copts}, paths = {paths})

cubin_instantiations(
    name = "probe",
    srcs = ["probe.cu"],
    hdrs = ["h_{{v}}.cuh"],
    archs = ["sm_80"],
    defines = ["V={{v}}"],
    entries = {{"probe": ["ptr"]}},
    grid = {{"v": [1, 2]}},
)

cubin_manifest(name = "first", families = [":probe"])
cubin_manifest(name = "second", families = [":probe"])
"""

PROBE_CU = """\
#if V == 1
#include "rules_probe/h_1.cuh"
#else
#include "rules_probe/h_2.cuh"
#endif
extern "C" __global__ void probe(float* p) { p[0] = VALUE; }
"""


@pytest.fixture(scope="module")
def probe_package(matrix: Matrix) -> Iterator[Matrix]:
    ws = matrix.ws
    pkg = ws.root / "rules_probe"
    pkg.mkdir()
    (pkg / "mirror.bzl").write_text(MIRROR_BZL)
    (pkg / "BUILD.bazel").write_text(FAMILY_BUILD.format(
        archs=json.dumps(ARCHS), types=json.dumps(TYPES), copts=json.dumps([json.dumps(c) for c in COPTS]),
        paths=json.dumps(PATHS)))
    (pkg / "probe.cu").write_text(PROBE_CU)
    for v in (1, 2):
        (pkg / f"h_{v}.cuh").write_text(f"#define VALUE {v}.0f\n")
    try:
        yield matrix
    finally:
        import shutil

        shutil.rmtree(pkg)


def _table(matrix: Matrix) -> dict:
    matrix.ws.run("build", ["--color=no", "--curses=no", "//rules_probe:table"])
    return json.loads((matrix.ws.root / "bazel-bin/rules_probe/table.json").read_text())


def _python_is_type(name: str) -> bool:
    try:
        _abi.param_type(name)
        return True
    except Exception:
        return False


def _python_is_arch(name: str) -> bool:
    try:
        _abi.Arch.parse(name)
        return True
    except Exception:
        return False


def test_starlark_mirror_computes_what_the_abi_module_computes(probe_package: Matrix) -> None:
    table = _table(probe_package)
    assert table["archs"] == {a: _python_is_arch(a) for a in ARCHS}
    assert table["types"] == {t: _python_is_type(t) for t in TYPES}
    assert table["flags"] == [_abi.merge_flags(c) for c in COPTS]
    assert table["anchors"] == {p: _abi.module_anchor(p) for p in PATHS}


def test_a_std_copt_replaces_the_default_instead_of_repeating_it(probe_package: Matrix) -> None:
    ws = probe_package.ws
    with ws.edit("kernels/axpy/BUILD.bazel", replace_once('    archs = [', '    copts = ["-std=c++20"],\n    archs = [')):
        graph = ws.aquery(f'mnemonic("{COMPILE}", //kernels/axpy:axpy_f32_vec4_sm_80)')
    (action,) = graph["actions"]
    stds = [a for a in action["arguments"] if a.startswith("-std")]
    assert stds == ["-std=c++20"]


def test_two_manifests_in_one_package_and_per_point_headers(probe_package: Matrix) -> None:
    ws = probe_package.ws
    first = ws.build(["//rules_probe:first", "//rules_probe:second"], disk_cache=probe_package.disk_cache)
    a = (ws.root / "bazel-bin/rules_probe/first.json").read_bytes()
    b = (ws.root / "bazel-bin/rules_probe/second.json").read_bytes()
    assert a == b and json.loads(a)["schema"] == "cubinstore/manifest/v2"
    assert set(first.by_label()) == {"//rules_probe:probe_v1_sm_80", "//rules_probe:probe_v2_sm_80"}
    # A change to the header only point v2 includes re-keys only v2.
    with ws.edit("rules_probe/h_2.cuh", lambda text: text.replace("2.0f", "2.5f")):
        again = ws.build(["//rules_probe:first"], disk_cache=probe_package.disk_cache)
    assert again.misses() == {"//rules_probe:probe_v2_sm_80"}
    assert again.hits() == {"//rules_probe:probe_v1_sm_80"}
