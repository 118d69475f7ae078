"""`header_closure = True` (docs/header-closure.md): a CubinScan action copies the headers a TU
includes into a tree artifact and the compile reads that tree, so a declared header the TU never
includes is no input of its compile: changing it re-keys that compile's neighbours, not it.
Without the attribute every declared header stays an input (the control)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._workspace import Workspace, append
from .conftest import Bazel7Tools, Tools

pytestmark = pytest.mark.bazel

PACKAGE = "closure_probe"
BUILD = """\
load("//tools:defs.bzl", "cuda_cubin")

[
    cuda_cubin(
        name = name,
        srcs = [src],
        hdrs = ["a.cuh", "b.cuh", "common.cuh"],
        arch = "sm_80",
        entries = {"probe": ["ptr"]},
        family = "probe",
        header_closure = closure,
        id = "probe/" + name,
        toolkit_headers = ["libcudacxx"],
        deps = ["//third_party/cutlass:cute"],
    )
    for name, src, closure in [
        ("a_closure", "a.cu", True),
        ("b_closure", "b.cu", True),
        ("a_default", "a.cu", False),
        ("b_default", "b.cu", False),
    ]
]
"""
FILES = {
    # a: its own header, the common one, and CuTe (whose includes are partly computed:
    # `#include CUDA_STD_HEADER(tuple)`).
    "a.cu": '#include "a.cuh"\n#include <cute/tensor.hpp>\n'
            'extern "C" __global__ void probe(int* p) { p[0] = A_VALUE + common_checked(p) + cute::size(cute::make_shape(cute::Int<4>{}, 2)); }\n',
    "a.cuh": '#pragma once\n#include "common.cuh"\n#define A_VALUE (COMMON + 1)\n',
    # b: by its workspace path (an -I. name), not beside the source.
    "b.cu": f'#include "{PACKAGE}/b.cuh"\nextern "C" __global__ void probe(int* p) {{ p[0] = B_VALUE + common_checked(p); }}\n',
    "b.cuh": f'#pragma once\n#include "{PACKAGE}/common.cuh"\n#define B_VALUE (COMMON + 2)\n',
    # An assert names its file in the CUBIN (glibc's `__FILE__`, or `__builtin_FILE()` in newer
    # glibc, which reads the preprocessor's line markers): the closure must not change it.
    "common.cuh": "#pragma once\n#include <assert.h>\n#define COMMON 1\n"
                  "__device__ inline int common_checked(int* p) { assert(p != nullptr); return COMMON; }\n",
}
TARGETS = [f"//{PACKAGE}:all"]


@pytest.fixture(scope="module", params=["bazel4", "bazel7"])
def workspace(request: pytest.FixtureRequest, bazel_tools: Tools,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    """The probe in a copy of the checkout, under Bazel 4.2.3 (this host's glibc, whose assert
    names `__FILE__`) and Bazel 7 (the sid root's, whose assert names `__builtin_FILE()`)."""
    base = tmp_path_factory.mktemp("header_closure")
    if request.param == "bazel7":
        bazel7: Bazel7Tools = request.getfixturevalue("bazel7_tools")
        ws = Workspace.create(base / "cubinstore", base / "output_base", bazel7.bazel, bazel_tools.venv, bzlmod=True)
        (ws.root / "WORKSPACE").unlink()
    else:
        ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    (ws.root / PACKAGE).mkdir()
    (ws.root / PACKAGE / "BUILD.bazel").write_text(BUILD)
    for name, text in FILES.items():
        (ws.root / PACKAGE / name).write_text(text)
    try:
        yield ws
    finally:
        ws.shutdown()


@pytest.fixture(scope="module")
def disk_cache(workspace: Workspace) -> Path:
    """A disk cache holding one cold build of the probe."""
    path = workspace.output_base.parent / "disk_cache"
    path.mkdir()
    first = workspace.build(TARGETS, disk_cache=path)
    assert first.misses() == {f"//{PACKAGE}:{n}" for n in ("a_closure", "b_closure", "a_default", "b_default")}
    assert first.misses("CubinScan") == {f"//{PACKAGE}:a_closure", f"//{PACKAGE}:b_closure"}
    return path


def _tree(ws: Workspace, target: str) -> set[str]:
    tree = ws.root / "bazel-bin" / PACKAGE / f"{target}.hdrs"
    return {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}


def test_the_tree_holds_the_source_and_the_headers_it_includes(workspace: Workspace, disk_cache: Path) -> None:
    # The trees are no top-level outputs: Bazel 7 leaves them in the cache unless told.
    workspace.build(TARGETS, disk_cache=disk_cache, flags=["--remote_download_outputs=all"])
    # nvcc runs inside the tree: the module anchor it force-includes is there too, at its path.
    anchor = f"bazel-out/k8-fastbuild/bin/{PACKAGE}/b_closure.anchor.h"
    assert _tree(workspace, "b_closure") == {f"{PACKAGE}/b.cu", f"{PACKAGE}/b.cuh", f"{PACKAGE}/common.cuh", anchor}
    a = _tree(workspace, "a_closure")
    assert {f"{PACKAGE}/a.cu", f"{PACKAGE}/a.cuh", f"{PACKAGE}/common.cuh"} <= a and f"{PACKAGE}/b.cuh" not in a
    cute = {p for p in a if "/include/cute/" in p}
    # CuTe's tensor.hpp and what it includes, a part of the 800 declared files of CUTLASS.
    assert any(p.endswith("/include/cute/tensor.hpp") for p in cute) and 20 < len(a) < 400, len(a)


def test_the_closure_compiles_to_the_same_bytes(workspace: Workspace, disk_cache: Path) -> None:
    workspace.build(TARGETS, disk_cache=disk_cache)
    out = workspace.root / "bazel-bin" / PACKAGE
    for name in ("a", "b"):
        closure = (out / f"{name}_closure.cubin").read_bytes()
        assert closure == (out / f"{name}_default.cubin").read_bytes(), name
        # The assert's message names the header by the path a compile in the execution root sees.
        assert f"{PACKAGE}/common.cuh".encode() in closure and b".hdrs/" not in closure, name


def test_a_header_the_tu_never_includes_re_keys_no_closure_compile(workspace: Workspace, disk_cache: Path) -> None:
    with workspace.edit(f"{PACKAGE}/b.cuh", append("#define B_EXTRA 1")):
        result = workspace.build(TARGETS, disk_cache=disk_cache)
    assert result.hits() == {f"//{PACKAGE}:a_closure"}, result.log
    # b reads it; both defaults declare it.
    assert result.misses() == {f"//{PACKAGE}:{n}" for n in ("b_closure", "a_default", "b_default")}, result.log


def test_a_header_both_include_re_keys_both(workspace: Workspace, disk_cache: Path) -> None:
    with workspace.edit(f"{PACKAGE}/common.cuh", append("#define COMMON_EXTRA 1")):
        result = workspace.build(TARGETS, disk_cache=disk_cache)
    assert result.hits() == set(), result.log

