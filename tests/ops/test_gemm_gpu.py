"""The Hopper bf16 GEMM family on a GPU: every instantiation, and every shape and layout torch.mm takes,
against a float32 reference.

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
from cubinstore.internals import gemm_launch as G, padded
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


@pytest.mark.parametrize(("k", "promotion"), [(2048, "256B"), (2008, "128B"), (1000, "128B")])
def test_the_operands_maps_promote_l2_reads_by_where_their_rows_start(
    lib: launch.Library, torch: Any, k: int, promotion: str
) -> None:
    # G.l2_promotion's rule, in the maps a call keeps (A's and B's rows are K apart; D's N).
    m, n = 1000, 3000
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    G.forget_calls()
    ops.gemm(a, b, out=d)
    check_gemm(torch, d, a, b, f"{m}x{n}x{k}")
    (call,) = [c for c in list(G._calls.values()) if c.shape == (m, n)]
    enum = f"CU_TENSOR_MAP_L2_PROMOTION_L2_{promotion}"
    assert call.maps_a._encoder.args.l2_promotion == call.maps_b._encoder.args.l2_promotion == enum
    assert call.maps_d._encoder.args.l2_promotion == "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"  # D's rows: 3000 apart


@pytest.mark.parametrize("kernel_id", [i for i in family_ids(G.FAMILY) if G.GemmConfig.from_id(i).cluster > 1])
def test_a_cluster_points_grid_is_no_more_than_the_device_holds_at_once(
    lib: launch.Library, torch: Any, kernel_id: str
) -> None:
    cfg = G.GemmConfig.from_id(kernel_id)
    held = lib.kernel(kernel_id, device=0).max_active_clusters(
        G.ENTRY, grid=(cfg.cluster, 1, 1), block=(cfg.threads, 1, 1), shared_mem=cfg.smem_bytes)
    assert 1 <= held <= G.sm_count(0) // cfg.cluster
    # More work units than SMs: the persistent grid is as large as plan() allows. K of 4 blocks of
    # 128 at least, or plan() clamps the 3 splits to the K blocks and no call of 3 splits is made.
    m, n, k = 4096, 4096, 512
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=3)
    check_gemm(torch, d, a, b, f"{kernel_id} splits=3 at {m}x{n}x{k}")
    grids = {c.plan.grid for c in list(G._calls.values())
             if c.shape == (m, n) and c.plan.config.kernel_id == kernel_id and c.plan.splits == 3}
    assert grids == {min(held, G.sm_count(0) // cfg.cluster) * cfg.cluster}


def _stores_d_and_nothing_past_it(torch: Any, kernel_id: str, m: int, n: int, offset: int, *, tma: bool,
                                  splits: tuple[int, ...]) -> None:
    """`kernel_id` at M x N x 520 into a NaN-poisoned D `offset` elements into its buffer, once per split
    count: D's store is TMA's exactly when `tma`, every element of D is written, and none around it."""
    k = 520
    a, b = gemm_operands(torch, m, n, k)
    storage = torch.full((m * n + 4096,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    d = storage[offset : offset + m * n].view(m, n)
    assert G.stores_by_tma(n, d.data_ptr()) == tma
    for count in splits:
        d.fill_(float("nan"))
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=count)
        check_gemm(torch, d, a, b, f"{kernel_id} at {m}x{n}x{k}, D {offset * 2} bytes in, {count} splits")
        assert bool(torch.isnan(storage[:offset]).all() and torch.isnan(storage[offset + m * n :]).all()), \
            "a store wrote outside D"


@pytest.mark.parametrize("kernel_id", [i for i in family_ids(G.FAMILY) if G.GemmConfig.from_id(i).swap])
@pytest.mark.parametrize(("m", "n", "offset"), [(200, 1000, 0), (97, 1000, 0), (200, 1000, 4), (200, 1000, 1),
                                                (105, 999, 0)],
                         ids=["tma", "one-row-past-a-tile", "scalar-off-16-bytes", "scalar-2-bytes-in", "scalar-odd-n"])
def test_a_swapped_instantiation_writes_d_transposed_and_nothing_past_it(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, offset: int
) -> None:
    # The kernel's tile runs BN rows of D by BM columns; its store (a (64, BN) TMA box, or without
    # TMA the box written out a row at a time, or for BM = 64 one element at a time) must land at
    # D[row][col] and stop at M and N.
    _stores_d_and_nothing_past_it(torch, kernel_id, m, n, offset, tma=n % 8 == 0 and offset == 0, splits=(1,))


@pytest.mark.parametrize("kernel_id", [i for i in family_ids(G.FAMILY) if not G.GemmConfig.from_id(i).swap])
@pytest.mark.parametrize(("m", "n", "offset"), [(333, 1001, 0), (97, 255, 0), (300, 512, 4), (300, 512, 1),
                                                (1, 63, 0)],
                         ids=["odd-n", "one-box-row-and-column", "off-16-bytes", "2-bytes-in", "one-row"])
def test_an_unswapped_instantiation_stores_d_off_16_bytes_through_its_box_and_nothing_past_it(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, offset: int
) -> None:
    # Without TMA, each warp puts its 16 rows of a 64 x 64 block in the staging box and writes them
    # out a row at a time (store_tile_staged): every row and column must land, and none past M and N.
    _stores_d_and_nothing_past_it(torch, kernel_id, m, n, offset, tma=False, splits=(1, 3))


@pytest.mark.parametrize("kernel_id", family_ids(G.SKINNY_FAMILY))
@pytest.mark.parametrize(("m", "n"), [(7, 1000), (16, 257)], ids=["n-even", "n-odd"])
def test_a_skinny_instantiation_stores_d_2_bytes_in_and_nothing_past_it(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int
) -> None:
    # Its stores are one element each: a D one element into its buffer is stored in place.
    if kernel_id.startswith("<"):
        pytest.skip(kernel_id)
    _stores_d_and_nothing_past_it(torch, kernel_id, m, n, 1, tma=False, splits=(1,))


def test_an_out_view_off_16_bytes_is_stored_without_tma(lib: launch.Library, torch: Any) -> None:
    m, n, k = 300, 512, 1000
    a, b = gemm_operands(torch, m, n, k)
    storage = torch.full((m * n + 8,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    d = storage[4 : 4 + m * n].view(m, n)  # 8 bytes in: 4-byte aligned, not 16
    assert not G.stores_by_tma(n, d.data_ptr())
    ops.gemm(a, b, out=d)
    check_gemm(torch, d, a, b, "out view 8 bytes in")
    assert bool(torch.isnan(storage[:4]).all() and torch.isnan(storage[4 + m * n :]).all())


# -- every shape and layout torch.mm takes (K off 8, views, offsets: copied where the kernels cannot
# read in place; cubinstore/ops/_gemm_staging.py) --------------------------------------------------

ODD = (1, 7, 9, 15, 127, 1111)
# The shape, small M with deep K off 8, M = 1 with K off 8 (A read in place, B copied), and
# one past the tiles everywhere.
ODD_MORE = [(777, 3333, 1111), (16, 8192, 28671), (1, 4096, 4095), (4097, 4095, 4095), (128, 1, 1)]
LAYOUTS = ("contiguous", "transposed", "2 bytes in", "8 bytes in", "padded rows", "odd row stride",
           "every other row", "expanded")
NAN = float("nan")


def in_layout(torch: Any, x: Any, layout: str) -> Any:
    """`x` (rows x cols, bf16) as a view in `layout`, every element around it NaN (the kernels must not read it).

    "expanded" repeats x's first row (stride 0): the reference is taken from the view, so any values do.
    """
    rows, cols = x.shape
    if layout == "contiguous":
        return x
    if layout == "transposed":  # column-major: K is not the contiguous dimension
        return x.T.contiguous().T
    if layout == "expanded":
        return x[:1].expand(rows, cols)
    if layout in ("2 bytes in", "8 bytes in"):
        offset = 1 if layout == "2 bytes in" else 4
        flat = torch.full((rows * cols + offset,), NAN, dtype=torch.bfloat16, device=x.device)
        view = flat[offset:].view(rows, cols)
    elif layout == "padded rows":  # rows 16-byte multiples apart: the gemm tiles read them in place
        view = torch.full((rows, padded(cols) + 64), NAN, dtype=torch.bfloat16, device=x.device)[:, :cols]
    elif layout == "odd row stride":
        view = torch.full((rows, cols + 1), NAN, dtype=torch.bfloat16, device=x.device)[:, :cols]
    elif layout == "every other row":
        view = torch.full((2 * rows, cols), NAN, dtype=torch.bfloat16, device=x.device)[::2]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    view.copy_(x)
    return view


@pytest.mark.parametrize(("m", "n", "k"), [(m, n, k) for m in ODD for n in ODD for k in ODD] + ODD_MORE, ids=str)
def test_every_odd_shape_matches_float32_reference(lib: launch.Library, torch: Any, m: int, n: int, k: int) -> None:
    a, b = gemm_operands(torch, m, n, k)
    d = torch.full((m, n), NAN, dtype=torch.bfloat16, device="cuda:0")
    what = f"ops.gemm (selected: {G.select(lib, 0, m, n, k, G.layout_copies(lib, a, b))}) at {m}x{n}x{k}"
    assert ops.gemm(a, b, out=d) is d
    check_gemm(torch, d, a, b, what + " into out")
    check_gemm(torch, ops.gemm(a, b), a, b, what)


@pytest.mark.parametrize(("m", "n", "k"), [(127, 1111, 1111), (300, 512, 1000), (9, 15, 7), (1, 4096, 4095),
                                           (16, 1000, 4096)], ids=str)
@pytest.mark.parametrize("layout_a", LAYOUTS)
@pytest.mark.parametrize("layout_b", LAYOUTS)
def test_every_layout_matches_float32_reference_and_leaves_the_operands_alone(
    lib: launch.Library, torch: Any, m: int, n: int, k: int, layout_a: str, layout_b: str
) -> None:
    a0, b0 = gemm_operands(torch, m, n, k)
    a, b = in_layout(torch, a0, layout_a), in_layout(torch, b0, layout_b)
    before_a, before_b = a.clone(), b.clone()
    d = ops.gemm(a, b)
    selected = G.select(lib, 0, m, n, k, G.layout_copies(lib, a, b))
    check_gemm(torch, d, a, b, f"A {layout_a}, B {layout_b} at {m}x{n}x{k} (selected: {selected})")
    assert torch.equal(a, before_a) and torch.equal(b, before_b), "an operand was written"


def _out_in_layout(torch: Any, m: int, n: int, layout: str) -> tuple[Any, Any, Any]:
    """(storage, D view, mask of the storage D covers): the storage all NaN, D an M x N view in `layout`."""
    strides, offset, size = {
        "contiguous": ((n, 1), 0, m * n),
        "transposed": ((1, m), 0, m * n),
        "2 bytes in": ((n, 1), 1, m * n + 1),
        "8 bytes in": ((n, 1), 4, m * n + 4),
        "column slice": ((n + 5, 1), 3, m * (n + 5) + 3),
    }[layout]
    storage = torch.full((size,), NAN, dtype=torch.bfloat16, device="cuda:0")
    covered = torch.zeros(size, dtype=torch.bool, device="cuda:0")
    covered.as_strided((m, n), strides, offset).fill_(True)
    return storage, storage.as_strided((m, n), strides, offset), covered


@pytest.mark.parametrize(("m", "n", "k"), [(300, 512, 1000), (129, 257, 72), (7, 9, 15), (1, 4096, 4095),
                                           (64, 1, 64)], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "2 bytes in", "8 bytes in", "column slice"])
def test_every_out_layout_is_written_and_nothing_around_it(
    lib: launch.Library, torch: Any, m: int, n: int, k: int, layout: str
) -> None:
    a, b = gemm_operands(torch, m, n, k)
    storage, d, covered = _out_in_layout(torch, m, n, layout)
    assert ops.gemm(a, b, out=d) is d
    check_gemm(torch, d, a, b, f"out {layout} at {m}x{n}x{k}")
    assert bool(torch.isnan(storage[~covered]).all()), f"out {layout}: a store wrote outside D"


@pytest.mark.parametrize("kernel_id", family_ids(G.FAMILY) + family_ids(G.SKINNY_FAMILY))
@pytest.mark.parametrize(("m", "n", "k"), [(129, 257, 1111), (7, 13, 9), (16, 1000, 4095), (1, 1, 1)], ids=str)
def test_every_instantiation_takes_k_off_8_and_never_reads_past_k(
    lib: launch.Library, torch: Any, kernel_id: str, m: int, n: int, k: int
) -> None:
    # A's rows are NaN past K and 16-byte multiples apart: every instantiation reads them in place
    # and must stop at K (a gemm tile's maps end there; a skinny point loads K's last 1..7 elements
    # one by one). B is contiguous (rows off 16 bytes): copied for both.
    if kernel_id.startswith("<"):
        pytest.skip(kernel_id)
    a0, b = gemm_operands(torch, m, n, k)
    a = in_layout(torch, a0, "padded rows")
    skinny = kernel_id.startswith(G.SKINNY_FAMILY + "/")
    for splits in [1] if skinny else [1, 3, G.STREAM_K]:
        d = torch.full((m, n), NAN, dtype=torch.bfloat16, device="cuda:0")
        ops.gemm_with(a, b, out=d, kernel_id=kernel_id, splits=splits)
        check_gemm(torch, d, a, b, f"{kernel_id} splits={splits} at {m}x{n}x{k}, A in padded rows")


def test_repeat_calls_that_copy_reuse_the_prepared_launch_and_the_maps(lib: launch.Library, torch: Any) -> None:
    # The copies come from torch's caching allocator, which hands the same addresses back call after
    # call: their maps are encoded once, and the signature is prepared once.
    a, b = gemm_operands(torch, 777, 3333, 1111)
    for _ in range(2):
        ops.gemm(a, b)
    before = G.cache_misses()
    for _ in range(20):
        d = ops.gemm(a, b)
    after = G.cache_misses()
    assert (after["prepared"], after["selection"]) == (before["prepared"], before["selection"])
    assert after["tensor_map"] - before["tensor_map"] <= 4, "the copies' maps were encoded again and again"
    check_gemm(torch, d, a, b, "repeated, through copies")
    calls = [c for key, c in G._calls.items() if key[2] == a.shape and key[6] == b.shape and key[8] is None]
    assert calls and all(c.staging is not None and c.staging.a.copy and c.staging.b.copy for c in calls)
