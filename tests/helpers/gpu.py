"""What the GPU tests share: the manifest under test and a library over the build tree it sits in.

`CUBINSTORE_TEST_MANIFEST` names the manifest (default `bazel-bin/kernels/manifest.json`,
relative to the repository); its CUBINs are found by content in the directory beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cubinstore import launch
from cubinstore.internals import cuda as _cuda, device
from cubinstore.manifest import Manifest
from cubinstore.store import DirectorySource, LocalLayer, Store

ROOT = Path(__file__).resolve().parents[2]


def manifest_path() -> Path:
    path = Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    return path if path.is_absolute() else ROOT / path


def family_ids(family: str) -> list[str]:
    """The family's kernel ids, for parametrize: a placeholder id that skips when there are none."""
    path = manifest_path()
    if not path.is_file():
        return ["<no manifest>"]
    return [k.id for k in Manifest.from_path(path) if k.family == family] or [f"<no {family} kernels in the manifest>"]


def hopper_manifest(what: str) -> tuple[Manifest, Path]:
    """The manifest under test and its path, on a Hopper GPU 0 (``what`` names the sm_90a kernels the
    caller needs); skips with the reason otherwise."""
    ok, why = _cuda.available()
    if not ok:
        pytest.skip(f"no CUDA device: {why}")
    if device.compute_capability(0) != (9, 0):
        pytest.skip(f"the {what} are sm_90a; device 0 is {device.compute_capability(0)}")
    path = manifest_path()
    if not path.is_file():
        pytest.skip(f"no manifest at {path}: run `bazel build //kernels:all` or set CUBINSTORE_TEST_MANIFEST")
    return Manifest.from_path(path), path


def family_library(family: str, tmp_path_factory: pytest.TempPathFactory) -> launch.Library:
    """A library over the manifest under test, on a Hopper GPU 0; skips with the reason otherwise."""
    manifest, path = hopper_manifest(f"{family} kernels")
    if not manifest.find(family):
        pytest.skip(f"manifest {path} has no {family} kernels")
    # The local store CUBINSTORE_HOME names (e.g. filled by `cubinstore unpack`), else a fresh one,
    # backed by the build tree the manifest sits in (bazel-bin/kernels).
    home = os.environ.get("CUBINSTORE_HOME") or tmp_path_factory.mktemp("cubinstore-home")
    return launch.open(manifest, Store([LocalLayer(home), DirectorySource(path.parent)]))


def gemm_operands(torch: Any, m: int, n: int, k: int) -> tuple[Any, Any]:
    """Fresh random bf16 A (M x K) and B (N x K) on GPU 0: no fixed seed, the kernel must be right on any data."""
    a = torch.randn(m, k, device="cuda:0").to(torch.bfloat16)
    b = torch.randn(n, k, device="cuda:0").to(torch.bfloat16)
    return a, b


def gemm_rel_error(torch: Any, d: Any, a: Any, b: Any) -> float:
    """||D - A B^T|| / ||A B^T|| against a float32 reference of the same bf16 inputs, once the GPU is done."""
    torch.cuda.synchronize()
    ref = a.float() @ b.float().T
    return float((d.float() - ref).norm() / ref.norm())


#: ||D - A B^T|| / ||A B^T|| below which a bf16 GEMM result is right.
GEMM_MAX_REL_ERROR = 1e-2


def check_gemm(torch: Any, d: Any, a: Any, b: Any, what: str) -> None:
    """D is M x N bf16, every element written (D was NaN-poisoned) and within GEMM_MAX_REL_ERROR of A B^T."""
    torch.cuda.synchronize()
    assert d.shape == (a.shape[0], b.shape[0]) and d.dtype == torch.bfloat16
    unwritten = int(torch.isnan(d).sum())
    assert unwritten == 0, f"{what}: {unwritten} of {d.numel()} output elements not written (still NaN)"
    rel = gemm_rel_error(torch, d, a, b)
    assert rel < GEMM_MAX_REL_ERROR, f"{what}: relative error {rel:.3g}"


def resident_ctas(library: Any, kernel_id: str, entry: str, threads: int) -> tuple[int, int]:
    """(registers a thread, CTAs of `threads` an SM holds) of `kernel_id`'s `entry` on GPU 0, as the driver says."""
    fn = library.kernel(kernel_id, device=0)._function(entry)
    drv = _cuda.driver()
    with _cuda.on_device(0):
        regs = _cuda.function_attribute(fn.handle, "CU_FUNC_ATTRIBUTE_NUM_REGS", fn.what)
        resident = _cuda.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(drv.CUfunction(fn.handle), threads, 0),
                               f"occupancy of {fn.what}")
    return int(regs), int(resident)
