"""The build-side manifest writer: digests from bytes, canonical JSON, entry checks."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "manifest_tool.py"
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"

pytestmark = pytest.mark.skipif(not Path(NVCC).exists(), reason="nvcc is not installed")


@pytest.fixture(scope="module")
def axpy_cubin(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cubin") / "axpy.cubin"
    subprocess.run(
        [NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "-DDTYPE_f32", "-DVEC=4",
         "-I", str(ROOT), str(ROOT / "kernels/axpy/axpy.cu"), "-o", str(out)],
        check=True)
    return out


def kernel(cubin: Path, **overrides) -> dict:
    k = {"id": "axpy/f32/vec4/sm_90a", "family": "axpy", "params": {"dtype": "f32", "vec": 4},
         "arch": "sm_90a", "entries": {"axpy_f32": ["i32", "f32", "ptr", "ptr"]},
         "target": "//kernels/axpy:axpy_f32_vec4_sm_90a", "cubin": str(cubin)}
    k.update(overrides)
    return k


def run_tool(tmp_path: Path, kernels: list[dict]) -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"demangler": "c++filt", "kernels": kernels}))
    return subprocess.run([sys.executable, str(TOOL), str(spec), str(tmp_path / "manifest.json")],
                          capture_output=True, text=True)


def test_manifest_digest_is_sha256_of_the_cubin_bytes(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin)])
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "manifest.json").read_text()
    entry = json.loads(text)["kernels"][0]
    data = axpy_cubin.read_bytes()
    assert entry["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert entry["size"] == len(data)


def test_manifest_is_canonical_json(tmp_path, axpy_cubin):
    second = kernel(axpy_cubin, id="axpy/f32/vec1/sm_90a", params={"dtype": "f32", "vec": 1})
    assert run_tool(tmp_path, [kernel(axpy_cubin), second]).returncode == 0
    text = (tmp_path / "manifest.json").read_text(encoding="utf-8")
    manifest = json.loads(text)
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
    assert text == canonical
    assert [k["id"] for k in manifest["kernels"]] == ["axpy/f32/vec1/sm_90a", "axpy/f32/vec4/sm_90a"]
    assert manifest["schema"] == "cubinstore/manifest/v2"
    assert manifest["kernels"][0]["entries"] == {
        "axpy_f32": {"name": "axpy_f32", "params": ["i32", "f32", "ptr", "ptr"], "offsets": [0, 4, 8, 16]}}


def test_missing_entry_fails_naming_kernel_entry_and_the_kernels_found(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f64": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert result.stderr.startswith(
        "cubin_manifest: kernel 'axpy/f32/vec4/sm_90a' (//kernels/axpy:axpy_f32_vec4_sm_90a): "
        "entry 'axpy_f64' is not a kernel of its CUBIN; its kernels: axpy_f32 (axpy_f32)")
    assert not (tmp_path / "manifest.json").exists()


def test_wrong_parameter_count_fails(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f32": ["i32", "f32", "ptr"]})])
    assert result.returncode == 1
    assert "entry 'axpy_f32' takes 4 parameters, declared 3" in result.stderr


def test_wrong_parameter_size_fails_naming_the_parameter(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f32": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert ("entry 'axpy_f32' parameter 1 is 4 bytes at offset 4, but declared 'f64' is 8 bytes at offset 8 "
            "by the layout rule for sm_90a") in result.stderr


def test_duplicate_ids_fail(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin), kernel(axpy_cubin)])
    assert result.returncode == 1
    assert "kernels[1].id: duplicate id 'axpy/f32/vec4/sm_90a'" in result.stderr


def test_a_file_that_is_not_elf_is_refused(tmp_path):
    bogus = tmp_path / "bogus.cubin"
    bogus.write_bytes(b"not an elf file at all")
    result = run_tool(tmp_path, [kernel(bogus)])
    assert result.returncode == 1
    assert "not an ELF file (bad magic), so not a CUBIN" in result.stderr


# -- kernels written the way libraries write them ---------------------------------------------------

LIBRARY_TU = r"""
#include <cuda.h>
#include <cstdint>
#include <cutlass/detail/helper_macros.hpp>
namespace lib {
struct bf16 {};
template <class T, int BM, int BN>
CUTLASS_GLOBAL void gemm_impl(uint32_t m, uint32_t n, const __grid_constant__ CUtensorMap a, float* d) {
  if (m == 0) d[0] = BM + BN;
}
template <int N> __global__ void other(int* p) { p[0] = N; }
template <class T> __global__ void scale(int n, T alpha, T* y) { if (n) y[0] *= alpha; }
}  // namespace lib
static void __instantiate_kernel() {
  auto p = reinterpret_cast<void*>(&lib::gemm_impl<lib::bf16, 128, 256>);
  auto q = reinterpret_cast<void*>(&lib::other<3>);
  auto r = reinterpret_cast<void*>(&lib::other<4>);
  auto s = reinterpret_cast<void*>(&lib::scale<float>);
  (void)p; (void)q; (void)r; (void)s;
}
"""
GEMM_TYPES = ["u32", "u32", "tensormap", "ptr"]


@pytest.fixture(scope="module")
def library_cubin(tmp_path_factory) -> Path:
    from cubinstore.errors import BadArgumentError
    from cubinstore.internals import cutlass_include

    try:
        include = cutlass_include()
    except BadArgumentError as exc:
        pytest.skip(str(exc))
    d = tmp_path_factory.mktemp("library")
    (d / "lib.cu").write_text(LIBRARY_TU)
    subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-std=c++17", "-I", str(include), str(d / "lib.cu"),
                    "-o", str(d / "lib.cubin")], check=True, capture_output=True)
    return d / "lib.cubin"


def lib_kernel(cubin: Path, entries: dict, **extra) -> dict:
    return kernel(cubin, id="lib/bf16/sm_90a", family="lib", params={"dtype": "bf16"},
                  target="//kernels/lib:lib_bf16_sm_90a", entries=entries, **extra)


def entries_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "manifest.json").read_text())["kernels"][0]["entries"]


def test_templated_local_kernel_is_found_by_its_cpp_name(tmp_path, library_cubin):
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {"lib::gemm_impl<lib::bf16, 128, 256>": GEMM_TYPES})])
    assert result.returncode == 0, result.stderr
    (symbol, entry), = entries_of(tmp_path).items()
    assert symbol.startswith("_ZN3lib9gemm_implINS_4bf16ELi128ELi256EEEvjj14CUtensorMap_stPf")
    # Scalars before the tensor map: the compiler puts the map at 112 on sm_90, and so does the manifest.
    assert entry == {"name": "lib::gemm_impl<lib::bf16, 128, 256>", "params": GEMM_TYPES, "offsets": [0, 4, 112, 240]}


def test_unqualified_cpp_name_and_the_mangled_name_resolve_too(tmp_path, library_cubin):
    assert run_tool(tmp_path, [lib_kernel(library_cubin, {"gemm_impl<lib::bf16,128,256>": GEMM_TYPES})]).returncode == 0
    (symbol, entry), = entries_of(tmp_path).items()
    assert run_tool(tmp_path, [lib_kernel(library_cubin, {symbol: GEMM_TYPES})]).returncode == 0
    assert entries_of(tmp_path)[symbol]["name"] == "lib::gemm_impl<lib::bf16, 128, 256>"


def test_layout_the_compiler_does_not_produce_fails_the_build(tmp_path, library_cubin):
    # Declared as if the tensor map came first: count and sizes match, offsets do not.
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {"lib::gemm_impl<lib::bf16, 128, 256>": ["u32", "u32", "ptr", "tensormap"]})])
    assert result.returncode == 1
    assert ("entry 'lib::gemm_impl<lib::bf16, 128, 256>' parameter 2 is 128 bytes at offset 112, but declared "
            "'ptr' is 8 bytes at offset 8") in result.stderr


def test_template_name_without_its_arguments_fails_listing_the_kernels(tmp_path, library_cubin):
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {"lib::other": ["ptr"]})])
    assert result.returncode == 1
    assert "entry 'lib::other' is not a kernel of its CUBIN" in result.stderr
    assert "lib::other<3> (_ZN3lib5otherILi3EEEvPi)" in result.stderr


def test_launch_geometry_is_evaluated_and_its_grid_rule_kept(tmp_path, library_cubin):
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    launch = {name: {"block": [384], "shared_mem": "1024 + 4 * (128 + 256) * 128", "cluster": [1],
                     "grid": ["min(sm_count, cdiv(args[0], 128) * cdiv(args[1], 256))", "2 * 1"]}}
    assert run_tool(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES}, launch=launch)]).returncode == 0
    (entry,) = entries_of(tmp_path).values()
    assert entry["launch"] == {"block": [384, 1, 1], "shared_mem": 197632, "cluster": [1, 1, 1],
                               "grid": ["min(sm_count, cdiv(args[0], 128) * cdiv(args[1], 256))", 2]}


@pytest.mark.parametrize("geometry, message", [
    ({"block": [2048]}, "launch of entry 'E'.block: expected 1 to 3 integers in [1, 1024], got [2048]"),
    ({"block": [1], "grid": ["import_os(1)"]}, "launch rule 'import_os(1)': 'import_os(1)' is not allowed"),
    ({"block": [1], "shared_mem": "args[0]"}, "launch E.shared_mem: launch rule 'args[0]': uses args[0], which only a launch has"),
])
def test_bad_launch_geometry_fails_the_build(tmp_path, library_cubin, geometry, message):
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES}, launch={name: geometry})])
    assert result.returncode == 1
    assert message.replace("E", name, 1) in result.stderr, result.stderr


@pytest.mark.parametrize("geometry, message", [
    ({"block": [1], "grid": ["cdiv(args[0])"]}, "launch rule 'cdiv(args[0])': cdiv takes exactly 2 arguments, got 1"),
    ({"block": [1], "grid": ["cdiv(args[0], 128, 2)"]}, "launch rule 'cdiv(args[0], 128, 2)': cdiv takes exactly 2 arguments, got 3"),
    ({"block": [1], "shared_mem": "max(4)"}, "launch E.shared_mem: launch rule 'max(4)': max takes at least 2 arguments, got 1"),
])
def test_launch_rule_with_a_wrong_argument_count_fails_the_build_in_one_line(tmp_path, library_cubin, geometry, message):
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES}, launch={name: geometry})])
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("cubin_manifest: ") and "Traceback" not in result.stderr
    assert message.replace("E", name, 1) in result.stderr, result.stderr
    assert not (tmp_path / "manifest.json").exists()


# -- declared types against the mangled name's ------------------------------------------------------

def test_a_float_parameter_declared_i32_fails_naming_the_parameter_and_both_types(tmp_path, library_cubin):
    # Same size and offset, so the layout check passes; the mangled name says float.
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {"lib::scale<float>": ["i32", "i32", "ptr"]})])
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        "cubin_manifest: kernel 'lib/bf16/sm_90a' (//kernels/lib:lib_bf16_sm_90a): entry 'lib::scale<float>' "
        "parameter 1 is declared 'i32', but the kernel's mangled name gives 'T_' (float): declare 'f32' "
        "(_ZN3lib5scaleIfEEviT_PS1_)\n")
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("types, index, message", [
    (["i32", "u32", "tensormap", "ptr"], 0,
     "is declared 'i32', but the kernel's mangled name gives 'j' (unsigned int): declare 'u32'"),
    (["u32", "u32", "tensormap", "u64"], 3,
     "is declared 'u64', but the kernel's mangled name gives 'Pf' (pointer to float): declare 'ptr'"),
    (["u32", "u32", "struct:128:128", "ptr"], 2,
     "is declared 'struct:128:128', but the kernel's mangled name gives '14CUtensorMap_st' (CUtensorMap): "
     "declare 'tensormap'"),
])
def test_a_declared_type_the_mangled_name_contradicts_fails(tmp_path, library_cubin, types, index, message):
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {"lib::gemm_impl<lib::bf16, 128, 256>": types})])
    assert result.returncode == 1, result.stderr
    assert (f"entry 'lib::gemm_impl<lib::bf16, 128, 256>' parameter {index} {message} (_ZN3lib9gemm_impl"
            in result.stderr), result.stderr


def test_an_extern_c_symbol_carries_no_types_so_only_the_layout_is_checked(tmp_path, axpy_cubin):
    # axpy_f32(int n, float a, ...) is extern "C": f32 declared i32 has the same size, so it builds.
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f32": ["i32", "i32", "ptr", "ptr"]})])
    assert result.returncode == 0, result.stderr


# -- grid rules against the entry's parameters ----------------------------------------------------------

@pytest.mark.parametrize("rule, message", [
    ("cdiv(args[4], 256)",
     "rule 'cdiv(args[4], 256)' reads args[4], but entry 'axpy_f32' takes 4 parameters (args[0] .. args[3])"),
    ("cdiv(args[0], 256) + args[2]",
     "rule 'cdiv(args[0], 256) + args[2]' reads args[2], which entry 'axpy_f32' declares 'ptr'; "
     "a rule reads integer parameters (i16, i32, i64, i8, u16, u32, u64, u8)"),
    ("max(args[1], 1)", "rule 'max(args[1], 1)' reads args[1], which entry 'axpy_f32' declares 'f32'"),
])
def test_a_grid_rule_reading_a_parameter_the_entry_lacks_fails_the_build_naming_the_rule(tmp_path, axpy_cubin,
                                                                                        rule, message):
    result = run_tool(tmp_path, [kernel(axpy_cubin, launch={"axpy_f32": {"block": [256], "grid": ["1", rule]}})])
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(
        "cubin_manifest: kernel 'axpy/f32/vec4/sm_90a' (//kernels/axpy:axpy_f32_vec4_sm_90a): "
        "launch axpy_f32.grid[1]: " + message), result.stderr
    assert not (tmp_path / "manifest.json").exists()


def test_a_grid_rule_over_integer_parameters_builds(tmp_path, axpy_cubin):
    rule = "min(sm_count, cdiv(args[0], 1024))"
    result = run_tool(tmp_path, [kernel(axpy_cubin, launch={"axpy_f32": {"block": [256], "grid": [rule]}})])
    assert result.returncode == 0, result.stderr
    assert entries_of(tmp_path)["axpy_f32"]["launch"]["grid"] == [rule]


# -- entries name whole C++ names ---------------------------------------------------------------------

@pytest.mark.parametrize("fragment", [
    "bf16, 128, 256>",                 # the tail of the template arguments
    "lib::bf16, 128, 256>",
    "128,256>",
    "impl<lib::bf16, 128, 256>",       # a suffix of the unqualified name
    "gemm_impl<lib::bf16, 128, 256",   # no closing bracket
    "b::gemm_impl<lib::bf16, 128, 256>",
])
def test_an_entry_named_by_a_piece_of_a_cpp_name_is_not_resolved(tmp_path, library_cubin, fragment):
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {fragment: GEMM_TYPES})])
    assert result.returncode == 1, result.stderr
    assert f"entry '{fragment}' is not a kernel of its CUBIN; its kernels: " in result.stderr
    assert "lib::gemm_impl<lib::bf16, 128, 256> (_ZN3lib9gemm_impl" in result.stderr


@pytest.mark.parametrize("spelling", [
    "lib::gemm_impl<lib::bf16, 128, 256>",
    "::lib::gemm_impl<lib::bf16,128,256>",
    "lib::gemm_impl< lib::bf16 , 128u , 256 >",
    "gemm_impl<lib::bf16, 128, 256>",
])
def test_the_whole_name_qualified_or_not_resolves_in_any_spacing(tmp_path, library_cubin, spelling):
    result = run_tool(tmp_path, [lib_kernel(library_cubin, {spelling: GEMM_TYPES})])
    assert result.returncode == 0, result.stderr
    (symbol,) = entries_of(tmp_path)
    assert symbol.startswith("_ZN3lib9gemm_implINS_4bf16ELi128ELi256EEE")


def test_an_unqualified_name_two_kernels_share_is_ambiguous(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import manifest_tool
    finally:
        sys.path.remove(str(ROOT / "tools"))

    class Image:  # the two facts resolve_entry reads of a CubinImage
        kernels = {"_ZN1a1fEv": None, "_ZN1b1fEv": None}

    readable = {"_ZN1a1fEv": "a::f", "_ZN1b1fEv": "b::f"}
    k = {"id": "x/sm_90a", "target": "//k:x"}
    assert manifest_tool.resolve_entry(k, "b::f", Image(), readable) == ("_ZN1b1fEv", "b::f")
    with pytest.raises(manifest_tool.BuildError, match="entry 'f' matches 2 kernels of its CUBIN: _ZN1a1fEv, _ZN1b1fEv"):
        manifest_tool.resolve_entry(k, "f", Image(), readable)


# -- the demangler: time limit, output limit, typed errors --------------------------------------------

def _fake_demangler(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-c++filt"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return script


def run_tool_with(tmp_path: Path, kernels: list[dict], demangler: str, **spec_extra) -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"demangler": demangler, "kernels": kernels, **spec_extra}))
    # A hang must fail this test, not block it: the tool's own limit is 0.5 s here.
    return subprocess.run([sys.executable, str(TOOL), str(spec), str(tmp_path / "manifest.json")],
                          capture_output=True, text=True, timeout=30)


def test_a_hung_demangler_is_killed_and_fails_the_build_naming_it(tmp_path, library_cubin):
    pid_file = tmp_path / "demangler.pid"
    script = _fake_demangler(tmp_path, f"echo $$ > '{pid_file}'\nexec sleep 1000")
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    result = run_tool_with(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES})], str(script),
                           demangle_timeout=0.5)
    assert result.returncode == 1
    assert result.stderr == (f"cubin_manifest: demangler '{script}' did not finish within 0.5 s for 4 names; "
                             f"killed\n")
    assert not (tmp_path / "manifest.json").exists()
    with pytest.raises(ProcessLookupError):  # killed and reaped before the tool exited
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize("body, message", [
    ("while read l; do printf '\\377\\n'; done", "printed a byte that is not ASCII at offset 0"),
    ("exec yes 'void f()'", "printed more than 16384 bytes per name for 4 names"),
    ("while read l; do printf '\\001\\n'; done", "gave '\\x01' for _ZN3lib"),
    ("echo one line; exit 0", "exited 0 with 1 lines for 4 names"),
])
def test_a_demangler_that_prints_garbage_fails_the_build_naming_it(tmp_path, library_cubin, body, message):
    script = _fake_demangler(tmp_path, body)
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    result = run_tool_with(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES})], str(script),
                           demangle_timeout=20)
    assert result.returncode == 1
    assert result.stderr.startswith(f"cubin_manifest: demangler '{script}' "), result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("timeout", [0, -1, "10", float("nan"), 1e9, True])
def test_a_bad_demangle_timeout_in_the_spec_is_refused(tmp_path, axpy_cubin, timeout):
    result = run_tool_with(tmp_path, [kernel(axpy_cubin)], "c++filt", demangle_timeout=timeout)
    assert result.returncode == 1
    assert result.stderr.startswith("cubin_manifest: spec: demangle_timeout: expected seconds in (0, 3600], got ")


def test_a_demangler_that_cannot_run_fails_the_build_naming_it(tmp_path, library_cubin):
    name = "lib::gemm_impl<lib::bf16, 128, 256>"
    missing = str(tmp_path / "no-such-demangler")
    result = run_tool_with(tmp_path, [lib_kernel(library_cubin, {name: GEMM_TYPES})], missing)
    assert result.returncode == 1
    assert result.stderr == f"cubin_manifest: cannot run the demangler '{missing}': No such file or directory\n"
