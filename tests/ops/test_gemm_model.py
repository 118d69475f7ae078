"""The gemm selection model (cubinstore/ops/_gemm_model.py) on the CPU.

Expectations come from the work a shape makes (tiles, waves over the SMs, K depth,
bytes), not from running the model: a big square takes a big tile unsplit, a
bandwidth-bound M = 1 splits K to draw HBM from more SMs, a shape whose tiles leave a
nearly empty last wave takes an option that fills its waves better. Every id the model
can return must exist in the built manifest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import MachineCosts, Model, TileCosts
from cubinstore.internals import gemm_calibration as _gemm_calibration
from cubinstore.internals import gemm_launch as G
from cubinstore.internals import gemm_model as _gemm_model
from cubinstore.internals import gemm_staging
from cubinstore.internals import gemm_tuning as _gemm_tuning
from cubinstore.manifest import Manifest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gemm  # noqa: E402  (benchmarks/bench_gemm.py: GRID, the instantiations without Bazel)
import gemm_shapes  # noqa: E402  (benchmarks/gemm_shapes.py: the one definition of the shape sets)
import tune_gemm  # noqa: E402  (benchmarks/tune_gemm.py: the calibration's fit and module writer)

MANIFEST = ROOT / "bazel-bin" / "kernels" / "manifest.json"
H200_SMS = 132
H200_SLOTS = {2: 66, 4: 30}  # the clusters of 2 and of 4 an H200 holds at once (Kernel.max_active_clusters)

# The gemm family's points as bench_gemm.GRID lists them for builds without Bazel (the
# manifest test checks that the built manifest has the same ids).
BUILT = frozenset(G.GemmConfig(*point).kernel_id for point in bench_gemm.GRID)
SHAPE_GRID = [(m, n, k) for m in (1, 7, 16, 64, 128, 129, 256, 1000, 4096, 8192)
              for n in (8, 64, 1000, 4096, 14336, 57344) for k in (8, 72, 1000, 4096, 14336)]
ALL_SHAPES = sorted({s.mnk for s in gemm_shapes.TUNING + gemm_shapes.HELD_OUT} | set(SHAPE_GRID))


def _manifest_ids() -> frozenset[str]:
    if not MANIFEST.is_file():
        pytest.skip(f"no manifest at {MANIFEST}: run `bazel build //kernels:all` (CI does before pytest)")
    return frozenset(k.id for k in Manifest.from_path(MANIFEST) if k.family in (G.FAMILY, G.KC_FAMILY))


def _plan(m: int, n: int, k: int, choice: tuple[str, int], sm_count: int = H200_SMS) -> G.Plan:
    """plan() on an H200 (or `sm_count` SMs), its grid capped where the H200 holds fewer clusters."""
    cluster = G.config_of(choice[0]).cluster_ctas
    cap = H200_SLOTS.get(cluster) if sm_count == H200_SMS and cluster > 1 else None
    return G.plan(m, n, k, sm_count, *choice, max_clusters=cap)


def _takes(kernel_id: str, *splits: int) -> tuple[int, ...]:
    """The split counts among `splits` that plan() takes for a gemm or gemm_kc id: 1 alone for gemm_kc."""
    return (1,) if G.GemmConfig.from_id(kernel_id).kcluster > 1 else splits


def _h200_choose(m: int, n: int, k: int, ids: frozenset[str], **kwargs: object) -> tuple[str, int]:
    """`choose` as ops.gemm calls it on an H200: its SMs and the clusters of each size it holds."""
    return _gemm_model.choose(m, n, k, H200_SMS, ids, cluster_slots=H200_SLOTS, **kwargs)  # type: ignore[arg-type]


def _wave_fill(launch: G.Plan) -> float:
    """Fraction of the grid's cluster-slots busy, over all waves: 1.0 when the last wave is full."""
    size = launch.config.cluster_ctas
    clusters = launch.grid // size
    waves = -(-launch.units // clusters)
    slots = H200_SLOTS.get(size, H200_SMS // size)  # clusters held at once
    return launch.units / (waves * slots)


# -- the manifest and the candidates --------------------------------------------------------------


def test_every_id_the_model_can_return_is_in_the_built_manifest() -> None:
    ids = _manifest_ids()
    assert ids == BUILT, f"manifest and bench_gemm.GRID differ: {sorted(ids ^ BUILT)}"
    returned = {_gemm_model.choose(m, n, k, sms, ids, cluster_slots=H200_SLOTS if sms == H200_SMS else None)[0]
                for m, n, k in ALL_SHAPES for sms in (66, 114, H200_SMS)}
    assert returned <= ids
    # Not a degenerate model: the grid of shapes needs several tiles.
    assert len(returned) >= 4, f"expected the shape grid to use several instantiations, got {sorted(returned)}"


def test_every_choice_is_a_valid_launch_whose_splits_plan_keeps() -> None:
    for m, n, k in ALL_SHAPES:
        kernel_id, splits = _h200_choose(m, n, k, BUILT)
        assert splits == G.STREAM_K or 1 <= splits <= min(_gemm_model.MAX_SPLITS, -(-k // G.GemmConfig.from_id(kernel_id).bk))
        assert _plan(m, n, k, (kernel_id, splits)).splits == splits, f"{m}x{n}x{k}: plan() clamps {splits}"


def test_a_candidate_set_without_the_preferred_id_still_gets_a_valid_choice() -> None:
    for m, n, k in ((8192, 8192, 8192), (1, 4096, 4096), (1000, 3000, 2008)):
        preferred, _ = _h200_choose(m, n, k, BUILT)
        rest = BUILT - {preferred}
        other, splits = _h200_choose(m, n, k, rest)
        assert other in rest and splits >= G.STREAM_K
        assert _h200_choose(m, n, k, frozenset({other}))[0] == other


def test_cluster2_only_candidates_are_chosen_when_nothing_else_is_offered() -> None:
    pairs = frozenset(i for i in BUILT if i.endswith("/cluster2/swap0/sm_90a"))
    kernel_id, _ = _h200_choose(4096, 4096, 4096, pairs)
    assert kernel_id in pairs


# -- choices from the work ------------------------------------------------------------------------


def test_a_big_square_takes_a_large_tile_unsplit() -> None:
    kernel_id, splits = _h200_choose(8192, 8192, 8192, BUILT)
    cfg = G.GemmConfig.from_id(kernel_id)
    # 2048 tiles of 128x256 make 15.5 waves: nothing to gain from split-K (stream-K may even out
    # the last half wave); the largest tile area reads the fewest bytes per flop.
    assert cfg.bm * cfg.bn == 128 * 256 and splits in (1, G.STREAM_K)


def test_bandwidth_bound_single_row_splits_k_over_most_sms() -> None:
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 8192)):
        choice = _h200_choose(1, n, k, BUILT)
        launch = _plan(1, n, k, choice)
        # B's bytes are the whole cost; N / 256 tiles alone would draw HBM from a few SMs only.
        tiles = launch.tiles_m * launch.tiles_n
        assert launch.grid >= min(H200_SMS // 2, 4 * tiles), f"1x{n}x{k}: {choice} runs on {launch.grid} SMs"
        if tiles < H200_SMS // 2:
            assert choice[1] > 1, f"1x{n}x{k}: {tiles} tiles, expected split-K, got {choice}"


def test_one_by_4096_squared_splits_k() -> None:
    assert _h200_choose(1, 4096, 4096, BUILT)[1] > 1


def test_a_nearly_empty_last_wave_is_avoided() -> None:
    # 1280 x 3584 is 10 x 14 = 140 tiles of 128x256: a full wave of 132 and a second of 8.
    m, n, k = 1280, 3584, 4096
    large = G.GemmConfig(128, 256, 64, 4, 1).kernel_id
    naive = _plan(m, n, k, (large, 1))
    assert naive.units == 140
    choice = _h200_choose(m, n, k, BUILT, measured=False)  # the model's reasoning, not a timing
    chosen = _plan(m, n, k, choice)
    assert choice[1] > 1 or _wave_fill(chosen) > _wave_fill(naive), (
        f"{m}x{n}x{k}: {choice} fills {_wave_fill(chosen):.2f} of its waves, 128x256 unsplit {_wave_fill(naive):.2f}"
    )


def test_tall_skinny_fills_the_gpu() -> None:
    # N = 256 leaves few tile columns: the choice needs small tiles or split-K to occupy the SMs.
    for m, n, k in ((8192, 256, 4096), (16384, 256, 7168), (32768, 128, 1024)):
        launch = _plan(m, n, k, _h200_choose(m, n, k, BUILT))
        assert launch.grid >= H200_SMS * 3 // 4, f"{m}x{n}x{k}: grid {launch.grid}"


def test_the_defaults_cost_a_cluster2_point_no_more_than_its_twin() -> None:
    # Since the fix of its stage release (2026-12-02) a cluster-2 point runs as fast as its
    # cluster-1 twin or faster (4096^3 128x256: 197.6 against 198.8 us): no penalty, and a
    # CTA of the pair loads only half of B, so where the feed bounds a K block it costs less.
    for kernel_id in sorted(BUILT):
        cfg = G.GemmConfig.from_id(kernel_id)
        if cfg.cluster == 2:
            pair = _gemm_model.default_tile_costs(cfg)
            twin = _gemm_model.default_tile_costs(G.GemmConfig(cfg.bm, cfg.bn, cfg.bk, cfg.stages, 1, cfg.swap))
            assert pair.kblock_us <= twin.kblock_us and pair.unit_us == twin.unit_us, kernel_id


def test_a_skinny_grid_draws_its_share_of_the_hbm_and_a_tile_all_of_it() -> None:
    # Streaming a large B, skinny's plain loads draw less of the HBM than a tile's TMA loads
    # (16x8192x28672: 0.84 on the H200, 0.85 on the H100); the share is a constant, not fitted.
    m, n, k, sms = 16, 8192, 28672, H200_SMS
    skinny = "skinny/bm16/bn16/warps8/unroll4/sm_90a"
    tile = "gemm/bm64/bn128/bk64/stages8/cluster1/swap0/sm_90a"
    machine = _gemm_model.calibrated_model().machine
    full = Model(replace(machine, skinny_hbm_share=1.0))
    share = Model(replace(machine, skinny_hbm_share=0.5))
    assert share.estimate(m, n, k, sms, skinny, 1).memory_us == pytest.approx(
        2 * full.estimate(m, n, k, sms, skinny, 1).memory_us)
    assert share.estimate(m, n, k, sms, tile, 2) == full.estimate(m, n, k, sms, tile, 2)
    # And `options` (the selection's fast path) agrees with `estimate`.
    for model in (full, share):
        fast = {(kid, s): t for t, kid, s in model.options(m, n, k, sms, [skinny])}
        assert fast[(skinny, 1)] == pytest.approx(model.estimate(m, n, k, sms, skinny, 1).time_us)


def test_unaligned_rows_bound_a_k_block_by_the_bytes_a_cta_loads() -> None:
    # K not a multiple of 64: rows of A and B off the 128-byte lines, each box row two L2 lines.
    # The busiest cluster's K blocks take at least the CTA's bytes over its feed each, and
    # together at least the L2's time to feed every CTA's K blocks of the launch.
    model = Model()
    mc = model.machine
    for kernel_id in sorted(BUILT):
        cfg = G.GemmConfig.from_id(kernel_id)
        tile = model.tile_costs(kernel_id).kblock_us
        for splits in _takes(kernel_id, 1, 3):
            aligned = model.estimate(6000, 512, 3008, H200_SMS, kernel_id, splits, H200_SLOTS)
            unaligned = model.estimate(6000, 512, 3000, H200_SMS, kernel_id, splits, H200_SLOTS)
            km, kn = cfg.kernel_dims(6000, 512)
            cta_bytes = (min(cfg.bm, km) + min(cfg.bn, kn) / cfg.cluster) * cfg.bk * 2
            # Every CTA of every cluster, one past M's tiles too (it loads its share of the shared tile).
            tiles_m = -(-km // cfg.bm)
            ctas = -(-tiles_m // cfg.cluster) * cfg.cluster * -(-kn // cfg.bn)
            l2_us = ctas * -(-3000 // cfg.bk) * cta_bytes / mc.unaligned_l2_bytes_per_us
            expected = max(tile, cta_bytes / mc.unaligned_feed_bytes_per_us, l2_us / unaligned.busy_kblocks)
            assert aligned.kblock_us == tile, kernel_id
            assert unaligned.kblock_us == pytest.approx(expected, rel=1e-12), (kernel_id, splits)


def test_with_k_off_8_a_tile_is_costed_on_the_rows_of_the_copy_it_reads() -> None:
    # ops.gemm copies contiguous operands with K off 8 into rows of K rounded up to 8
    # (_gemm_staging.padded): K = 28671 is read in rows of 28672, on the 128-byte lines, so it
    # costs what K = 28672 costs a K block; K = 1001 is read in rows of 1008, off them.
    model = _gemm_model.calibrated_model()
    slower_off_the_lines = 0
    for kernel_id in sorted(BUILT):
        tile = model.tile_costs(kernel_id).kblock_us
        splits = _takes(kernel_id, 2)[0]
        for k, padded_k in ((28671, 28672), (4095, 4096)):
            off, on = (model.estimate(16, 8192, kk, H200_SMS, kernel_id, splits, H200_SLOTS) for kk in (k, padded_k))
            assert off.kblock_us == on.kblock_us == tile, (kernel_id, k)
        slower_off_the_lines += model.estimate(1000, 2000, 1001, H200_SMS, kernel_id, 1, H200_SLOTS).kblock_us > tile
    assert slower_off_the_lines > 0
    # The judge's timings (H200 and H100, 2026-12-06, rows of 28672): gemm 64x128 in 2 splits took
    # 118-121 us at 16x8192x28671 where skinny took 151-156; judged by K, the model took skinny.
    assert _h200_choose(16, 8192, 28671, BUILT) == _h200_choose(16, 8192, 28672, BUILT)
    assert _h200_choose(16, 8192, 28671, BUILT)[0].startswith("gemm/")


def test_the_selection_weighs_the_copies_a_layout_makes_each_family() -> None:
    # 16x8192x28671 from contiguous tensors: a gemm tile needs A and B copied into rows of 28672
    # (941 MB moved: 545.6 us on the H200, 2026-12-06, against 117 for the tile itself), where a
    # skinny point's skinny_any twin reads them in place. Weighing the kernels alone took the
    # tile, and ops.gemm ran at 0.57 of torch.mm there.
    ids = BUILT | _built_skinny_ids()
    m, n, k = 16, 8192, 28671
    tile = gemm_staging.Copies(2, 2 * (m + n) * (k + 28672))
    assert _h200_choose(m, n, k, ids)[0].startswith("gemm/")  # rows of 28672 already: no copy
    assert _h200_choose(m, n, k, ids, copies=(tile, gemm_staging.NO_COPIES))[0].startswith("skinny/")
    # A copy both families make (A's rows off 16 bytes, say) changes nothing.
    both = gemm_staging.Copies(1, 2 * m * (k + 28672))
    assert _h200_choose(m, n, k, ids, copies=(both, both)) == _h200_choose(m, n, k, ids)
    # Nor does the copy of the only family that fits (64 rows: no skinny point): added to every
    # tile it would widen the split margin (64x1000x4095 went from 7 splits to 4 that way).
    for m, n, k in ((64, 1000, 4095), (300, 1000, 4095), (777, 3333, 1111)):
        tiles_copy = gemm_staging.Copies(2, 2 * (m + n) * (k + gemm_staging.padded(k)))
        assert _h200_choose(m, n, k, ids, copies=(tiles_copy, gemm_staging.NO_COPIES)) == _h200_choose(m, n, k, ids)
    model = _gemm_model.calibrated_model()
    machine = model.machine
    assert model.copy_us(tile) == pytest.approx(2 * machine.copy_us + tile.bytes / machine.copy_bytes_per_us)


def test_a_measured_pick_holds_only_where_both_families_copy_alike() -> None:
    # The calibration timed kernels alone: where the layout makes one family copy and not the
    # other, the pick is the model's, copies weighed.
    ids = BUILT | _built_skinny_ids()
    same = (gemm_staging.Copies(1, 10**6),) * 2
    differ = (gemm_staging.Copies(1, 10**6), gemm_staging.NO_COPIES)
    overruled = 0
    for (m, n, k), pick in sorted(_gemm_calibration.PICKS.items()):
        assert _h200_choose(m, n, k, ids, copies=same) == pick
        model_alone = _h200_choose(m, n, k, ids, copies=differ, measured=False)
        assert _h200_choose(m, n, k, ids, copies=differ) == model_alone
        overruled += model_alone != pick
    assert overruled > 0


def test_unaligned_rows_cost_more_the_more_ctas_share_the_l2() -> None:
    # 128x192 in pairs at K = 2008: 128 CTAs take the L2 together at M = 1000, 32 at M = 250
    # (each CTA one tile, the same bytes a K block), so its K block is slower at M = 1000; at
    # K = 2048 (aligned) both are the tile's.
    model = _gemm_model.calibrated_model()
    kernel_id = G.GemmConfig(128, 192, 64, 5, 2).kernel_id
    full, few = (model.estimate(m, 3000, 2008, H200_SMS, kernel_id, 1, H200_SLOTS) for m in (1000, 250))
    assert full.grid == 128 and few.grid == 32 and full.busy_kblocks == few.busy_kblocks
    assert full.kblock_us > few.kblock_us >= model.tile_costs(kernel_id).kblock_us
    for m in (1000, 250):
        assert model.estimate(m, 3000, 2048, H200_SMS, kernel_id, 1, H200_SLOTS).kblock_us == \
            model.tile_costs(kernel_id).kblock_us


def test_clusters_of_4_win_where_unaligned_rows_load_the_l2() -> None:
    # 1000x3000x2008 (H200, 2026-12-04, the judge's timings): 128x200 in clusters of 4 (120
    # CTAs of 178 rows a K block) took 26.1-26.4 us, 128x192 in pairs (128 CTAs of 224 rows)
    # 28.6; the per-CTA floor alone tied them and kept the pair.
    kernel_id, _ = _h200_choose(1000, 3000, 2008, BUILT)
    assert G.GemmConfig.from_id(kernel_id).cluster == 4, kernel_id


def test_a_cluster_point_wins_where_unaligned_rows_make_the_feed_the_bound() -> None:
    # 6000x512x3000 (H200, 2026-12-02): 128x256 cluster 2 took 41.6 us, its cluster-1 twin
    # 55.3 (every instantiation there drew 41-59 KB/us a CTA, about half the aligned rate).
    pair, twin = G.GemmConfig(128, 256, 64, 4, 2).kernel_id, G.GemmConfig(128, 256, 64, 4, 1).kernel_id
    for model in (Model(), _gemm_model.calibrated_model()):
        assert model.predict_us(6000, 512, 3000, H200_SMS, pair, 1) < model.predict_us(6000, 512, 3000, H200_SMS,
                                                                                         twin, 1)
    # The choice shares the tile it loads: a pair, or (since 2026-12-04, measured fastest there) 4 CTAs.
    kernel_id, _ = _h200_choose(6000, 512, 3000, BUILT)
    assert G.GemmConfig.from_id(kernel_id).cluster > 1, kernel_id


def test_the_2026_11_29_winners_are_predicted_near_the_models_best() -> None:
    # The table's measured winners; the model need not pick them (many are near-ties) but must
    # not predict them much slower than its own pick on most shapes.
    table = _gemm_tuning.TABLE
    model = Model()
    near = 0
    for (m, n, k), winner in table.items():
        best = model.predict_us(m, n, k, H200_SMS, *model.choose(m, n, k, H200_SMS, BUILT))
        near += model.predict_us(m, n, k, H200_SMS, *winner) <= 1.10 * best
    assert near >= 0.8 * len(table), f"{near} of {len(table)} winners within 10% of the model's best"


# -- properties -----------------------------------------------------------------------------------


def test_choices_are_deterministic_across_processes_and_set_orders() -> None:
    shapes = [list(s) for s in ALL_SHAPES[::7]]
    code = (
        "import json, sys; from cubinstore.internals import gemm_model as g; ids = json.loads(sys.argv[1]); "
        "print(json.dumps([g.choose(m, n, k, 132, frozenset(ids), cluster_slots={2: 66, 4: 30}) "
        "for m, n, k in json.loads(sys.argv[2])]))"
    )
    runs = []
    for seed, order in (("1", sorted(BUILT)), ("2", sorted(BUILT, reverse=True))):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, json.dumps(order), json.dumps(shapes)], env=env,
                             cwd=ROOT, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    here = [list(_h200_choose(m, n, k, BUILT)) for m, n, k in shapes]
    assert runs[0] == runs[1] == here


def test_more_sms_never_predict_a_longer_time() -> None:
    model = _gemm_model.calibrated_model()
    for m, n, k in ALL_SHAPES[::3]:
        previous = float("inf")
        for sms in (8, 16, 33, 66, 100, 114, 132, 264):
            best = min(model.options(m, n, k, sms, BUILT))[0]
            assert best <= previous, f"{m}x{n}x{k}: {best:.2f} us on {sms} SMs, {previous:.2f} on fewer"
            previous = best
    for kernel_id in sorted(BUILT):
        for splits in _takes(kernel_id, 1, 3, 16):
            times = [model.predict_us(4095, 4097, 4104, sms, kernel_id, splits) for sms in (16, 66, 132, 264)]
            assert times == sorted(times, reverse=True), f"{kernel_id} splits={splits}: {times}"


def test_the_fast_path_agrees_with_the_plan_based_estimate() -> None:
    model = _gemm_model.calibrated_model()
    for m, n, k in ALL_SHAPES[::5]:
        for sms, slots in ((2, None), (66, None), (H200_SMS, None), (H200_SMS, H200_SLOTS), (H200_SMS, {4: 7})):
            options = model.options(m, n, k, sms, sorted(BUILT), slots)
            assert options
            for time, kernel_id, splits in options:
                estimate = model.estimate(m, n, k, sms, kernel_id, splits, slots)
                assert estimate.splits == splits
                assert time == pytest.approx(estimate.time_us, rel=1e-12), f"{m}x{n}x{k} {kernel_id} {splits}"


def test_clusters_beyond_what_the_device_holds_at_once_run_as_another_wave() -> None:
    # Swapped 128x200 in clusters of 4 at 800x4096: 4096 / 128 = 32 tile rows in 8 clusters of 4, by
    # 800 / 200 = 4 tile columns: 32 cluster tiles, which 132 / 4 = 33 slots take in one wave and the
    # H200's 30 co-resident clusters of 4 in two.
    four = G.GemmConfig(128, 200, 64, 4, 4, 1).kernel_id
    model = Model(tiles={four: _gemm_model.default_tile_costs(G.GemmConfig.from_id(four))})
    naive = model.estimate(800, 4096, 4096, H200_SMS, four, 1)
    held = model.estimate(800, 4096, 4096, H200_SMS, four, 1, H200_SLOTS)
    assert (naive.units, naive.grid, naive.busy_units) == (32, 128, 1)
    assert (held.units, held.grid, held.busy_units) == (32, 120, 2)
    assert held.time_us > 1.5 * naive.time_us
    # The fast path sees the same slots; a cluster size the mapping leaves out keeps SMs / size.
    assert [t for t, _, s in model.options(800, 4096, 4096, H200_SMS, [four], H200_SLOTS) if s == 1] == [held.time_us]
    assert model.estimate(800, 4096, 4096, H200_SMS, four, 1, {2: 60}).grid == 128


def test_split_k_costs_its_partials() -> None:
    # Same units, same K blocks a unit: the split option pays the reduction, the unsplit one does not.
    model = Model()
    kernel_id = G.GemmConfig(128, 128, 64, 5, 1).kernel_id
    one = model.estimate(4096, 4096, 4096, H200_SMS, kernel_id, 1)
    two = model.estimate(4096, 4096, 4096, H200_SMS, kernel_id, 2)
    assert one.busy_extra_us == 0 and two.busy_extra_us > 0 and two.busy_units == 2 * one.busy_units


def test_calibrated_constants_override_the_defaults_per_id() -> None:
    kernel_id = G.GemmConfig(128, 256, 64, 4, 1).kernel_id
    slow = Model(tiles={kernel_id: TileCosts(kblock_us=100.0, unit_us=100.0)})
    assert slow.is_calibrated(kernel_id) and not Model().is_calibrated(kernel_id)
    assert slow.choose(8192, 8192, 8192, H200_SMS, BUILT)[0] != kernel_id
    assert Model(MachineCosts(launch_us=50.0)).predict_us(64, 64, 64, H200_SMS, kernel_id, 1) > 50.0


def test_the_calibration_module_says_where_it_was_measured() -> None:
    provenance = _gemm_calibration.PROVENANCE
    if provenance is None:
        assert not _gemm_calibration.TILES and not _gemm_calibration.MACHINE
        return
    assert {"gpu", "sm_count", "date", "torch"} <= set(provenance)
    for kernel_id, (kblock_us, unit_us) in _gemm_calibration.TILES.items():
        G.config_of(kernel_id)  # a gemm or a skinny id
        assert kblock_us > 0 and unit_us >= 0, kernel_id


def test_tuning_and_held_out_shapes_are_disjoint_and_each_has_every_dimension_off_8() -> None:
    tuning = {s.mnk for s in gemm_shapes.TUNING}
    held_out = {s.mnk for s in gemm_shapes.HELD_OUT}
    assert not tuning & held_out
    assert set(_gemm_tuning.TABLE) <= tuning
    for shapes in (tuning, held_out):  # issue 32: shapes off 8 and few rows with deep K in both
        for dim in range(3):
            assert any(shape[dim] % 8 for shape in shapes), f"no shape with dimension {dim} off 8"
        assert any(m <= 32 and k >= 28672 for m, _, k in shapes)
    groups = {s.group for s in gemm_shapes.HELD_OUT}
    assert {"square", "llm", "moe", "tail", "deep-k"} <= groups
    assert any(s.large_m for s in gemm_shapes.HELD_OUT) and any(not s.large_m for s in gemm_shapes.HELD_OUT)


# -- calibration (tune_gemm.py's fit, on timings a known model made) ------------------------------

H200_GPU = tune_gemm.Gpu(H200_SMS, 50 * 2**20, H200_SLOTS)  # the L2 the model's defaults assume


def _truth() -> Model:
    """A GPU unlike the defaults: other machine constants, each tile 20% faster or slower."""
    machine = MachineCosts(launch_us=4.0, hbm_bytes_per_us=3.6e6, fetch_latency_us=2.0, split_unit_us=1.2,
                           partial_bytes_per_us=180e3, overlap_loss=0.15)
    tiles = {}
    for i, kernel_id in enumerate(sorted(BUILT)):
        default = _gemm_model.default_tile_costs(G.GemmConfig.from_id(kernel_id))
        factor = 1 + 0.1 * ((i * 7) % 5 - 2)
        tiles[kernel_id] = TileCosts(kblock_us=default.kblock_us * factor, unit_us=default.unit_us * (2 - factor))
    return Model(machine, tiles)


def test_the_fit_recovers_a_known_gpu_from_its_timings() -> None:
    truth = _truth()
    shapes = set(gemm_shapes.TUNING[::3])  # a third of the tuning set keeps the fit to seconds
    timings = [tune_gemm.Timing(*shape.mnk, kid, s, truth.predict_us(*shape.mnk, H200_SMS, kid, s, H200_SLOTS))
               for shape, kid, s in tune_gemm.plan_timings(sorted(BUILT), H200_GPU)
               if shape in shapes]
    machine, tiles = tune_gemm.fit(timings, H200_GPU, rounds=2)
    fitted = Model(machine, tiles)
    errors = sorted(abs(fitted.predict_us(t.m, t.n, t.k, H200_SMS, t.kernel_id, t.splits, H200_SLOTS) / t.us - 1)
                    for t in timings)
    assert errors[len(errors) // 2] < 0.03 and errors[-1] < 0.15, f"median {errors[len(errors) // 2]:.3f}"
    # On shapes the fit never saw, its picks run (on the known GPU) within 5% of the best.
    good = 0
    for shape in gemm_shapes.HELD_OUT:
        pick = fitted.choose(*shape.mnk, H200_SMS, BUILT)
        best = truth.choose(*shape.mnk, H200_SMS, BUILT)
        good += (truth.predict_us(*shape.mnk, H200_SMS, *pick, H200_SLOTS)
                 <= 1.05 * truth.predict_us(*shape.mnk, H200_SMS, *best, H200_SLOTS))
    assert good >= 0.9 * len(gemm_shapes.HELD_OUT), f"{good} of {len(gemm_shapes.HELD_OUT)}"


def test_cross_validation_judges_each_shape_on_a_fit_that_never_saw_it() -> None:
    truth = _truth()
    shapes = set(gemm_shapes.TUNING[::6])
    timings = [tune_gemm.Timing(*shape.mnk, kid, s, truth.predict_us(*shape.mnk, H200_SMS, kid, s, H200_SLOTS))
               for shape, kid, s in tune_gemm.plan_timings(sorted(BUILT), H200_GPU)
               if shape in shapes]
    seen: list[set[tuple[int, int, int]]] = []
    fit = tune_gemm.fit

    def spy(train: list[tune_gemm.Timing], *args: object) -> tuple[MachineCosts, dict[str, TileCosts]]:
        seen.append({(t.m, t.n, t.k) for t in train})
        return fit(train, *args, rounds=1)  # type: ignore[arg-type]

    tune_gemm.fit = spy  # type: ignore[assignment]
    try:
        regrets = tune_gemm.cross_validate(timings, H200_GPU, repeats=2)
    finally:
        tune_gemm.fit = fit
    # Two halvings, each fitted both ways: every shape judged twice, by fits of the other half.
    assert len(regrets) == 2 * len(shapes) and len(seen) == 4
    for first, second in (seen[0:2], seen[2:4]):
        assert not first & second and first | second == {s.mnk for s in shapes}
    assert all(r >= 1.0 for r in regrets)
    # Timings of a known model: the fits on half of them still pick well on the other half.
    assert sorted(regrets)[len(regrets) // 2] < 1.05, sorted(regrets)


def test_the_written_calibration_module_loads_as_the_fitted_model(tmp_path: Path) -> None:
    truth = _truth()
    provenance = {"gpu": "NVIDIA H200", "sm_count": H200_SMS, "l2_bytes": 50 * 2**20, "date": "2026-12-02",
                  "torch": "2.11.0+cu130", "cuda": "13.0", "reps": 15, "rotation": 4, "shapes": 38, "timings": 2,
                  "cluster_slots": H200_SLOTS}  # int keys, which JSON makes strings: load() makes them ints again
    timings = [tune_gemm.Timing(1, 4096, 4096, sorted(BUILT)[0], 4, 12.5),
               tune_gemm.Timing(4096, 4096, 4096, sorted(BUILT)[1], 1, 201.0)]
    tune_gemm.save(tmp_path / "timings.json", timings, provenance)
    assert tune_gemm.load(tmp_path / "timings.json") == (timings, provenance)
    path = tmp_path / "calibration.py"
    path.write_text(tune_gemm.render(provenance, truth.machine, dict(truth._tiles)))
    spec = importlib.util.spec_from_file_location("calibration_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PROVENANCE == provenance
    loaded = _gemm_model.calibrated_model(module)
    for m, n, k in ALL_SHAPES[::11]:
        assert loaded.choose(m, n, k, H200_SMS, BUILT) == truth.choose(m, n, k, H200_SMS, BUILT)


def test_a_calibration_naming_unknown_machine_fields_is_refused() -> None:
    calibration = types.ModuleType("bad_calibration")
    calibration.MACHINE = {"launch_us": 3.0, "warp_speed": 9.0}  # type: ignore[attr-defined]
    calibration.TILES = {}  # type: ignore[attr-defined]
    with pytest.raises(BadArgumentError, match=r"^bad_calibration.MACHINE: expected fields of MachineCosts "
                                               r"\[.*\], got \['warp_speed'\]"):
        _gemm_model.calibrated_model(calibration)


# -- measured picks (the calibration's winners on the exact shapes it timed) ----------------------


def _not_the_models(model: Model, m: int, n: int, k: int) -> tuple[str, int]:
    """An option the model does not choose at M x N x K (so a test can tell a pick from the model)."""
    own = model.choose(m, n, k, H200_SMS, BUILT, measured=False)
    return next((kid, 3) for kid in sorted(BUILT) if kid != own[0])


def test_a_measured_pick_is_chosen_only_for_its_exact_shape_and_sm_count() -> None:
    plain = Model()
    pick = _not_the_models(plain, 300, 2304, 1544)
    model = Model(picks={(300, 2304, 1544): pick}, picks_sm_count=H200_SMS)
    assert model.choose(300, 2304, 1544, H200_SMS, BUILT) == pick
    # Its neighbours, another GPU, a library without its kernel and the model alone: the model's choice.
    for m, n, k in ((301, 2304, 1544), (300, 2304, 1552), (300, 2312, 1544)):
        assert model.choose(m, n, k, H200_SMS, BUILT) == plain.choose(m, n, k, H200_SMS, BUILT)
    assert model.choose(300, 2304, 1544, 114, BUILT) == plain.choose(300, 2304, 1544, 114, BUILT)
    assert model.choose(300, 2304, 1544, H200_SMS, BUILT - {pick[0]})[0] != pick[0]
    assert model.choose(300, 2304, 1544, H200_SMS, BUILT, measured=False) == plain.choose(300, 2304, 1544,
                                                                                          H200_SMS, BUILT)
    # A bool is not a shape, even where True == 1 would find an entry.
    one = Model(picks={(1, 4096, 4096): pick}, picks_sm_count=H200_SMS)
    with pytest.raises(BadArgumentError, match=r"expected M a positive int, got True"):
        one.choose(True, 4096, 4096, H200_SMS, BUILT)


def test_measured_picks_are_written_only_where_they_beat_the_models_pick_by_the_margin(tmp_path: Path) -> None:
    model = Model()
    timings = []
    faster = {(300, 2304, 1544): 1.10, (4096, 4096, 4096): 1.01}  # the model's pick / the other option
    for (m, n, k), factor in faster.items():
        own = model.choose(m, n, k, H200_SMS, BUILT, measured=False)
        other = _not_the_models(model, m, n, k)
        timings += [tune_gemm.Timing(m, n, k, *own, 100.0), tune_gemm.Timing(m, n, k, *other, 100.0 / factor)]
    picks = tune_gemm.measured_picks(model, timings, H200_GPU)
    assert set(picks) == {(300, 2304, 1544)}
    pick, slower = picks[(300, 2304, 1544)]
    assert pick == _not_the_models(model, 300, 2304, 1544) and slower == pytest.approx(1.10)
    provenance = {"gpu": "NVIDIA H200", "sm_count": H200_SMS, "l2_bytes": 50 * 2**20, "date": "2026-12-02",
                  "torch": "2.11.0+cu130", "cuda": "13.0", "reps": 15, "rotation": 4, "shapes": 2, "timings": 4}
    path = tmp_path / "calibration.py"
    path.write_text(tune_gemm.render(provenance, model.machine, {}, picks))
    spec = importlib.util.spec_from_file_location("calibration_with_picks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PICKS == {(300, 2304, 1544): pick}
    loaded = _gemm_model.calibrated_model(module)
    assert loaded.choose(300, 2304, 1544, H200_SMS, BUILT) == pick
    assert loaded.choose(4096, 4096, 4096, H200_SMS, BUILT) == model.choose(4096, 4096, 4096, H200_SMS, BUILT)


GOOD_ID = G.GemmConfig(128, 256, 64, 4, 1).kernel_id


@pytest.mark.parametrize(("picks", "provenance", "message"), [
    ({(0, 16, 16): (GOOD_ID, 1)}, {"sm_count": 132}, r"PICKS\[\(0, 16, 16\)\]: expected the key \(M, N, K\)"),
    ({(16, 16): (GOOD_ID, 1)}, {"sm_count": 132}, r"PICKS\[\(16, 16\)\]: expected the key \(M, N, K\)"),
    ({(16, 16, 16): "gemm"}, {"sm_count": 132}, r"PICKS\[\(16, 16, 16\)\]: expected \(kernel id, splits\)"),
    ({(16, 16, 16): ("gemm/bogus", 1)}, {"sm_count": 132}, r"PICKS\[\(16, 16, 16\)\]: invalid gemm kernel id"),
    ({(16, 16, 16): (GOOD_ID, 17)}, {"sm_count": 132}, r"PICKS\[\(16, 16, 16\)\]: expected splits 1\.\.16 or 0 \(stream-K\), got 17"),
    ({(16, 16, 16): (GOOD_ID, True)}, {"sm_count": 132}, r"PICKS\[\(16, 16, 16\)\]: expected splits 1\.\.16 or 0 \(stream-K\), got True"),
    ({(16, 16, 16): (GOOD_ID, 1)}, None, r"PICKS: expected PROVENANCE to name the sm_count"),
])
def test_a_calibration_with_a_bad_pick_is_refused(picks: dict, provenance: dict | None, message: str) -> None:
    calibration = types.ModuleType("bad_calibration")
    calibration.MACHINE, calibration.TILES = {}, {}  # type: ignore[attr-defined]
    calibration.PICKS, calibration.PROVENANCE = picks, provenance  # type: ignore[attr-defined]
    with pytest.raises(BadArgumentError, match=r"^bad_calibration\." + message):
        _gemm_model.calibrated_model(calibration)


def _built_skinny_ids() -> frozenset[str]:
    if not MANIFEST.is_file():
        pytest.skip(f"no manifest at {MANIFEST}: run `bazel build //kernels:all` (CI does before pytest)")
    return frozenset(k.id for k in Manifest.from_path(MANIFEST) if k.family == G.SKINNY_FAMILY)


def test_the_shipped_picks_are_tuning_shapes_and_kernels_the_library_builds() -> None:
    picks = getattr(_gemm_calibration, "PICKS", {})
    tuning = {s.mnk for s in gemm_shapes.TUNING}
    held_out = {s.mnk for s in gemm_shapes.HELD_OUT}
    # A held-out shape must never be measured into the selection: it judges the model alone.
    assert set(picks) <= tuning and not set(picks) & held_out
    built = BUILT | _built_skinny_ids()
    for shape, (kernel_id, splits) in picks.items():
        assert kernel_id in built, (shape, kernel_id)
        if kernel_id in BUILT:
            assert _plan(*shape, (kernel_id, splits)).splits == splits, f"{shape}: plan() changes {splits}"


# -- errors ---------------------------------------------------------------------------------------


def test_empty_candidates_name_the_shape() -> None:
    with pytest.raises(BadArgumentError, match=r"^gemm 128x4096x4096 on 132 SMs: expected at least one gemm "
                                               r"candidate that fits, got \[\]"):
        _gemm_model.choose(128, 4096, 4096, H200_SMS, frozenset())


def test_candidates_that_cannot_fit_name_the_shape() -> None:
    pair = G.GemmConfig(128, 256, 64, 4, 2).kernel_id
    with pytest.raises(BadArgumentError, match=r"^gemm 64x64x64 on 1 SMs: expected at least one gemm candidate"):
        _gemm_model.choose(64, 64, 64, 1, frozenset({pair}))


@pytest.mark.parametrize(("shape", "message"), [
    ((0, 4096, 4096, H200_SMS), r"^gemm model 0x4096x4096 on 132 SMs: expected M a positive int, got 0"),
    ((16, -1, 4096, H200_SMS), r"^gemm model 16x-1x4096 on 132 SMs: expected N a positive int, got -1"),
    ((16, 16, 16.0, H200_SMS), r"^gemm model 16x16x16.0 on 132 SMs: expected K a positive int, got 16.0"),
    ((16, 16, 16, 0), r"^gemm model 16x16x16 on 0 SMs: expected sm_count a positive int, got 0"),
])
def test_bad_shapes_are_refused(shape: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        _gemm_model.choose(*shape, BUILT)


def test_a_candidate_that_is_not_a_gemm_id_is_refused() -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid gemm kernel id 'axpy/f32/vec4/sm_90a'"):
        _gemm_model.choose(16, 16, 16, H200_SMS, frozenset({"axpy/f32/vec4/sm_90a"}))


def test_stream_k_is_weighed_only_where_the_last_wave_is_partly_idle() -> None:
    model = _gemm_model.calibrated_model()
    kernel_id = G.GemmConfig(128, 256, 64, 4, 1).kernel_id
    # 264 tiles of 128x256 at 4096x8448: two full waves; 140 at 1280x3584: one and a bit.
    full = {s for _, _, s in model.options(4096, 8448, 4096, H200_SMS, [kernel_id])}
    partial = {s for _, _, s in model.options(1280, 3584, 4096, H200_SMS, [kernel_id])}
    assert G.STREAM_K not in full and G.STREAM_K in partial
    # One and a bit waves of whole tiles cost two waves; stream-K evens them out.
    whole = model.estimate(1280, 3584, 4096, H200_SMS, kernel_id, 1)
    dealt = model.estimate(1280, 3584, 4096, H200_SMS, kernel_id, G.STREAM_K)
    assert dealt.busy_kblocks < whole.busy_kblocks and dealt.busy_extra_us > 0


def test_a_swapped_point_is_weighed_only_once_the_calibration_has_measured_it() -> None:
    swapped = G.GemmConfig(128, 104, 64, 6, 1, 1).kernel_id
    plain = G.GemmConfig(128, 128, 64, 5, 1).kernel_id
    bare = _gemm_model.Model()
    assert [kid for _, kid, _ in bare.options(200, 7168, 2048, 132, [swapped, plain])] == [plain] * len(
        bare.options(200, 7168, 2048, 132, [plain]))
    measured = _gemm_model.Model(tiles={swapped: _gemm_model.default_tile_costs(G.GemmConfig.from_id(swapped))})
    options = measured.options(200, 7168, 2048, 132, [swapped])
    assert options and {kid for _, kid, _ in options} == {swapped}
    # Weighed as the N x M launch: two tiles of 104 rows of A, 56 of 128 along N.
    assert measured.estimate(200, 7168, 2048, 132, swapped, 1).units == 112


def test_the_fewest_splits_win_among_options_estimated_within_the_margin() -> None:
    margin = _gemm_model.SPLIT_MARGIN
    assert _gemm_model.prefer([(10.0, "a", 8), (10.0 * (1 + margin) * 0.99, "b", 4), (11.0, "c", 1)]) == ("b", 4)
    # Stream-K counts as the most splits; outside the margin the fastest wins whatever its splits.
    assert _gemm_model.prefer([(10.0, "a", G.STREAM_K), (10.1, "b", 16)]) == ("b", 16)
    assert _gemm_model.prefer([(10.0, "a", 4), (10.0 * (1 + margin) * 1.01, "b", 1)]) == ("a", 4)
    # Equal splits: the faster, then the smaller id.
    assert _gemm_model.prefer([(10.2, "a", 2), (10.0, "b", 2)]) == ("b", 2)
    assert _gemm_model.prefer([(10.0, "b", 2), (10.0, "a", 2)]) == ("a", 2)


def test_choose_is_prefer_of_the_options_where_no_measured_pick_applies() -> None:
    model = _gemm_model.calibrated_model()
    for m, n, k in [(128, 1024, 8192), (128, 8192, 8192), (1000, 3000, 2008), (4096, 4096, 4096)]:
        options = model.options(m, n, k, H200_SMS, sorted(BUILT))
        assert model.choose(m, n, k, H200_SMS, BUILT, measured=False) == _gemm_model.prefer(options)
