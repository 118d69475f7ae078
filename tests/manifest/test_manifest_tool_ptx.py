"""The manifest tool (the CubinManifest action) on real nvcc output: each kernel's toolkit facts come
from its bytes, and PTX (arch ``compute_...``) is checked as PTX and recorded like a CUBIN."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cubinstore.manifest import Manifest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "manifest_tool.py"
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"

pytestmark = [pytest.mark.skipif(not Path(NVCC).exists(), reason="nvcc is not installed"),
              pytest.mark.usefixtures("clean_env")]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("axpy")
    paths = {}
    for kind, arch in (("cubin", "sm_90a"), ("ptx", "compute_90"), ("ptx", "compute_90a")):
        paths[arch] = out / f"axpy_{arch}.{kind}"
        subprocess.run([NVCC, f"-{kind}", f"-arch={arch}", "-std=c++17", "-O3", "-DDTYPE_f32", "-DVEC=4", "-I", str(ROOT),
                        str(ROOT / "kernels/axpy/axpy.cu"), "-o", str(paths[arch])], check=True, timeout=300)
    return paths


def kernel(path: Path, arch: str, **overrides: Any) -> dict[str, Any]:
    k = {"id": f"axpy/f32/vec4/{arch}", "family": "axpy", "params": {"dtype": "f32", "vec": 4}, "arch": arch,
         "entries": {"axpy_f32": ["i32", "f32", "ptr", "ptr"]}, "launch": {"axpy_f32": {"block": [256]}},
         "target": f"//kernels/axpy:axpy_f32_vec4_{arch}", "cubin": str(path)}
    k.update(overrides)
    return k


def run_tool(tmp_path: Path, kernels: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"demangler": "c++filt", "kernels": kernels}))
    return subprocess.run([sys.executable, str(TOOL), str(spec), str(tmp_path / "manifest.json")],
                          capture_output=True, text=True, timeout=300)


def _nvcc_version() -> str:
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    return re.search(r"V(\d+\.\d+\.\d+)", out).group(1)  # type: ignore[union-attr]


def test_each_kernel_records_the_toolkit_that_built_it_and_the_oldest_driver(tmp_path: Path, built: dict[str, Path]) -> None:
    result = run_tool(tmp_path, [kernel(built["sm_90a"], "sm_90a"), kernel(built["compute_90"], "compute_90")])
    assert result.returncode == 0, result.stderr
    m = Manifest.from_path(tmp_path / "manifest.json")
    version = _nvcc_version()
    major, minor = (int(x) for x in version.split(".")[:2])
    cubin, ptx = m.by_id("axpy/f32/vec4/sm_90a"), m.by_id("axpy/f32/vec4/compute_90")
    assert (cubin.toolkit, cubin.min_driver) == (version, major * 1000)  # any driver of the major
    assert (ptx.toolkit, ptx.min_driver) == (version, major * 1000 + minor * 10)  # the driver must compile it
    data = built["compute_90"].read_bytes()
    assert (str(ptx.digest), ptx.size) == ("sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    assert ptx.entry("axpy_f32").offsets == (0, 4, 8, 16) and ptx.entry("axpy_f32").launch is not None


def test_ptx_for_another_target_than_its_arch_fails_the_build(tmp_path: Path, built: dict[str, Path]) -> None:
    result = run_tool(tmp_path, [kernel(built["compute_90a"], "compute_90")])
    assert result.returncode == 1
    assert result.stderr.startswith("cubin_manifest: kernel 'axpy/f32/vec4/compute_90' (//kernels/axpy:axpy_f32_vec4_compute_90): "
                                    "manifest says compute_90, the PTX has '.target sm_90a' (expected '.target sm_90')")


def test_a_ptx_parameter_of_another_size_fails_naming_it(tmp_path: Path, built: dict[str, Path]) -> None:
    result = run_tool(tmp_path, [kernel(built["compute_90"], "compute_90", entries={"axpy_f32": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert result.stderr.startswith("cubin_manifest: kernel 'axpy/f32/vec4/compute_90' (//kernels/axpy:axpy_f32_vec4_compute_90): "
                                    "entry 'axpy_f32' parameter 1 is 4 bytes in the PTX, but declared 'f64' is 8 bytes")


def test_a_ptx_entry_that_is_not_there_fails_naming_the_kernels_found(tmp_path: Path, built: dict[str, Path]) -> None:
    result = run_tool(tmp_path, [kernel(built["compute_90"], "compute_90", entries={"axpy_f64": ["i32", "f64", "ptr", "ptr"]})])
    assert result.returncode == 1
    assert "axpy_f64" in result.stderr and "axpy_f32" in result.stderr, result.stderr


def test_a_cubin_given_as_ptx_fails(tmp_path: Path, built: dict[str, Path]) -> None:
    result = run_tool(tmp_path, [kernel(built["sm_90a"], "compute_90")])
    assert result.returncode == 1
    assert "not PTX text" in result.stderr, result.stderr
