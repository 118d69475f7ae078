"""The templated `tgemm` family on a GPU: every instantiation, launched through cubinstore with only the
manifest's launch geometry, against a float64 reference.

`tgemm` is written the way template libraries write kernels (kernels/tgemm/README.md): a `CUTLASS_GLOBAL`
function template, so each entry is a local symbol; scalars before the tensor maps; one generated
translation unit per point. So these tests are also the end-to-end check of what issue 7 asks of
cubinstore: local symbols found, readable and mangled entry names, the compiler's parameter offsets,
and block / shared memory / grid from the manifest (`k.launch` gets no geometry here).

Needs a compute capability 9.0 GPU, torch, and a manifest holding the `tgemm` kernels
(`CUBINSTORE_TEST_MANIFEST`, default `bazel-bin/kernels/manifest.json`); skips with the reason
otherwise. Inputs are fresh random data on every run and the output is poisoned with NaN, so an
element the kernel does not write fails the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cubinstore import launch
from helpers.gpu import family_ids, family_library
from cubinstore.tensormap import from_tensor

FAMILY = "tgemm"
ENTRY = "cubinstore::tgemm::tgemm_impl<cubinstore::tgemm::{dtype}, {bm}, {bn}, {bk}, {stages}>"
# The Itanium mangling of ENTRY (what the CUBIN's symbol table holds).
MANGLED = ("_ZN10cubinstore5tgemm10tgemm_implINS0_{dtl}{dtype}ELi{bm}ELi{bn}ELi{bk}ELi{stages}EEEvjjjPKfS4_"
           "14CUtensorMap_stS5_P13__nv_bfloat16")

pytestmark = pytest.mark.gpu

# bf16 output rounding alone gives about 2e-3; fp8 accumulation without promotion to fp32 would
# drift towards 1e-2 at K = 4096.
MAX_REL_ERROR = 1e-2
# Tails in M, N and K (K a multiple of 16, which both dtypes take); odd N takes the scalar store
# path; one exact tile; large K, where fp8 accumulation error shows.
SHAPES = [(1, 1, 16), (128, 256, 128), (77, 301, 144), (300, 520, 1040), (1000, 1000, 1008),
          (257, 4095, 2048), (129, 257, 4112), (4096, 4096, 4096), (333, 14336, 4096), (4096, 1024, 14336)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the tgemm tests make their inputs with torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    yield family_library(FAMILY, tmp_path_factory)


def _params(lib: launch.Library, kernel_id: str) -> dict[str, Any]:
    spec = next(k for k in lib.manifest if k.id == kernel_id)
    return {key: spec.params[key] for key in ("dtype", "bm", "bn", "bk", "stages")}


class Problem:
    """Fresh random A (M x K), B (N x K), fp32 scales and a NaN-poisoned D for one instantiation."""

    def __init__(self, torch: Any, p: dict[str, Any], m: int, n: int, k: int, *, scales: bool,
                 a: Any = None) -> None:
        self.torch, self.p = torch, p
        dtype = torch.bfloat16 if p["dtype"] == "bf16" else torch.float8_e4m3fn
        self.a = a if a is not None else torch.randn(m, k, device="cuda:0").to(dtype)
        self.b = torch.randn(n, k, device="cuda:0").to(dtype)
        self.sa = torch.rand(m, device="cuda:0") + 0.5 if scales else None
        self.sb = torch.rand(n, device="cuda:0") + 0.5 if scales else None
        self.d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")

    def args(self) -> tuple[Any, ...]:
        # Boxes of one 128-byte swizzle row of K by BM (A) or BN (B) rows: kernels/tgemm/README.md.
        inner = 128 // self.a.element_size()
        tma_a = from_tensor(self.a, box=[self.p["bm"], inner], swizzle="128B")
        tma_b = from_tensor(self.b, box=[self.p["bn"], inner], swizzle="128B")
        m, k = self.a.shape
        n = self.b.shape[0]
        return (m, n, k, self.sa if self.sa is not None else 0, self.sb if self.sb is not None else 0,
                tma_a, tma_b, self.d)

    def check(self, what: str) -> None:
        torch = self.torch
        torch.cuda.synchronize()
        unwritten = int(torch.isnan(self.d).sum())
        assert unwritten == 0, f"{what}: {unwritten} of {self.d.numel()} output elements not written (still NaN)"
        ref = self.a.double() @ self.b.double().T
        if self.sa is not None:
            ref = ref * self.sa.double()[:, None] * self.sb.double()[None, :]
        rel = float((self.d.double() - ref).norm() / ref.norm())
        assert rel < MAX_REL_ERROR, f"{what}: relative error {rel:.3g}"


@pytest.mark.parametrize("kernel_id", family_ids(FAMILY))
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scales", [True, False], ids=["scaled", "unscaled"])
def test_every_instantiation_matches_float64_reference_with_manifest_geometry(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int, scales: bool
) -> None:
    p = _params(lib, kernel_id)
    kern = lib.kernel(FAMILY, **p)
    prob = Problem(torch, p, m, n, k, scales=scales)
    kern.launch(ENTRY.format(**p), args=prob.args())  # no grid, block or shared_mem: the manifest's
    prob.check(f"{kernel_id} at {m}x{n}x{k} {'scaled' if scales else 'unscaled'}")


@pytest.mark.parametrize("kernel_id", family_ids(FAMILY))
def test_mangled_entry_name_launches_the_same_kernel(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    p = _params(lib, kernel_id)
    kern = lib.kernel(FAMILY, **p)
    prob = Problem(torch, p, 300, 520, 1040, scales=True)
    kern.launch(MANGLED.format(dtl=len(p["dtype"]), **p), args=prob.args())
    prob.check(f"{kernel_id} by mangled name")


@pytest.mark.parametrize("kernel_id", family_ids(FAMILY))
def test_repeated_launches_give_identical_bits(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    # A race (a stage released or refilled too early) shows as results that move between runs.
    p = _params(lib, kernel_id)
    kern = lib.kernel(FAMILY, **p)
    prob = Problem(torch, p, 2000, 3000, 4096, scales=True)
    kern.launch(ENTRY.format(**p), args=prob.args())
    prob.check(f"{kernel_id} first launch")
    first = prob.d.clone()
    for _ in range(3):
        prob.d.fill_(float("nan"))
        kern.launch(ENTRY.format(**p), args=prob.args())
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), prob.d.view(torch.int16)), f"{kernel_id}: bits moved"


@pytest.mark.parametrize("kernel_id", family_ids(FAMILY))
def test_padded_row_stride_is_read_through_the_tensor_map(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    p = _params(lib, kernel_id)
    dtype = torch.bfloat16 if p["dtype"] == "bf16" else torch.float8_e4m3fn
    m, n, k = 300, 500, 1024
    store = torch.randn(m, k + 64, device="cuda:0").to(dtype)
    a = store[:, 16 : k + 16]  # row stride k + 64 elements; starts 16 elements (16 or 32 bytes) in
    assert not a.is_contiguous()
    prob = Problem(torch, p, m, n, k, scales=True, a=a)
    lib.kernel(FAMILY, **p).launch(ENTRY.format(**p), args=prob.args())
    prob.check(f"{kernel_id} with padded rows of A")


def test_runs_on_the_current_torch_stream(lib: launch.Library, torch: Any) -> None:
    # On a side stream, A is overwritten behind a long sleep and the kernel launched after it: only
    # a launch on that same stream is ordered after the copy (torch's streams do not synchronise
    # with the legacy default stream), so a kernel sent elsewhere reads the old A and fails.
    kernel_id = family_ids(FAMILY)[0]
    p = _params(lib, kernel_id)
    kern = lib.kernel(FAMILY, **p)
    prob = Problem(torch, p, 1024, 1024, 2048, scales=True)
    fresh = torch.randn(prob.a.shape, device="cuda:0").to(prob.a.dtype)
    args = prob.args()  # the maps hold A's address, whose contents change below
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU time
        prob.a.copy_(fresh)
        kern.launch(ENTRY.format(**p), args=args)
    stream.synchronize()
    prob.check(f"{kernel_id} on a side stream")
