"""The Hopper bf16 GEMM family on a GPU: every instantiation against a float32 reference.

Needs a compute capability 9.0 GPU, torch, and a manifest holding the `gemm`
kernels (`CUBINSTORE_TEST_MANIFEST`, default `bazel-bin/kernels/manifest.json`);
skips with the reason otherwise. Blobs go through a real `Store`: a fresh local
store filled from the directory the manifest sits in. Each run draws fresh
random inputs and poisons the output with NaN, so an element the kernel does
not write fails the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch
from cubinstore.ops import _gemm as G
from helpers.gpu import check_gemm, family_ids, family_library, gemm_operands


pytestmark = pytest.mark.gpu

SQUARES = [(s, s, s) for s in (64, 256, 1024, 4096)]
LLM = [(m, n, k) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)) for m in (1, 64, 128, 4096)]
# Not multiples of any tile edge (64, 128, 192, 256) nor of BK; odd N takes the scalar store path.
TAILS = [(1000, 1000, 1008), (1, 1, 8), (7, 13, 8), (129, 257, 72), (255, 191, 4104), (4097, 333, 1000),
         (300, 4099, 520)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the GEMM tests make their inputs with torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    library = family_library(G.FAMILY, tmp_path_factory)
    ops.set_library(library)
    yield library
    ops.set_library(None)


@pytest.mark.parametrize("kernel_id", family_ids(G.FAMILY))
@pytest.mark.parametrize(("m", "n", "k"), SQUARES + LLM + TAILS, ids=lambda v: str(v))
@pytest.mark.parametrize("splits", [1, 3, G.STREAM_K])
def test_every_instantiation_matches_float32_reference(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int, splits: int
) -> None:
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=splits)
    check_gemm(torch, d, a, b, f"{kernel_id} splits={splits} at {m}x{n}x{k}")


@pytest.mark.parametrize(("m", "n", "k"), SQUARES + LLM + TAILS, ids=lambda v: str(v))
def test_tuned_gemm_matches_float32_reference(lib: launch.Library, torch: Any, m: int, n: int, k: int) -> None:
    a, b = gemm_operands(torch, m, n, k)
    d = ops.gemm(a, b)
    check_gemm(torch, d, a, b, f"ops.gemm (selected: {G.select(lib, 0, m, n, k)}) at {m}x{n}x{k}")


@pytest.mark.parametrize("splits", [8, G.STREAM_K])
def test_split_k_counters_are_left_at_zero_for_the_next_call(lib: launch.Library, torch: Any, splits: int) -> None:
    # Same stream, same tiles, back to back: the second call only works if the
    # first reset every arrival counter.
    kernel_id = lib.manifest.find(G.FAMILY)[0].id
    for _ in range(3):
        a, b = gemm_operands(torch, 200, 1000, 4096)
        d = torch.full((200, 1000), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=splits)
        check_gemm(torch, d, a, b, f"{kernel_id} splits={splits}, repeated")
    counters = G._counters[(0, int(torch.cuda.current_stream(0).cuda_stream))]
    assert int(counters.abs().sum()) == 0


def test_padded_row_strides_are_read_through_the_tensor_map(lib: launch.Library, torch: Any) -> None:
    m, n, k = 300, 500, 1000
    a_store, b_store = gemm_operands(torch, m, n, k + 64)
    a, b = a_store[:, 8 : k + 8], b_store[:, :k]  # row stride k + 64; a starts 16 bytes in
    assert not a.is_contiguous()
    d = ops.gemm(a, b)
    check_gemm(torch, d, a, b, "padded rows")


def test_runs_on_the_current_torch_stream(lib: launch.Library, torch: Any) -> None:
    a, b = gemm_operands(torch, 512, 512, 512)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        d = torch.full((512, 512), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ops.gemm(a, b, out=d)
    stream.synchronize()
    check_gemm(torch, d, a, b, "side stream")


def test_wrong_dtype_on_the_gpu_is_refused_before_launch(lib: launch.Library, torch: Any) -> None:
    a = torch.randn(64, 64, device="cuda:0")
    b = torch.randn(64, 64, device="cuda:0").to(torch.bfloat16)
    from cubinstore.errors import BadArgumentError

    with pytest.raises(BadArgumentError, match=r"^gemm a: expected dtype bfloat16, got float32$"):
        ops.gemm(a, b)


def test_d_through_tma_writes_nothing_past_m_and_n(lib: launch.Library, torch: Any) -> None:
    # N a multiple of 8 but not of any tile edge: the TMA boxes of D are clipped at M and N.
    m, n, k = 1000, 1000, 1008
    a, b = gemm_operands(torch, m, n, k)
    storage = torch.full((m * n + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    d = storage[: m * n].view(m, n)
    assert G.stores_by_tma(n, d.data_ptr())
    ops.gemm(a, b, out=d)
    check_gemm(torch, d, a, b, "D through TMA")
    assert bool(torch.isnan(storage[m * n :]).all()), "a TMA store wrote past D"


@pytest.mark.parametrize("kernel_id", [i for i in family_ids(G.FAMILY) if G.GemmConfig.from_id(i).cluster > 1])
def test_a_cluster_points_grid_is_no_more_than_the_device_holds_at_once(
    lib: launch.Library, torch: Any, kernel_id: str
) -> None:
    cfg = G.GemmConfig.from_id(kernel_id)
    held = lib.kernel(kernel_id, device=0).max_active_clusters(
        G.ENTRY, grid=(cfg.cluster, 1, 1), block=(cfg.threads, 1, 1), shared_mem=cfg.smem_bytes)
    assert 1 <= held <= G.sm_count(0) // cfg.cluster
    # More work units than SMs: the persistent grid is as large as plan() allows.
    m, n, k = 4096, 4096, 256
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=3)
    check_gemm(torch, d, a, b, f"{kernel_id} splits=3 at {m}x{n}x{k}")
    grids = {c.plan.grid for c in list(G._calls.values())
             if c.shape == (m, n) and c.plan.config.kernel_id == kernel_id and c.plan.splits == 3}
    assert grids == {min(held, G.sm_count(0) // cfg.cluster) * cfg.cluster}


@pytest.mark.parametrize("kernel_id", [i for i in family_ids(G.FAMILY) if G.GemmConfig.from_id(i).swap])
@pytest.mark.parametrize(("m", "n", "offset"), [(200, 1000, 0), (97, 1000, 0), (200, 1000, 4), (105, 999, 0)],
                         ids=["tma", "one-row-past-a-tile", "scalar-off-16-bytes", "scalar-odd-n"])
def test_a_swapped_instantiation_writes_d_transposed_and_nothing_past_it(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, offset: int
) -> None:
    # The kernel's tile runs BN rows of D by BM columns; its store (a (64, BN) TMA box or one
    # element at a time) must land at D[row][col] and stop at M and N.
    k = 520
    a, b = gemm_operands(torch, m, n, k)
    storage = torch.full((m * n + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    d = storage[offset : offset + m * n].view(m, n)
    assert G.stores_by_tma(n, d.data_ptr()) == (n % 8 == 0 and offset == 0)
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
    check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}, D {offset * 2} bytes in")
    assert bool(torch.isnan(storage[:offset]).all() and torch.isnan(storage[offset + m * n :]).all()), \
        "a store wrote outside D"


def test_an_out_view_off_16_bytes_is_stored_without_tma(lib: launch.Library, torch: Any) -> None:
    m, n, k = 300, 512, 1000
    a, b = gemm_operands(torch, m, n, k)
    storage = torch.full((m * n + 8,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    d = storage[4 : 4 + m * n].view(m, n)  # 8 bytes in: 4-byte aligned, not 16
    assert not G.stores_by_tma(n, d.data_ptr())
    ops.gemm(a, b, out=d)
    check_gemm(torch, d, a, b, "out view 8 bytes in")
    assert bool(torch.isnan(storage[:4]).all() and torch.isnan(storage[4 + m * n :]).all())
