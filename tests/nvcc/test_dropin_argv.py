"""Which nvcc calls cubinstore-nvcc caches (``cubinstore._nvcc.argv``): everything else passes through."""

from __future__ import annotations

import pytest

from cubinstore.internals import Call, PassThrough, parse_nvcc_argv as parse

CWD = "/work/cache/tmp"
# DeepGEMM's command line (csrc/jit/compiler.hpp), with the library at /site/deep_gemm.
DEEPGEMM = ["/work/cache/tmp/u1/kernel.cu", "-cubin", "-o", "/work/cache/tmp/u1/kernel.cubin", "-std=c++20",
            "--diag-suppress=39,161,174,177,186,940", "--ptxas-options=--register-usage-level=10",
            "-I/site/deep_gemm/include", "--gpu-architecture=sm_90a",
            "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi", "-O3",
            "--expt-relaxed-constexpr", "--expt-extended-lambda"]


def test_deepgemm_command_is_cached() -> None:
    call = parse(DEEPGEMM, CWD, [])
    assert isinstance(call, Call), call
    assert call.source == "/work/cache/tmp/u1/kernel.cu" and call.output == "/work/cache/tmp/u1/kernel.cubin"
    assert call.arch == "sm_90a" and call.kind == "cubin"
    assert call.include_dirs == ("/site/deep_gemm/include",)
    assert "-I/site/deep_gemm/include" not in call.flags  # an include root, keyed by content
    assert "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi" in call.flags
    assert "--ptxas-options=--register-usage-level=10" in call.flags


def test_relative_paths_resolve_against_the_working_directory() -> None:
    call = parse(["u1/kernel.cu", "-cubin", "-o", "u1/k.cubin", "-arch=sm_90a", "-I", "../inc", "-isystem", "sys"],
                 CWD, [])
    assert isinstance(call, Call)
    assert call.source == "/work/cache/tmp/u1/kernel.cu" and call.source_arg == "u1/kernel.cu"
    assert call.output == "/work/cache/tmp/u1/k.cubin"
    assert call.include_dirs == ("/work/cache/inc",) and call.include_args == ("../inc",)
    assert call.flags[-2:] == ("-isystem", "/work/cache/tmp/sys")


@pytest.mark.parametrize("args, why", [
    (["--version"], "'--version'"),
    (["k.cu", "-o", "k.ptx", "-arch=sm_90a"], "no -cubin"),
    (["k.cu", "-c", "-o", "k.o", "-arch=sm_90a"], "'-c'"),
    (["k.cu", "-cubin", "-arch=sm_90a"], "no -o"),
    (["k.cu", "-cubin", "-o", "k.cubin"], "no -arch"),
    (["a.cu", "b.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a"], "one .cu input"),
    (["k.cpp", "-cubin", "-o", "k.cubin", "-arch=sm_90a"], "one .cu input"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-gencode", "arch=compute_90a,code=sm_90a"], "'-gencode'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=compute_90"], "one real architecture"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-arch=sm_80"], "one real architecture"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-MD", "-MF", "k.d"], "'-MD'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "--keep"], "'--keep'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-odir", "x"], "'-odir'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-Xcompiler", "-include,/etc/x.h"], "host compiler option"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-Xptxas", "--save-temps"], "ptxas option"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "--options-file", "f"], "'--options-file'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-ccbin", "clang"], "'-ccbin'"),
    (["k.cu", "-cubin", "-o", "k.cubin", "-arch=sm_90a", "-DX=$(id)"], "-D"),
    (["k.cu", "-cubin", "-ptx", "-o", "k.ptx", "-arch=sm_90a"], "two output kinds"),
])
def test_what_it_does_not_model_passes_through(args: list[str], why: str) -> None:
    call = parse(args, CWD, [])
    assert isinstance(call, PassThrough) and why in call.why, call


@pytest.mark.parametrize("kind", ["cubin", "ptx", "fatbin"])
def test_each_output_kind_is_cached(kind: str) -> None:
    call = parse(["k.cu", f"-{kind}", "-o", f"k.{kind}", "-arch=sm_90a"], CWD, [])
    assert isinstance(call, Call) and call.kind == kind


def test_a_call_under_an_nvcc_variable_passes_through() -> None:
    call = parse(DEEPGEMM, CWD, ["NVCC_APPEND_FLAGS"])
    assert isinstance(call, PassThrough) and "NVCC_APPEND_FLAGS" in call.why
