"""The skinny family (few rows of A, mma.sync from registers) on a GPU, through ops.gemm.

Needs a compute capability 9.0 GPU, torch, and a manifest holding the `skinny` kernels
(`CUBINSTORE_TEST_MANIFEST`); skips with the reason otherwise. Every run draws fresh random
inputs and poisons D with NaN, so an element the kernel does not write fails the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch
from cubinstore.internals import gemm_launch as G
from helpers.gpu import check_gemm, family_ids, family_library, gemm_operands, resident_ctas


pytestmark = pytest.mark.gpu

# M from 1 to a block and past it (more than one block of rows: B is read again per block);
# N off every BN (8, 16, 32) and 1; K a multiple of 8 but off the chunk (32) and every batch.
SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (32, 1024, 4096), (1, 1, 8), (3, 7, 8), (5, 13, 72),
          (16, 1000, 1000), (9, 4099, 4104), (1, 5000, 3000), (31, 333, 520), (40, 100, 264), (1, 57344, 128)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the skinny tests make their inputs with torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    library = family_library(G.SKINNY_FAMILY, tmp_path_factory)
    ops.set_library(library)
    yield library
    ops.set_library(None)


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_FAMILY))
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=lambda v: str(v))
def test_every_instantiation_matches_float32_reference(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int
) -> None:
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
    check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}")


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_FAMILY))
def test_an_sm_holds_the_ctas_the_selection_model_counts(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    cfg = G.SkinnyConfig.from_id(kernel_id)
    regs, resident = resident_ctas(lib, kernel_id, G.SKINNY_ENTRY, cfg.threads)
    assert resident >= cfg.ctas_per_sm, f"{kernel_id}: {regs} registers a thread, {resident} CTAs an SM"


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_FAMILY))
def test_the_same_inputs_give_the_same_bits_every_launch(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    # The warps' partial sums are added in warp order: no atomics, no arrival order.
    a, b = gemm_operands(torch, 16, 2048, 7168)
    first = ops.gemm_with(a, b, kernel_id=kernel_id, splits=1)
    for _ in range(20):
        again = ops.gemm_with(a, b, kernel_id=kernel_id, splits=1)
        assert torch.equal(first, again), f"{kernel_id}: bits differ between launches"


def test_padded_rows_and_an_offset_start_are_read_by_row_stride(lib: launch.Library, torch: Any) -> None:
    m, n, k = 7, 300, 1000
    a_store, b_store = gemm_operands(torch, m, n, k + 64)
    a, b = a_store[:, 8 : k + 8], b_store[:, :k]  # row stride k + 64; a starts 16 bytes in
    for kernel_id in family_ids(G.SKINNY_FAMILY):
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
        check_gemm(torch, d, a, b, f"{kernel_id}, padded rows")


def test_nothing_is_written_past_d(lib: launch.Library, torch: Any) -> None:
    # D a view into a larger buffer, two bytes in (N odd: element stores need no more).
    m, n, k = 5, 1001, 520
    a, b = gemm_operands(torch, m, n, k)
    for kernel_id in family_ids(G.SKINNY_FAMILY):
        buf = torch.full((m * n + 96,), 7.0, dtype=torch.bfloat16, device="cuda:0")
        d = buf[1 : 1 + m * n].view(m, n)
        d.fill_(float("nan"))
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
        check_gemm(torch, d, a, b, f"{kernel_id}, D inside a buffer")
        assert float(buf[0]) == 7.0 and bool((buf[1 + m * n :] == 7.0).all()), f"{kernel_id} wrote outside D"


def test_ops_gemm_takes_a_skinny_point_for_decode_and_is_right(lib: launch.Library, torch: Any) -> None:
    m, n, k = 1, 4096, 4096
    kernel_id, splits = G.select(lib, 0, m, n, k)
    assert kernel_id.startswith(G.SKINNY_FAMILY + "/") and splits == 1, (kernel_id, splits)
    a, b = gemm_operands(torch, m, n, k)
    check_gemm(torch, ops.gemm(a, b), a, b, f"ops.gemm ({kernel_id}) at {m}x{n}x{k}")


def test_a_captured_graph_replays_a_skinny_launch_with_new_inputs(lib: launch.Library, torch: Any) -> None:
    m, n, k = 4, 2048, 2048
    assert G.select(lib, 0, m, n, k)[0].startswith(G.SKINNY_FAMILY + "/")
    a, b = gemm_operands(torch, m, n, k)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda:0")
    ops.gemm(a, b, out=d)  # prepare (load, select) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gemm(a, b, out=d)
    a2, b2 = gemm_operands(torch, m, n, k)
    a.copy_(a2)
    b.copy_(b2)
    d.fill_(float("nan"))
    graph.replay()
    check_gemm(torch, d, a2, b2, "graph replay")
