"""The build-side manifest writer: digests from bytes, canonical JSON, entry checks."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    spec.write_text(json.dumps({"kernels": kernels}))
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
    assert manifest["schema"] == "cubinstore/manifest/v1"


def test_missing_entry_symbol_fails_naming_kernel_and_entry(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f64": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert result.stderr.startswith(
        "cubin_manifest: kernel 'axpy/f32/vec4/sm_90a' (//kernels/axpy:axpy_f32_vec4_sm_90a): "
        "entry 'axpy_f64' is not a global function of its CUBIN; found: axpy_f32")
    assert not (tmp_path / "manifest.json").exists()


def test_wrong_parameter_count_fails(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f32": ["i32", "f32", "ptr"]})])
    assert result.returncode == 1
    assert "entry 'axpy_f32' takes 4 parameters, declared 3" in result.stderr


def test_wrong_parameter_size_fails_naming_the_parameter(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin, entries={"axpy_f32": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert "entry 'axpy_f32' parameter 1 is 4 bytes (at offset 4), but declared 'f64' is 8 bytes" in result.stderr


def test_duplicate_ids_fail(tmp_path, axpy_cubin):
    result = run_tool(tmp_path, [kernel(axpy_cubin), kernel(axpy_cubin)])
    assert result.returncode == 1
    assert "duplicate kernel ids in the manifest: axpy/f32/vec4/sm_90a" in result.stderr


def test_a_file_that_is_not_elf_is_refused(tmp_path):
    bogus = tmp_path / "bogus.cubin"
    bogus.write_bytes(b"not an elf file at all")
    result = run_tool(tmp_path, [kernel(bogus)])
    assert result.returncode == 1
    assert "not a 64-bit little-endian ELF file, so not a CUBIN" in result.stderr
