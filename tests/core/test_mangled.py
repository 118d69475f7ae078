"""The parameter types a mangled kernel symbol carries (``cubinstore._core.mangled``), read from
the symbols real nvcc writes, checked against what the demangler prints."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from cubinstore.internals import MAX_SYMBOL_CHARS, CubinImage, MangledParam, decode_params, function_name, type_problem

NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"

# Kernels the way libraries write them: a dtype template parameter used by value and through
# pointers (substitutions), enum and integer template arguments, structs, CUtensorMap, an
# anonymous namespace, a static kernel, fp16/bf16 classes; and two outside the decoder's subset.
CORPUS_TU = r"""
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
namespace cute { namespace UMMA { enum class Major { K = 0, MN = 1 }; } }
namespace mylib {
struct Params { int a; float b; };
template <class T> struct Wrap { T v; };
template <class T, int BLOCK>
__global__ void rowscale(int n, T alpha, const T* __restrict__ x, T* y, Params p, const __grid_constant__ CUtensorMap m) {}
template <cute::UMMA::Major M, class T>
__global__ void umma(T* a, T* b, cute::UMMA::Major m, const T* c, unsigned long long z, long w, short s,
                     unsigned short us, signed char sc, unsigned char uc, char c2, bool bb, double d) {}
template <class T> __global__ void wrapped(Wrap<T> w, Wrap<T>* pw, T v, Wrap<int> wi, Wrap<T> w2) {}
namespace { __global__ void anon(float* a, float* b, int* c, int* d) {} }
static __global__ void fixed(uint32_t a, int64_t b, uint64_t c, int8_t d, size_t e) {}
__global__ void halfs(__half h, __nv_bfloat16 b, __half* ph, const __nv_bfloat16* pb) {}
__global__ void noparams() {}
template <class A, class B> __global__ void two(A a, B b, A* pa, const B* pb, A a2) {}
template <class T, class... Ts> __global__ void packed(T t, Ts... ts) {}
__global__ void fnptr(void (*f)(int), int x) {}
}
extern "C" __global__ void plain(int n, float a) {}
void instantiate() {
  (void)&mylib::rowscale<float, 128>; (void)&mylib::rowscale<int, 64>;
  (void)&mylib::umma<cute::UMMA::Major::K, float>; (void)&mylib::umma<cute::UMMA::Major::MN, __half>;
  (void)&mylib::wrapped<float>; (void)&mylib::anon; (void)&mylib::fixed; (void)&mylib::halfs;
  (void)&mylib::noparams; (void)&mylib::two<int, float>; (void)&mylib::two<float*, mylib::Params>;
  (void)&mylib::packed<int, float, int*>; (void)&mylib::fnptr; (void)&plain;
}
"""

# The C++ name (as c++filt writes it, without parameters) -> the types each parameter allows ("" unknown).
UNSCALED = ["u64", "i64", "i16", "u16", "i8", "u8", "i8|u8", "i8|u8", "f64"]
EXPECTED = {
    "mylib::rowscale<float, 128>": ["i32", "f32", "ptr", "ptr", "", "tensormap"],
    "mylib::rowscale<int, 64>": ["i32", "i32", "ptr", "ptr", "", "tensormap"],
    "mylib::umma<(cute::UMMA::Major)0, float>": ["ptr", "ptr", "", "ptr", *UNSCALED],
    "mylib::umma<(cute::UMMA::Major)1, __half>": ["ptr", "ptr", "", "ptr", *UNSCALED],
    "mylib::wrapped<float>": ["", "ptr", "f32", "", ""],
    "mylib::(anonymous namespace)::anon": ["ptr", "ptr", "ptr", "ptr"],
    "mylib::fixed": ["u32", "i64", "u64", "i8", "u64"],
    "mylib::halfs": ["", "", "ptr", "ptr"],
    "mylib::noparams": [],
    "mylib::two<int, float>": ["i32", "f32", "ptr", "ptr", "i32"],
    "mylib::two<float*, mylib::Params>": ["ptr", "", "ptr", "ptr", "ptr"],
}
UNDECODABLE = {"mylib::packed<int, float, int*>", "mylib::fnptr"}


def _allowed(param: MangledParam) -> str:
    return "|".join(sorted(param.allowed))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """C++ name -> symbol of every kernel of the corpus, compiled by nvcc, named by c++filt."""
    if not Path(NVCC).exists():
        pytest.skip("nvcc is not installed")
    if shutil.which("c++filt") is None:
        pytest.skip("c++filt is not installed")
    d = tmp_path_factory.mktemp("mangled")
    (d / "corpus.cu").write_text(CORPUS_TU)
    subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", str(d / "corpus.cu"), "-o", str(d / "corpus.cubin")],
                   check=True, capture_output=True)
    symbols = sorted(CubinImage((d / "corpus.cubin").read_bytes(), "corpus").kernels)
    demangled = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    return {function_name(text): symbol for symbol, text in zip(symbols, demangled)}


def test_every_corpus_kernel_decodes_to_its_parameter_types(corpus):
    assert set(corpus) == {*EXPECTED, *UNDECODABLE, "plain"}
    for name, allowed in EXPECTED.items():
        params = decode_params(corpus[name])
        assert params is not None, f"{name} ({corpus[name]}) did not decode"
        assert [_allowed(p) for p in params] == allowed, name


def test_a_repeated_pointer_is_a_substitution_that_still_decodes_as_a_pointer(corpus):
    params = decode_params(corpus["mylib::(anonymous namespace)::anon"])
    assert [p.mangled for p in params] == ["Pf", "S1_", "Pi", "S2_"]
    params = decode_params(corpus["mylib::two<int, float>"])
    assert [(p.mangled, p.spelling) for p in params][:2] == [("T_", "int"), ("T0_", "float")]


def _split_params(demangled: str) -> list[str]:
    name = function_name(demangled)
    inner = demangled[demangled.index(name) + len(name):].strip()[1:-1]
    out, depth, current = [], 0, ""
    for c in inner:
        depth += (c in "<(") - (c in ">)")
        if c == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += c
    return [p for p in [*out, current.strip()] if p]


def test_the_decoder_agrees_with_the_demangler_on_what_each_parameter_is(corpus):
    # The oracle: a parameter c++filt prints as a pointer is 'ptr', `int` is 'i32', ...
    builtins = {"int": "i32", "unsigned int": "u32", "float": "f32", "double": "f64", "long": "i64",
                "unsigned long": "u64", "unsigned long long": "u64", "short": "i16", "unsigned short": "u16",
                "signed char": "i8", "unsigned char": "u8", "char": "i8|u8", "bool": "i8|u8",
                "CUtensorMap_st": "tensormap"}
    names = [n for n in corpus if n not in UNDECODABLE and n != "plain"]
    demangled = subprocess.run(["c++filt"], input="\n".join(corpus[n] for n in names), capture_output=True,
                               text=True, check=True).stdout.splitlines()
    for name, text in zip(names, demangled):
        want = ["ptr" if t.endswith("*") else builtins.get(t, "") for t in _split_params(text)]
        assert [_allowed(p) for p in decode_params(corpus[name])] == want, text


def test_what_the_decoder_does_not_cover_is_not_checked_rather_than_guessed(corpus):
    for name in UNDECODABLE:
        assert decode_params(corpus[name]) is None, name
    assert decode_params(corpus["plain"]) is None  # extern "C": no types


@pytest.mark.parametrize("symbol", [
    "axpy_f32", "", "_Z", "_Z1k", "_Z1kPfS0_", "_Z1kT_", "_Z3fooIiEv", "_Z1kPf.constprop.0", "_ZN1aE",
    "_Z1kNE", "_Z1kIiE", "_Z99kv", "_Z1kvi", "_Z1kPFviE", "_Z1kDpT_", "_Z1kS_", "_Z1k" + "P" * 10_000 + "f",
    "_Z1k" + "i" * (MAX_SYMBOL_CHARS), "_Z1k\u00e9",
])
def test_a_malformed_or_unsupported_symbol_decodes_to_none(symbol):
    assert decode_params(symbol) is None


def test_random_and_truncated_symbols_never_raise():
    rng = random.Random(30)
    alphabet = "_ZNEILPKSTVrRO0123456789ijfdmPbcxyv"
    valid = "_ZN5mylib8rowscaleIfLi128EEEviT_PKS1_PS1_NS_6ParamsE14CUtensorMap_st"
    candidates = [valid[:i] for i in range(len(valid))]
    candidates += ["_Z" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    for symbol in candidates:
        params = decode_params(symbol)
        assert params is None or all(isinstance(p, MangledParam) for p in params), symbol


def test_type_problem_names_the_first_contradiction_and_skips_unknown_parameters():
    params = decode_params("_ZN5mylib8rowscaleIfLi128EEEviT_PKS1_PS1_NS_6ParamsE14CUtensorMap_st")
    assert type_problem(["i32", "f32", "ptr", "ptr", "struct:8:4", "tensormap"], params) is None
    assert type_problem(["i32", "f32", "ptr", "ptr", "i64", "tensormap"], params) is None  # a struct: unknown
    assert type_problem(["i32", "i32", "ptr", "u64", "struct:8:4", "tensormap"], params) == (
        1, "is declared 'i32', but the kernel's mangled name gives 'T_' (float): declare 'f32'")
    assert type_problem(["i32", "f32"], params) is None  # a count that differs is the layout check's
