"""The skinny_any family (skinny reading rows at any element address) on a GPU, through ops.gemm.

Needs a compute capability 9.0 GPU, torch, and a manifest holding the `skinny_any` kernels
(`CUBINSTORE_TEST_MANIFEST`); skips with the reason otherwise. Operands are views whose rows
start off 16 bytes (contiguous with K off 8, element offsets, odd row strides), their storage
past each row NaN, and D is NaN-poisoned: a read outside a row or an element left unwritten fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch
from cubinstore.internals import gemm_launch as G
from helpers.gpu import check_gemm, family_ids, family_library, resident_ctas

pytestmark = pytest.mark.gpu

# K off 8 (every residue), below a chunk, and long; M to a block of 32 rows; N off every BN.
SHAPES = [(1, 4096, 4095), (16, 1000, 1001), (32, 300, 4097), (7, 13, 9), (1, 1, 1), (3, 5, 2),
          (9, 257, 77), (16, 64, 8), (1, 4099, 12293), (31, 33, 3)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the skinny_any tests make their inputs with torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    library = family_library(G.SKINNY_ANY_FAMILY, tmp_path_factory)
    ops.set_library(library)
    yield library
    ops.set_library(None)


def _view(torch: Any, rows: int, k: int, offset: int, stride: int) -> Any:
    """rows x k bf16 at `offset` elements into a fresh storage, rows `stride` apart, NaN around and between rows."""
    store = torch.full((offset + rows * stride + 8,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    view = store[offset:offset + rows * stride].view(rows, stride)[:, :k]
    view.copy_(torch.randn(rows, k, device="cuda:0").to(torch.bfloat16))
    return view


def _layouts(k: int) -> list[tuple[int, int, int, int]]:
    """(A's offset, A's row stride, B's offset, B's row stride): contiguous, then every start off 16 bytes."""
    return [(0, k, 0, k), (1, k + 1, 3, k + 3), (5, k + 7, 7, k), (2, k, 6, k + 5)]


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_ANY_FAMILY))
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=lambda v: str(v))
def test_every_instantiation_reads_rows_at_any_address(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int
) -> None:
    for off_a, lda, off_b, ldb in _layouts(k):
        a, b = _view(torch, m, k, off_a, lda), _view(torch, n, k, off_b, ldb)
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
        check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}, A at +{off_a} rows {lda}, B at +{off_b} rows {ldb}")


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_ANY_FAMILY))
def test_an_sm_holds_the_ctas_the_contract_states(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    cfg = G.SkinnyConfig.from_id(kernel_id)
    regs, resident = resident_ctas(lib, kernel_id, G.SKINNY_ENTRY, cfg.threads)
    assert resident >= cfg.ctas_per_sm, f"{kernel_id}: {regs} registers a thread, {resident} CTAs an SM"


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_ANY_FAMILY))
def test_the_same_inputs_give_the_same_bits_every_launch(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    a, b = _view(torch, 16, 7167, 1, 7167), _view(torch, 2048, 7167, 3, 7167)
    first = ops.gemm_with(a, b, kernel_id=kernel_id, splits=1)
    for _ in range(10):
        assert torch.equal(first, ops.gemm_with(a, b, kernel_id=kernel_id, splits=1)), f"{kernel_id}: bits differ"


# 16x8192x28671: on rows of 28672 a gemm tile is faster, but from contiguous tensors it would
# copy 941 MB first; the selection weighs that copy (G.layout_copies) and takes a skinny point.
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4095), (4, 1024, 1001), (8, 4096, 4095), (1, 8192, 28671),
                                           (16, 8192, 28671)])
def test_gemm_reads_contiguous_rows_off_16_bytes_in_place(
    lib: launch.Library, torch: Any, caplog: pytest.LogCaptureFixture, m: int, n: int, k: int
) -> None:
    # The selection picks a skinny point for these; the rows are off 16 bytes, so the launch runs
    # the skinny_any point of its BM and BN and copies nothing (the launch's debug line says which).
    a, b = _view(torch, m, k, 0, k), _view(torch, n, k, 0, k)
    chosen = G.config_of(G.select(lib, 0, m, n, k, G.layout_copies(lib, a, b))[0])
    assert isinstance(chosen, G.SkinnyConfig) and not chosen.any_rows, f"{m}x{n}x{k}: the selection chose {chosen}"
    with caplog.at_level("DEBUG", logger=G.logger.name):
        d = ops.gemm(a, b)
    check_gemm(torch, d, a, b, f"ops.gemm at {m}x{n}x{k}, contiguous")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"gemm {m}x{n}x{k}:")]
    assert lines and "copies" not in lines[-1], lines
    ran = G.config_of(lines[-1].split()[2])
    assert isinstance(ran, G.SkinnyConfig) and ran.any_rows and (ran.bm, ran.bn) == (chosen.bm, chosen.bn), lines[-1]
