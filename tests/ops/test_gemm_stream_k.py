"""Stream-K's deal of work (splits = gemm.STREAM_K), on the CPU.

`walk` below follows `Walk` in kernels/gemm/sm90_bf16_gemm.cuh step by step (the GPU tests
check the kernel's results; these check the rule itself on shapes no GPU run could cover):
every K block of every tile is done exactly once, the pieces of a cut tile are numbered
0..n-1 in K order and agree on n, each CTA writes at most one partial (what the workspace
of `Plan.workspace_floats` holds), a reducer waits only for pieces that start their clusters'
walks, and the selection model's count of the busiest cluster's work (`_stream_k_work`) is
what the deal gives.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from cubinstore.internals import gemm_launch as G, gemm_model as _gemm_model



def walk(cluster_tiles: int, clusters: int, kblocks: int, g: int) -> list[tuple[int, int, int, int, int, int]]:
    """Cluster g's pieces: (tile, kb0, kb1, slot, nslots, partial block or -1), as the kernel's Walk."""
    waves = cluster_tiles // clusters
    dp = (waves - 1) * clusters if waves >= 2 else 0
    iters = (cluster_tiles - dp) * kblocks
    sk = min(clusters, iters)

    def start(c: int) -> int:
        return iters if c >= sk else c * iters // sk

    def owner(j: int) -> int:
        return ((j + 1) * sk - 1) // iters

    out = []
    i, i1 = start(g), (start(g + 1) if g < sk else start(g))
    while i < i1:  # the cut tiles first
        t = i // kblocks
        tile_start = t * kblocks
        kb0, kb1 = i - tile_start, min(i1 - tile_start, kblocks)
        first = owner(tile_start)
        nslots = owner(tile_start + kblocks - 1) - first + 1
        block = g if nslots > 1 and g > first else -1  # slot 0 reduces, the others write
        out.append((t, kb0, kb1, g - first, nslots, block))
        i = tile_start + kb1
    return out + [(u, 0, kblocks, 0, 1, -1) for u in range(cluster_tiles - dp + g, cluster_tiles, clusters)]


CASES = [(1, 1, 1), (1, 132, 64), (7, 132, 1), (96, 132, 24), (140, 132, 64), (200, 132, 9), (264, 132, 64),
         (512, 132, 64), (513, 132, 3), (5, 3, 2), (1000, 66, 17), (131, 132, 1), (133, 132, 2)]


@pytest.mark.parametrize(("tiles", "clusters", "kblocks"), CASES)
def test_every_k_block_of_every_tile_is_done_once(tiles: int, clusters: int, kblocks: int) -> None:
    done: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for g in range(clusters):
        for tile, kb0, kb1, slot, nslots, _ in walk(tiles, clusters, kblocks, g):
            assert 0 <= kb0 < kb1 <= kblocks
            done[tile].append((kb0, kb1, slot, nslots))
    assert sorted(done) == list(range(tiles))
    for tile, pieces in done.items():
        pieces.sort()
        assert [p[0] for p in pieces] == [0] + [p[1] for p in pieces[:-1]] and pieces[-1][1] == kblocks, tile
        assert [p[2] for p in pieces] == list(range(len(pieces))), f"tile {tile}: slots out of K order"
        assert {p[3] for p in pieces} == {len(pieces)}, f"tile {tile}: pieces disagree on their number"


@pytest.mark.parametrize(("tiles", "clusters", "kblocks"), CASES)
def test_each_cta_writes_at_most_one_partial_and_no_two_pieces_share_one(
    tiles: int, clusters: int, kblocks: int
) -> None:
    used: set[int] = set()
    for g in range(clusters):
        blocks = [p[5] for p in walk(tiles, clusters, kblocks, g) if p[5] >= 0]
        assert len(blocks) <= 1 and not used & set(blocks)
        used |= set(blocks)
    assert all(0 <= b < clusters for b in used)


@pytest.mark.parametrize(("tiles", "clusters", "kblocks"), CASES)
def test_a_reducer_waits_only_for_the_first_pieces_of_other_clusters(tiles: int, clusters: int, kblocks: int) -> None:
    # The kernel's slot 0 of a cut tile waits for the other slots; each of those must be the
    # first piece its cluster walks (nothing before it to wait on), and slot 0 the last cut
    # piece of its own range, so no wait chains from cluster to cluster.
    walks = [walk(tiles, clusters, kblocks, g) for g in range(clusters)]
    for w in walks:
        cut = [p for p in w if p[4] > 1]
        for index, (_, _, _, slot, _, _) in enumerate(cut):
            if slot == 0:
                assert index == len(cut) - 1
            else:
                assert index == 0


@pytest.mark.parametrize(("tiles", "clusters", "kblocks"), CASES)
def test_the_model_counts_the_busiest_clusters_work(tiles: int, clusters: int, kblocks: int) -> None:
    pieces, kbs, written, read = _gemm_model._stream_k_work(tiles, clusters, kblocks)
    walks = [walk(tiles, clusters, kblocks, g) for g in range(clusters)]
    assert kbs == max(sum(p[2] - p[1] for p in w) for w in walks)
    assert pieces >= max(len(w) for w in walks)
    assert written >= max(sum(p[5] >= 0 for p in w) for w in walks)
    # No tile needs more partials read back than the busiest count allows.
    assert read >= 0


def test_a_full_last_wave_deals_whole_tiles() -> None:
    for g in range(132):
        assert all(p[4] == 1 for p in walk(264, 132, 64, g))
    assert _gemm_model._stream_k_work(264, 132, 64)[2:] == (0, 0)


def test_plan_sizes_the_stream_k_workspace_by_the_grid() -> None:
    p = G.plan(1280, 3584, 4096, 132, "gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", G.STREAM_K)
    assert (p.stream_k, p.units, p.grid) == (True, 140, 132)
    assert p.workspace_floats == 132 * 128 * 256 and p.counters == 10 * 14
    # Fewer K blocks in the whole problem than SMs: one cluster a K block, no idle cluster.
    tiny = G.plan(100, 100, 128, 132, "gemm/bm128/bn128/bk64/stages5/cluster2/swap0/sm_90a", G.STREAM_K)
    assert (tiny.units, tiny.grid) == (1, 4)
