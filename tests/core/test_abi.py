"""The ABI contract (cubinstore._core.abi, .cubin) against real CUBINs: the layout rule on a table of
parameter lists and the one layout comparison, local kernels, the arch grammar, the id grammar,
reproducible bytes, and the Starlark mirrors: the tables of tools/private/types.bzl and the id
segments cubin_instantiations renders."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cubinstore.errors import BadArgumentError, CubinFormatError
from cubinstore.internals import CubinImage, abi as _abi, check_layout

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
needs_nvcc = pytest.mark.skipif(not Path(NVCC).exists(), reason="nvcc is not installed")

# The layout table: declared parameter lists, as kernels that take them.
PROBE = r"""
#include <cuda.h>
#include <cstdint>
struct alignas(16) S16 { int a[4]; };
struct alignas(64) S64 { char a[64]; };
struct S12 { int a[3]; };
struct S48 { double a[6]; };
#define K extern "C" __global__ void
K scalars_before_map(int a, const __grid_constant__ CUtensorMap t, float* p) {}
K three_maps_after_scalars(int* c, unsigned m, unsigned n, unsigned k, const __grid_constant__ CUtensorMap a,
                           const __grid_constant__ CUtensorMap b, const __grid_constant__ CUtensorMap d) {}
K wide_after_narrow(int a, long long b, int c, double d) {}
K struct16(int a, S16 s, int b) {}
K struct64(char a, S64 s, int b) {}
K mixed_small(int a, S12 s, short b, char c, long long d) {}
K map_first(const __grid_constant__ CUtensorMap t, int a) {}
K maps_then_scalars(const __grid_constant__ CUtensorMap a, const __grid_constant__ CUtensorMap b, void* d,
                    int m, int n, int k, float* w, int* c, int s) {}
K struct48(S48 s, float x) {}
K halves(unsigned short a, uint8_t b, double c) {}
template <int N> __global__ static void local_kernel(float* p, int n) { if (n) p[0] = N; }
static void __instantiate_kernel() { auto f = reinterpret_cast<void*>(&local_kernel<7>); (void)f; }
"""
TABLE = {
    "scalars_before_map": ["i32", "tensormap", "ptr"],
    "three_maps_after_scalars": ["ptr", "u32", "u32", "u32", "tensormap", "tensormap", "tensormap"],
    "wide_after_narrow": ["i32", "i64", "i32", "f64"],
    "struct16": ["i32", "struct:16:16", "i32"],
    "struct64": ["i8", "struct:64:64", "i32"],
    "mixed_small": ["i32", "struct:12:4", "i16", "i8", "i64"],
    "map_first": ["tensormap", "i32"],
    "maps_then_scalars": ["tensormap", "tensormap", "ptr", "i32", "i32", "i32", "ptr", "ptr", "i32"],
    "struct48": ["struct:48:8", "f32"],
    "halves": ["u16", "u8", "f64"],
}
ARCHS = ["sm_80", "sm_90a", "sm_100a"]  # one per parameter-bank offset (0x160, 0x210, 0x380)


def nvcc(src: Path, out: Path, arch: str, *extra: str, cwd: Path | None = None) -> bytes:
    subprocess.run([NVCC, "-cubin", f"-arch={arch}", *_abi.DEFAULT_NVCC_FLAGS, *extra, "-o", str(out), str(src)],
                   check=True, capture_output=True, cwd=cwd, timeout=300)
    return out.read_bytes()


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CubinImage]:
    if not Path(NVCC).exists():
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("probe")
    (d / "probe.cu").write_text(PROBE)
    return {a: CubinImage(nvcc(d / "probe.cu", d / f"{a}.cubin", a), a) for a in ARCHS}


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", sorted(TABLE))
def test_layout_rule_matches_the_compiler_and_the_runtime_check(
        probes: dict[str, CubinImage], arch: str, kernel: str) -> None:
    cubin, types = probes[arch], TABLE[kernel]
    parsed = _abi.Arch.parse(arch)
    rule = _abi.param_layout([_abi.param_type(t) for t in types], parsed)
    actual = cubin.param_layout(kernel)
    assert [o for o, _ in actual] == list(rule), f"{kernel} on {arch}: .nv.info {actual}, rule {rule}"
    assert [s for _, s in actual] == [_abi.param_type(t).size for t in types]
    assert cubin.param_bank(kernel) == _abi.PARAM_BANK_OFFSET[parsed.major]
    # The runtime's check (what cuFuncGetParamInfo reports is .nv.info) agrees on every row.
    check_layout(kernel, kernel, types, list(actual), arch)


def test_layout_mismatch_names_the_first_difference() -> None:
    types = [_abi.param_type(t) for t in ("i32", "tensormap", "ptr")]
    sm90 = _abi.Arch.parse("sm_90a")
    assert _abi.param_layout(types, sm90) == (0, 112, 240)
    assert _abi.layout_mismatch(types, sm90, [(0, 4), (112, 128), (240, 8)]) is None
    count = _abi.layout_mismatch(types, sm90, [(0, 4), (112, 128)])
    assert count is not None and count.index is None
    assert str(count) == "declares 3 parameters, the CUBIN's function takes 2"
    moved = _abi.layout_mismatch(types, sm90, [(0, 4), (16, 128), (144, 8)])
    assert moved is not None and moved.index == 1
    assert str(moved) == "parameter 1 is declared 128 bytes at offset 112, the CUBIN's function has 128 bytes at offset 16"
    # Declared offsets (a manifest's) stand in for the rule: no arch needed.
    assert _abi.layout_mismatch(types, None, [(0, 4), (16, 128), (144, 8)], offsets=(0, 16, 144)) is None
    assert _abi.layout_mismatch(types, None, [(0, 4), (16, 128), (144, 4)], offsets=(0, 16, 144)).index == 2


@pytest.mark.parametrize("params", [{"dtype": "f32", "vec": 4}, {"bm": 128, "neg": -3, "zero": 0}, {}])
def test_parse_kernel_id_reads_what_kernel_id_renders(params: dict[str, object]) -> None:
    for arch in ("sm_90a", "sm_100f", "sm_80"):
        text = _abi.kernel_id("fam", params, arch)
        parsed, parsed_arch = _abi.parse_kernel_id(text, "fam", list(params))
        assert parsed == params and list(parsed) == list(params) and str(parsed_arch) == arch


@pytest.mark.parametrize("text", [
    "fam/bm128/sm_90", "other/bm128/bn64/sm_90a", "fam/bm128/bn64/sm90a", "fam//bn64/sm_90a", "fam/bm128/bn 64/sm_90a",
    "fam/bm128/bn64", 42, None,
])
def test_parse_kernel_id_refuses_what_kernel_id_cannot_render(text: object) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid (fam kernel id|arch) "):
        _abi.parse_kernel_id(text, "fam", ["bm", "bn"])


def test_parse_kernel_id_reads_a_non_canonical_int_as_a_string() -> None:
    # `bm0128` is no int's rendering: as a string value it renders back the same.
    assert _abi.parse_kernel_id("fam/bm0128/bn+1/sm_90a", "fam", ["bm", "bn"])[0] == {"bm": "bm0128", "bn": "bn+1"}


def test_names_and_limits_are_defined_once_in_the_package() -> None:
    # Every module matches names with the grammar's IDENT_RE / WORD_RE / REL_PATH_RE (abi re-exports
    # them) and bounds blobs, manifests and points with abi's limits: none writes its own copy (it would drift).
    patterns = (_abi.IDENT_RE.pattern, _abi.WORD_RE.pattern)
    limit = re.compile(r"^\s*(MAX_BLOB_SIZE|MAX_MANIFEST_BYTES|MAX_PARAMS|MAX_POINT_PARAMS)\b[^=\n]*=[^=]", re.M)
    found = [f"{path.relative_to(ROOT)}: {what}"
             for path in sorted((ROOT / "cubinstore").rglob("*.py")) if path.name not in ("abi.py", "grammar.py")
             for text in [path.read_text()]
             for what in [*(p for p in patterns if p in text), *limit.findall(text)]]
    assert found == []


@needs_nvcc
def test_sm90_puts_the_first_tensor_map_after_scalars_at_112(probes: dict[str, CubinImage]) -> None:
    assert [o for o, _ in probes["sm_90a"].param_layout("three_maps_after_scalars")] == [0, 8, 12, 16, 112, 240, 368]


@needs_nvcc
def test_local_template_kernels_are_kernels(probes: dict[str, CubinImage]) -> None:
    kernels = probes["sm_90a"].kernels
    assert kernels["_Z12local_kernelILi7EEvPfi"].local is True
    assert kernels["map_first"].local is False
    assert probes["sm_90a"].sm == 90 and probes["sm_80"].sm == 80


@pytest.mark.parametrize("data, message", [
    (b"", "x: not an ELF file"),
    (b"\x7fELF" + b"\x01" * 60, "x: expected a 64-bit little-endian ELF"),
    (b"\x7fELF\x02\x01" + b"\0" * 12 + b"\x3e\x00" + b"\0" * 44, "x: expected ELF machine 190"),
])
def test_malformed_cubins_are_typed_errors(data: bytes, message: str) -> None:
    with pytest.raises(CubinFormatError, match="^" + re.escape(message)):
        CubinImage(data, "x")


@needs_nvcc
def test_truncated_or_garbled_cubins_raise_only_typed_errors(probes: dict[str, CubinImage]) -> None:
    import random

    good = probes["sm_90a"]._data
    rng = random.Random(7)
    for _ in range(300):
        data = bytearray(good[: rng.randrange(64, len(good))])
        for _ in range(rng.randrange(0, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            image = CubinImage(bytes(data), "fuzz")
            for name in image.kernels:
                image.param_layout(name)
        except CubinFormatError:
            pass


@pytest.mark.parametrize("text, parsed", [
    ("sm_90a", (9, 0, "a")), ("sm_80", (8, 0, "")), ("sm_100f", (10, 0, "f")), ("sm_121", (12, 1, "")),
])
def test_arch_grammar(text: str, parsed: tuple[int, int, str]) -> None:
    arch = _abi.Arch.parse(text)
    assert (arch.major, arch.minor, arch.suffix) == parsed and str(arch) == text


@pytest.mark.parametrize("text, sm", [("sm_90a", 90), ("sm_80", 80), ("sm_100f", 100), ("sm_121", 121)])
def test_an_archs_sm_is_what_its_cubins_elf_header_names(text: str, sm: int) -> None:
    assert _abi.Arch.parse(text).sm == sm


@pytest.mark.parametrize("text", ["sm_05", "sm_1000", "sm_9", "sm_90b", "SM_90", "compute_90", "sm_90a ", 90])
def test_arch_grammar_rejects(text: object) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid arch"):
        _abi.Arch.parse(text)


def test_copts_override_defaults_without_duplicates() -> None:
    assert _abi.merge_flags([]) == list(_abi.DEFAULT_NVCC_FLAGS)
    assert _abi.merge_flags(["-std=c++20"]) == ["-O3", "--expt-relaxed-constexpr", "-std=c++20"]
    assert _abi.merge_flags(["-O2", "-lineinfo"]) == ["-std=c++17", "--expt-relaxed-constexpr", "-O2", "-lineinfo"]
    assert _abi.merge_flags(["--std=c++20"]).count("-std=c++17") == 0


# -- reproducible bytes ---------------------------------------------------------------------------

# What JIT libraries generate: everything static, instantiated from a static function, plus
# an anonymous namespace. Without a definition of external linkage nvcc's module id, which
# prefixes internal names, includes its process id.
STATIC_TU = r"""
namespace { __device__ int anon_counter; }
static __device__ __noinline__ int helper(int x) { return x * 3 + anon_counter; }
template <int N> __global__ static void kernel(float* p, int n) { if (n) p[0] = N + helper(n); }
static void __instantiate_kernel() { auto f = reinterpret_cast<void*>(&kernel<4>); (void)f; }
"""


@needs_nvcc
def test_static_only_tu_differs_between_compiles_without_the_anchor_and_not_with_it(tmp_path: Path) -> None:
    src = tmp_path / "jit.cu"
    src.write_text(STATIC_TU)
    plain = {nvcc(src, tmp_path / f"plain{i}.cubin", "sm_90a") for i in range(2)}
    assert len(plain) == 2, "nvcc's module id no longer varies: the anchor may be unneeded"
    anchor = tmp_path / "anchor.h"
    anchor.write_text(_abi.module_anchor("kernels/jit/jit.cu"))
    pinned = {nvcc(src, tmp_path / f"pinned{i}.cubin", "sm_90a", "-include", str(anchor),
                   "-Xcicc", "--orig_src_path_name", "-Xcicc", "kernels/jit/jit.cu") for i in range(2)}
    assert len(pinned) == 1
    image = CubinImage(pinned.pop(), "pinned")
    assert not any("anchor" in name for name in image.kernels), "the anchor is host code"


# -- the Starlark mirror ---------------------------------------------------------------------------

def _starlark_assignment(name: str):
    tree = ast.parse((ROOT / "tools/private/types.bzl").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in tools/private/types.bzl")


def test_starlark_type_table_is_the_abi_table() -> None:
    assert _starlark_assignment("PARAM_TYPES") == dict(_abi.SCALAR_TYPES)
    assert _starlark_assignment("MAX_STRUCT_BYTES") == _abi.MAX_STRUCT_BYTES
    aligns = _starlark_assignment("STRUCT_ALIGNS")
    assert re.fullmatch(r"struct:\(\[1-9\]\[0-9\]\{0,4\}\):\((.*)\)", _abi._STRUCT_RE.pattern).group(1).split("|") == [
        str(a) for a in aligns]


def test_starlark_default_flags_are_the_abi_defaults() -> None:
    assert tuple(_starlark_assignment("DEFAULT_NVCC_FLAGS")) == _abi.DEFAULT_NVCC_FLAGS


def _starlark_function(path: str, name: str):
    """A Starlark function of ``path`` run as Python: its syntax is Python's here; ``type`` and
    ``fail`` are Starlark's (``type(x)`` names the type, ``fail`` stops the build)."""
    source = (ROOT / path).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            names = {int: "int", str: "string", bool: "bool", list: "list", dict: "dict"}

            def fail(message: str) -> None:
                raise ValueError(message)

            scope: dict[str, object] = {"type": lambda v: names.get(type(v), type(v).__name__), "fail": fail}
            exec(compile(ast.Module([node], []), path, "exec"), scope)  # our own build file, its one function
            return scope[name]
    raise AssertionError(f"{name} not found in {path}")


@pytest.mark.parametrize(("key", "value"), [
    ("vec", 4), ("vec", 0), ("vec", -3), ("bm", 128), ("dtype", "f32"), ("dtype", "bf16"),
    ("kind", "e4m3_fn"), ("kind", "A_B"), ("n", 2**40),
])
def test_starlark_id_segments_are_render_param(key: str, value: str | int) -> None:
    # cubin_instantiations names each point's id and target by the same rule the runtime parses.
    render = _starlark_function("tools/private/macros/cubin_instantiations.bzl", "_render")
    assert render(key, value) == _abi.render_param(key, value)
    family_keys = [key]
    params, arch = _abi.parse_kernel_id(_abi.kernel_id("fam", {key: value}, "sm_90a"), "fam", family_keys)
    assert params == {key: value} and str(arch) == "sm_90a"


@pytest.mark.parametrize("value", [True, "", "a-b", "a/b", "f 32", 1.5, ["x"]])
def test_starlark_refuses_values_no_id_can_hold(value: object) -> None:
    render = _starlark_function("tools/private/macros/cubin_instantiations.bzl", "_render")
    with pytest.raises(ValueError, match="must be an int or an alphanumeric string"):
        render("key", value)
