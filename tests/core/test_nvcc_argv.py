"""The nvcc command of a CUBIN has one shape: ``cubinstore/_core/nvcc.py``, mirrored in Starlark
by ``tools/private/actions/compile.bzl`` (what ``cuda_cubin`` runs), expanded by the JIT."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cubinstore.internals import nvcc

ROOT = Path(__file__).resolve().parents[2]


def _starlark_assignment(name: str) -> object:
    tree = ast.parse((ROOT / "tools/private/actions/compile.bzl").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in tools/private/actions/compile.bzl")


def test_the_starlark_command_shape_is_the_python_one() -> None:
    assert tuple(_starlark_assignment("CUBIN_ARGV")) == nvcc.CUBIN_ARGV
    assert _starlark_assignment("LIST_SLOTS") == dict(nvcc.LIST_SLOTS)


def test_the_rule_builds_its_command_from_the_table() -> None:
    rule = (ROOT / "tools/private/rules/cuda_cubin.bzl").read_text()
    assert "cubin_compile_args(" in rule
    assert "args.add(" not in rule, "cuda_cubin spells its own nvcc words again"


def test_cubin_argv_fills_every_slot_in_order() -> None:
    argv = nvcc.cubin_argv({
        "nvcc": "cuda/bin/nvcc", "arch": "sm_90a", "host_cc": "gcc", "flags": ["-std=c++17", "-O3"],
        "includes": ["inc/0"], "defines": ["N=4"], "anchor": "a.h", "source_name": "k.cu",
        "extra": ["-MD", "-MF", "k.d"], "output": "k.cubin", "source": "k.cu",
    })
    assert argv == ["cuda/bin/nvcc", "-cubin", "-arch=sm_90a", "-ccbin", "gcc", "-std=c++17", "-O3", "-I.", "-Iinc/0",
                    "-DN=4", "-include", "a.h", "-Xcicc", "--orig_src_path_name", "-Xcicc", "k.cu", "-MD", "-MF", "k.d",
                    "-o", "k.cubin", "k.cu"]


def test_a_list_slot_given_a_string_is_refused() -> None:
    with pytest.raises(TypeError, match=r"nvcc slot \{includes\}"):
        nvcc.cubin_argv({"nvcc": "n", "arch": "a", "host_cc": "c", "flags": [], "includes": "inc/0", "defines": [],
                         "anchor": "a", "source_name": "s", "extra": [], "output": "o", "source": "s"})


def test_the_jit_builds_its_command_from_the_table() -> None:
    source = (ROOT / "cubinstore/_jit/compiler.py").read_text()
    body = source[source.index("def command("):source.index("def _lay_out(")]
    assert "cubin_argv(" in body and "-Xcicc" not in body, "the JIT spells its own nvcc words again"
