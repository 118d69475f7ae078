"""The gemm_kc family (a K split inside a cluster) on a GPU: every instantiation against a float32
reference, its stores, its grid, and the same bits on every launch.

Needs what test_gemm_gpu.py needs (a compute capability 9.0 GPU, torch, the manifest under test) and
skips with the reason otherwise. Each run draws fresh random inputs and poisons D with NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch
from cubinstore.errors import BadArgumentError
from cubinstore.internals import gemm_launch as G
from helpers.gpu import check_gemm, family_ids, family_library, gemm_operands

from test_gemm_gpu import LLM, SQUARES, TAILS, _stores_d_and_nothing_past_it, in_layout

pytestmark = pytest.mark.gpu

KC_IDS = family_ids(G.KC_FAMILY)
# K shorter than the cluster: the first ranks' shares are empty (K = 8 and 72 are one and two K blocks).
SHORT_K = [(64, 128, 8), (200, 300, 72), (1, 1, 1)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the GEMM tests make their inputs with torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    library = family_library(G.KC_FAMILY, tmp_path_factory)
    ops.set_library(library)
    yield library
    ops.set_library(None)


def _skip_placeholder(kernel_id: str) -> None:
    if kernel_id.startswith("<"):
        pytest.skip(kernel_id)


@pytest.mark.parametrize("kernel_id", KC_IDS)
@pytest.mark.parametrize(("m", "n", "k"), SQUARES + LLM + TAILS + SHORT_K, ids=lambda v: str(v))
def test_every_kc_instantiation_matches_float32_reference(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int
) -> None:
    _skip_placeholder(kernel_id)
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
    check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}")


@pytest.mark.parametrize("kernel_id", KC_IDS)
def test_a_kc_launch_gives_the_same_bits_every_time(lib: launch.Library, torch: Any, kernel_id: str) -> None:
    # The first CTA adds its peers' partials in rank order, whatever order they arrive in.
    _skip_placeholder(kernel_id)
    a, b = gemm_operands(torch, 512, 1024, 4096)
    first = ops.gemm_with(a, b, kernel_id=kernel_id, splits=1)
    for _ in range(5):
        assert torch.equal(ops.gemm_with(a, b, kernel_id=kernel_id, splits=1), first), kernel_id


@pytest.mark.parametrize("kernel_id", KC_IDS)
def test_a_kc_grid_is_whole_clusters_no_more_than_the_device_holds(
    lib: launch.Library, torch: Any, kernel_id: str
) -> None:
    _skip_placeholder(kernel_id)
    cfg = G.GemmConfig.from_id(kernel_id)
    size = cfg.cluster_ctas
    held = lib.kernel(kernel_id, device=0).max_active_clusters(
        G.ENTRY, grid=(size, 1, 1), block=(cfg.threads, 1, 1), shared_mem=cfg.smem_bytes)
    assert 1 <= held <= G.sm_count(0) // size
    assert G.cluster_slots(lib, 0).get(size) == held  # what the selection plans with
    m, n, k = 4096, 4096, 256  # more tiles than clusters: the persistent grid is as large as allowed
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
    check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}")
    grids = {c.plan.grid for c in list(G._calls.values()) if c.shape == (m, n) and c.plan.config.kernel_id == kernel_id}
    assert grids == {min(held, G.sm_count(0) // size) * size}
    with pytest.raises(BadArgumentError, match="takes no K split"):
        ops.gemm_with(a, b, kernel_id=kernel_id, splits=2)


@pytest.mark.parametrize("kernel_id", KC_IDS)
@pytest.mark.parametrize(("m", "n", "offset"), [(333, 1001, 0), (300, 512, 0), (300, 512, 4), (300, 512, 1)],
                         ids=["odd-n", "tma", "off-16-bytes", "2-bytes-in"])
def test_a_kc_instantiation_stores_d_and_nothing_past_it(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, offset: int
) -> None:
    _skip_placeholder(kernel_id)
    _stores_d_and_nothing_past_it(torch, kernel_id, m, n, offset, tma=n % 8 == 0 and offset == 0, splits=(1,))


@pytest.mark.parametrize("kernel_id", KC_IDS)
@pytest.mark.parametrize(("m", "n", "k"), [(129, 257, 1111), (7, 13, 9), (16, 1000, 4095)], ids=str)
def test_a_kc_instantiation_takes_k_off_8_and_never_reads_past_k(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int
) -> None:
    # A's rows are NaN past K (padded rows, read in place); B is contiguous with K off 8 (copied).
    _skip_placeholder(kernel_id)
    a0, b = gemm_operands(torch, m, n, k)
    a = in_layout(torch, a0, "padded rows")
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=1)
    check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}, A in padded rows")
