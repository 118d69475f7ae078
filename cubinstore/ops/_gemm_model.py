"""Selection model of cubinstore.ops.gemm: (kernel id, K splits) from an estimate of the work.

For every candidate instantiation and split count the model estimates the kernel's time
from what the launch contract (``kernels/gemm/README.md``, ``gemm.plan``) makes of the
shape, and ``choose`` takes the fastest:

- **the busiest CTA**: a persistent grid of ``min(units, SMs / cluster)`` clusters (fewer
  where the device holds fewer at once: ``ClusterSlots``) runs
  ``ceil(units / clusters)`` work units on its busiest cluster (a partial last wave costs a
  whole unit); a unit costs ``unit_us`` (accumulator reset, pipeline drain, epilogue) plus
  ``kblock_us`` per K block it owns, plus, with split-K, the fp32 partial written and, on
  the reducer (the last split), the other partials read back (``split_unit_us`` for the fence and
  counter, ``partial_bytes_per_us`` for the bytes); with stream-K (``gemm.STREAM_K``, weighed
  where the last wave of tiles is partly idle) its whole tiles, then its pieces of the
  remaining tiles, each a unit, its equal share of their K blocks, and its partial
  written and those it reads back (``_stream_k_work``);
- **the feed of unaligned rows**: when K (with K off 8, the K rounded up to 8 of the copy a
  tile reads: ``_unaligned_rows``) is not a multiple of 64, the rows of A and B are not
  128-byte aligned and each 128-byte box row TMA reads spans two L2 lines; an SM then
  takes its operands at about half its usual rate, so a K block takes at least its CTA's
  bytes (BM + BN / cluster rows: a cluster-2 CTA loads half of B and multicasts it) over
  ``unaligned_feed_bytes_per_us``. On the H200 (2026-12-02) every instantiation drew
  41-59 KB/us a CTA on the three tuning shapes with such K (cluster-1 points about 60-110
  on aligned shapes), which is what makes cluster 2 up to 33% faster than its twin there
  (6000x512x3000). The L2 serves those lines to all SMs together: the busiest cluster's K
  blocks take together at least the bytes every CTA of the launch loads over all its K
  blocks, over ``unaligned_l2_bytes_per_us`` (however splits or waves deal them out), so a
  tile that loads fewer rows per CTA (clusters of 4 sharing B) or a launch of fewer CTAs is
  faster (docs/gemm.md, 2026-12-04: what the per-CTA floor alone got wrong);
- **the memory**: A, B and D (and a workspace larger than half the L2) cross HBM at
  ``hbm_bytes_per_us`` at best, and at most as fast as the grid keeps bytes in flight
  (each CTA has ``stages`` loads outstanding, each taking ``fetch_latency_us``): what makes
  small M bandwidth bound and why split-K helps it;
- the time is ``launch_us`` plus the larger of the two and ``overlap_loss`` of the smaller.

A swapped ``gemm`` point (``GemmConfig.swap``: its tile's BN rows run along M) is the same
launch of the N x M problem, and is weighed only where the calibration has its constants.
So is a ``gemm_kc`` point (``GemmConfig.kcluster``): a unit is a whole tile, run by a cluster of
``kcluster`` CTAs whose busiest takes ``ceil(K blocks / kcluster)`` of them; adding the peers'
partials through distributed shared memory is part of its fitted ``unit_us``.

A ``skinny`` point (``kernels/skinny``: few rows of A, no tensor maps, no split) is weighed
where M fits its BM rows. It launches one CTA per BN columns of D, ``SkinnyConfig.ctas_per_sm``
an SM at a time; each CTA's warps walk K in batches of ``k_step``, so the busiest SM runs
``ceil(CTAs / slots)`` waves of ``unit_us`` plus ``kblock_us`` per batch (a batch is a round
trip to memory: the loads of the next are in flight while the mmas consume it), and the
memory term is B's bytes over the rate the resident CTAs draw (two batches in flight each)
or ``skinny_hbm_share`` of the HBM's (``_skinny_estimate``): its plain loads draw less of it than
a tile's TMA loads do.

The per-instantiation constants (``TileCosts``) and the machine's (``MachineCosts``) come
from ``_gemm_calibration.py`` (written by ``benchmarks/tune_gemm.py --calibrate``) where it
has them, else from defaults derived from the H200's specifications and the 2026-11-29
tuning table. No numpy: this runs in serving processes.

**Measured picks.** On the exact shapes the calibration timed, where an option it timed beat
the fitted model's pick by at least ``PICK_MARGIN`` (the calibration's ``PICKS``), `choose`
returns that option, on a GPU with the calibration's SM count and when the library has its
kernel: an autotuning cache for the shapes a server runs, which a model of the work cannot
match to the last few percent. Every other shape, a neighbour of a measured one included, is
the model's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from types import ModuleType
from typing import Any, Final

from cubinstore.errors import BadArgumentError
from cubinstore.ops import _gemm_config as _configs
from cubinstore.ops import _gemm_calibration as _calibration
from cubinstore.ops._gemm_staging import NO_COPIES, Copies, padded

__all__ = [
    "DEFAULT_MACHINE",
    "Estimate",
    "MAX_SPLITS",
    "MachineCosts",
    "PICK_MARGIN",
    "SPLIT_MARGIN",
    "Model",
    "TileCosts",
    "calibrated_model",
    "choose",
    "default_tile_costs",
    "offers_stream_k",
    "predict_us",
    "prefer",
    "weighs_stream_k",
]


#: The most K splits the model weighs: the bound plan() clamps to.
MAX_SPLITS: Final = _configs.MAX_SPLITS
_STREAM_K: Final = _configs.STREAM_K
# A measured option replaces the model's pick on its shape only when it was this much faster:
# below it the calibration's medians differ by about their run-to-run noise (1-2% on the H200).
PICK_MARGIN: Final = 0.03
# Among options estimated within this fraction of the fastest, the one with the fewest K splits
# (stream-K counted as the most) is chosen: the fit's error is about this size, and cross-CTA
# reduction is what it predicts worst. Chosen on the tuning shapes' timings of the 2026-12-03
# calibration (regret of the picks against the measured best: 1.9% with no margin, 1.35% at 1%,
# 0.97% at 3%, 1.05% at 5%, 0.94% at 8%); on the held-out shapes, never used to choose it:
# 3.1% -> 2.1%.
SPLIT_MARGIN: Final = 0.03
# Beyond this many waves of units a further split only adds reduction work.
_MAX_SPLIT_WAVES: Final = 4

# H200 (SXM) specifications the defaults are derived from.
_H200_SMS: Final = 132
_H200_BF16_DENSE_FLOPS_PER_US: Final = 989e6  # 989 TFLOP/s
_SM_PEAK_FLOPS_PER_US: Final = _H200_BF16_DENSE_FLOPS_PER_US / _H200_SMS
# Fraction of the SM's tensor-core peak a K block reaches, by tile area (BM x BN): larger
# tiles read fewer shared-memory bytes per flop. 0.765 makes 128x256 at 4096^3 take the
# 195 us (704 TFLOP/s) measured on 2026-11-29; the others are ordered as the table's winners.
_MMA_EFFICIENCY: Final = {32768: 0.765, 24576: 0.75, 16384: 0.70, 8192: 0.62}
# L2 -> SM bytes a CTA can take per microsecond: bounds the small tiles' K blocks (the 64-row
# tiles, the only ones that reach it, took 100-110 KB/us on the H200, 2026-12-02).
_SM_FEED_BYTES_PER_US: Final = 110e3
# Fixed part of a unit (drain, counter bookkeeping) and its epilogue's store rate per SM.
_UNIT_FIXED_US: Final = 0.5
_SM_STORE_BYTES_PER_US: Final = 100e3
# A ring shallower than 4 stages hides a little less latency (stages 4 won 7 of 10 ties
# with stages 3 in the 2026-11-29 table).
_DEEP_RING: Final = 4
_SHALLOW_RING_PENALTY: Final = 0.01
# A skinny point's defaults: a batch about one loaded memory round trip, a CTA's fixed part
# (pointers, the reduction through shared memory, the store of D). The calibration measures
# them (the H200, 2026-12-02: 6-7 us of fixed time at M = 1, then B at about 4 TB/s).
_SKINNY_BATCH_US: Final = 0.8
_SKINNY_CTA_US: Final = 2.0
# No cluster-2 penalty: since the fix of its stage release (2026-12-02) a cluster-2 point runs
# as fast as its cluster-1 twin or faster (4096^3 128x256: 197.6 against 198.8 us); what it
# saves, half of B's loads, is in the feed bytes.


@dataclass(frozen=True)
class TileCosts:
    """What one instantiation costs on one SM (microseconds)."""

    kblock_us: float  # one BK step of one BM x BN tile, pipeline full
    unit_us: float  # a work unit's fixed part: accumulator reset, drain, epilogue


@dataclass(frozen=True)
class MachineCosts:
    """What the GPU adds to every instantiation (microseconds, bytes)."""

    launch_us: float = 3.0  # launch, first pipeline fill, last store
    hbm_bytes_per_us: float = 4.0e6  # sustained HBM bandwidth (H200 peak 4.8 TB/s)
    fetch_latency_us: float = 1.6  # one TMA load under load (bytes in flight / bandwidth)
    split_unit_us: float = 0.8  # a split unit's fence, counter atomic and barriers
    partial_bytes_per_us: float = 250e3  # one CTA's fp32 partials to and from L2
    l2_bytes: float = 50 * 2**20  # a workspace above half of it goes to HBM
    overlap_loss: float = 0.1  # fraction of the smaller of compute and memory time not hidden
    # One CTA's L2 -> SM rate when K is not a multiple of 64: each 128-byte row it loads spans
    # two L2 lines, so about half of _SM_FEED_BYTES_PER_US (the H200: 41-59 KB/us a CTA).
    unaligned_feed_bytes_per_us: float = _SM_FEED_BYTES_PER_US / 2
    # All busy CTAs' unaligned loads together: the L2 serves two lines for each 128-byte row, so
    # a full grid draws less each than one CTA alone (the H200: 41-59 KB/us a CTA at 120-132).
    unaligned_l2_bytes_per_us: float = _H200_SMS * 50e3
    # An operand copy ops.gemm makes before a launch (_gemm_staging: rows of K off 8 into rows of
    # padded(K), say): a launch, then the bytes read and written. Not fitted (the calibration
    # times kernels alone): bench_gemm.py's layouts table, the H200, 2026-12-06: one copy of 1 MB
    # took 4.3-5.2 us; two copies took 16.4 us for 18 MB, 82.8 for 134 MB and 545.6 for 941 MB.
    copy_us: float = 3.5
    copy_bytes_per_us: float = 1.75e6
    # The share of the HBM's rate a `skinny` grid draws, against a tile's TMA loads. Not fitted:
    # with one rate for both the fits trade it against other terms, and refits flip deep-K
    # shapes between the families (docs/gemm.md, eleventh session: the largest held-out move
    # between refits was 0.0% on the H200 and 1.4% on the H100 at 0.92; 5.3% and 4.1% at 1.0).
    skinny_hbm_share: float = 0.92


DEFAULT_MACHINE: Final = MachineCosts()


def default_tile_costs(config: _configs.GemmConfig | _configs.SkinnyConfig) -> TileCosts:
    """Costs of an instantiation from the H200's specifications (no measurement)."""
    if isinstance(config, _configs.SkinnyConfig):
        return TileCosts(kblock_us=_SKINNY_BATCH_US, unit_us=_SKINNY_CTA_US)
    flops = 2.0 * config.bm * config.bn * config.bk
    efficiency = _MMA_EFFICIENCY.get(config.bm * config.bn, min(_MMA_EFFICIENCY.values()))
    # A cluster-2 CTA loads its A rows and half of the B tile (the peer multicasts the rest).
    feed_bytes = (config.bm + config.bn / config.cluster) * config.bk * 2
    kblock = max(flops / (_SM_PEAK_FLOPS_PER_US * efficiency), feed_bytes / _SM_FEED_BYTES_PER_US)
    kblock *= 1 + _SHALLOW_RING_PENALTY * max(0, _DEEP_RING - config.stages)
    unit = _UNIT_FIXED_US + config.bm * config.bn * 2 / _SM_STORE_BYTES_PER_US
    return TileCosts(kblock_us=kblock, unit_us=unit)


@functools.lru_cache(maxsize=256)
def _config(kernel_id: str) -> _configs.GemmConfig | _configs.SkinnyConfig:
    return _configs.config_of(kernel_id)


#: Clusters of each size (2, 4) the device holds at once (``Kernel.max_active_clusters``; a
#: cluster must fit in one GPC, so the H200 holds 30 of 4, not 132 / 4); None, or a size left
#: out: SMs / size.
ClusterSlots = Mapping[int, int] | None

# plan() is pure; the fit (benchmarks/tune_gemm.py) estimates each timing hundreds of times.
_plan: Final = functools.lru_cache(maxsize=8192)(_configs.plan)


def _total_us(launch_us: float, busiest_us: float, memory_us: float, overlap_loss: float) -> float:
    """A launch's time: loads and tensor-core work overlap, not perfectly (the smaller is `overlap_loss` seen)."""
    if busiest_us >= memory_us:
        return launch_us + busiest_us + overlap_loss * memory_us
    return launch_us + memory_us + overlap_loss * busiest_us


def _unaligned_rows(k: int) -> bool:
    """Whether the rows a ``gemm`` tile reads of contiguous A and B start off the 128-byte lines TMA reads.

    ops.gemm caches one choice per shape, so the model judges by the row stride of contiguous
    operands as the tile reads them: K, or with K off 8 the copy's rows of K rounded up to 8
    (``_gemm_staging.padded``: 28671 is read in rows of 28672, on the lines). A user's padded rows
    of another stride go unseen.
    """
    return (2 * padded(k)) % 128 != 0


@dataclass(frozen=True)
class Estimate:
    """One option's predicted time and the terms it is made of (microseconds).

    The busiest cluster's work is ``busy_units * unit_us + busy_kblocks * kblock_us +
    busy_extra_us``: linear in the tile's two costs, which is how the calibration fits them.
    """

    kernel_id: str
    splits: int  # K splits, or gemm.STREAM_K
    units: int
    grid: int  # CTAs
    busy_units: int  # units (stream-K: pieces) on the busiest cluster
    busy_kblocks: int  # K blocks on the busiest cluster
    # One K block: the tile's kblock_us, or with unaligned rows the CTA's feed or its share of the L2's if slower.
    kblock_us: float
    busy_extra_us: float  # split-K or stream-K bookkeeping: fences, counters, partials
    busiest_us: float  # the busiest cluster's work
    memory_us: float  # HBM traffic at the rate the grid can draw
    time_us: float


def weighs_stream_k(cluster_tiles: int, slots: int, kblocks: int) -> bool:
    """Whether the model offers stream-K: more than one K block, one full wave of tiles and a
    second one under half full.

    Where the H200 showed it pays (2026-12-02, every instantiation on the tuning shapes, side
    by side with splits = 1): with 1-1.5 waves of tiles the whole tiles' second wave idles most
    SMs and stream-K took 10-26% less time (median). With 1.5-2 waves, or several waves (even a
    last one nearly empty, e.g. 3.4 waves at 1024x14336x4096: 15% slower), its cut tiles lose
    more to partials and to L2 reuse (clusters at different K offsets) than the wave gains;
    below one wave split-K keeps the K slices in step.
    """
    return kblocks > 1 and slots <= cluster_tiles and 2 * cluster_tiles < 3 * slots


def offers_stream_k(m: int, n: int, k: int, sm_count: int, kernel_id: str,
                    cluster_slots: ClusterSlots = None) -> bool:
    """Whether `Model.options` weighs stream-K for `kernel_id` at M x N x K (what the calibration times)."""
    cfg = _config(kernel_id)
    if isinstance(cfg, _configs.SkinnyConfig):
        return False
    if cfg.kcluster > 1:
        return False  # its cluster is the split
    _, cluster_tiles, slots = _layout(cfg, m, n, sm_count, cluster_slots)
    return weighs_stream_k(cluster_tiles, slots, -(-k // cfg.bk))


def _stream_k_work(cluster_tiles: int, clusters: int, kblocks: int) -> tuple[int, int, int, int]:
    """(pieces, K blocks, partials written, partials read) of the busiest cluster under stream-K.

    The launch contract's split (kernels/gemm/README.md): all but the last one to two waves of
    tiles whole, round robin; the rest's K blocks in equal contiguous ranges, one a cluster.
    """
    waves = cluster_tiles // clusters
    whole = waves - 1 if waves >= 2 else 0
    iters = (cluster_tiles - whole * clusters) * kblocks
    sk_clusters = min(clusters, iters)
    share = -(-iters // sk_clusters)
    # A range of `share` K blocks touches at most this many tiles; only its first and last are cut.
    touched = -(-(share - 1) // kblocks) + 1
    cut = iters % sk_clusters != 0 or share % kblocks != 0
    written = 1 if cut else 0  # its first piece (slot 0, the last, reduces)
    # A cut tile's reducer reads its other pieces back: about kblocks / share + 1 pieces.
    read = (-(-kblocks // share) + 1) * -(-(cluster_tiles - whole * clusters) // sk_clusters) if cut else 0
    return whole + touched, whole * kblocks + share, written, read


def _max_clusters(config: _configs.GemmConfig, cluster_slots: ClusterSlots) -> int | None:
    """plan()'s max_clusters for `config` on a device holding `cluster_slots` (None: no cap known)."""
    size = config.cluster_ctas
    return cluster_slots.get(size) if cluster_slots and size > 1 else None


def _layout(config: _configs.GemmConfig, m: int, n: int, sm_count: int,
            cluster_slots: ClusterSlots = None) -> tuple[int, int, int]:
    """(tiles, work units per K split, cluster slots) of plan()'s launch contract.

    plan() gives units = these units x splits and grid = min(units, slots) x cluster;
    tests/ops/test_gemm_model.py checks the two agree for every id, split and a grid of shapes.
    A swapped point tiles N x M. Slots are SMs / the cluster's CTAs, or fewer where `cluster_slots`
    says the device holds fewer clusters of that size at once (the H200: all 66 pairs, 30 of 4).
    """
    m, n = config.kernel_dims(m, n)
    tiles_m, tiles_n = -(-m // config.bm), -(-n // config.bn)
    slots = sm_count // config.cluster_ctas
    cap = _max_clusters(config, cluster_slots)
    return tiles_m * tiles_n, -(-tiles_m // config.cluster) * tiles_n, slots if cap is None else min(slots, cap)


def _check_shape(m: int, n: int, k: int, sm_count: int) -> None:
    for name, value in (("M", m), ("N", n), ("K", k), ("sm_count", sm_count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadArgumentError(
                f"gemm model {m}x{n}x{k} on {sm_count} SMs: expected {name} a positive int, got {value!r}"
            )


Shape = tuple[int, int, int]


class Model:
    """The cost model with one set of constants; `tiles` overrides the defaults per kernel id.

    `picks` maps exact M x N x K shapes to the (kernel id, splits) measured fastest there on a
    GPU of `picks_sm_count` SMs; `choose` returns them (see the module's docstring).
    """

    def __init__(self, machine: MachineCosts = DEFAULT_MACHINE,
                 tiles: Mapping[str, TileCosts] | None = None,
                 picks: Mapping[Shape, tuple[str, int]] | None = None,
                 picks_sm_count: int | None = None, split_margin: float = SPLIT_MARGIN) -> None:
        self.machine = machine
        self.split_margin = split_margin  # prefer's margin (a study of refits varies it: tune_gemm --stability)
        self._tiles = dict(tiles or {})
        self._costs: dict[str, TileCosts] = {}
        self._picks = dict(picks or {})
        self._picks_sm_count = picks_sm_count

    def tile_costs(self, kernel_id: str) -> TileCosts:
        costs = self._costs.get(kernel_id)
        if costs is None:
            costs = self._tiles.get(kernel_id) or default_tile_costs(_config(kernel_id))
            self._costs[kernel_id] = costs
        return costs

    def is_calibrated(self, kernel_id: str) -> bool:
        return kernel_id in self._tiles

    def estimate(self, m: int, n: int, k: int, sm_count: int, kernel_id: str, splits: int,
                 cluster_slots: ClusterSlots = None) -> Estimate:
        """The model's terms for `kernel_id` with `splits` (clamped as plan() does), from plan()'s launch.

        The readable definition of the model; `options` computes the same times faster
        (tests/ops/test_gemm_model.py checks that they agree).
        """
        _check_shape(m, n, k, sm_count)
        if isinstance(_config(kernel_id), _configs.SkinnyConfig):
            return self._skinny_estimate(m, n, k, sm_count, kernel_id, splits)
        cap = _max_clusters(_config(kernel_id), cluster_slots)  # type: ignore[arg-type]
        launch = _plan(m, n, k, sm_count, kernel_id, splits, max_clusters=cap)
        cfg, mc, costs = launch.config, self.machine, self.tile_costs(kernel_id)
        clusters = launch.grid // cfg.cluster_ctas
        partial_us = cfg.bm * cfg.bn * 4 / mc.partial_bytes_per_us
        kblocks = -(-k // cfg.bk)
        hbm = 2.0 * (m * k + n * k + m * n)
        # The bytes a CTA loads a K block: its A rows and its share of the B tile (swapped: B's and A's).
        km, kn = cfg.kernel_dims(m, n)
        feed_bytes = (min(cfg.bm, km) + min(cfg.bn, kn) / cfg.cluster) * cfg.bk * 2
        if launch.stream_k:
            busy_units, busy_kblocks, written, read = _stream_k_work(launch.units, clusters, kblocks)
            extra = written * mc.split_unit_us + (written + read) * partial_us
        else:
            busy_units = -(-launch.units // clusters)
            busy_kblocks = busy_units * cfg.k_share(-(-kblocks // launch.splits))
            extra = 0.0
            if launch.splits > 1:
                # Each unit writes its partial; the last of a tile's units reads the others back.
                extra = busy_units * (mc.split_unit_us + launch.splits * partial_us)
                if launch.workspace_floats * 4 > mc.l2_bytes / 2:
                    hbm += 2.0 * launch.workspace_floats * 4
        # `stages` of them in flight over the latency of a load: the bandwidth one CTA draws.
        cta_rate = cfg.stages * feed_bytes / mc.fetch_latency_us
        memory = hbm / min(mc.hbm_bytes_per_us, launch.grid * cta_rate)
        kblock_us = costs.kblock_us
        if _unaligned_rows(k):
            # The busiest cluster's K blocks take at least the CTA's feed each, and together as
            # long as the L2 takes to feed every CTA's K blocks (however splits deal them out).
            _, cluster_tiles, _ = _layout(cfg, m, n, sm_count, cluster_slots)
            l2_us = cluster_tiles * cfg.cluster * kblocks * feed_bytes / mc.unaligned_l2_bytes_per_us
            kblock_us = max(kblock_us, feed_bytes / mc.unaligned_feed_bytes_per_us, l2_us / busy_kblocks)
        busiest = busy_units * costs.unit_us + busy_kblocks * kblock_us + extra
        time = _total_us(mc.launch_us, busiest, memory, mc.overlap_loss)
        return Estimate(kernel_id, launch.splits, launch.units, launch.grid, busy_units, busy_kblocks, kblock_us,
                        extra, busiest, memory, time)

    def _skinny_estimate(self, m: int, n: int, k: int, sm_count: int, kernel_id: str, splits: int = 1) -> Estimate:
        """A skinny point's terms (see the module's docstring); its launch is `gemm.plan`'s (and so its errors)."""
        launch = _plan(m, n, k, sm_count, kernel_id, splits)
        cfg = launch.config
        assert isinstance(cfg, _configs.SkinnyConfig)
        mc, costs = self.machine, self.tile_costs(kernel_id)
        blocks_m, ctas = launch.tiles_m, launch.grid
        slots = sm_count * cfg.ctas_per_sm
        waves = -(-ctas // slots)
        batches = -(-k // cfg.k_step)
        busiest = waves * costs.unit_us + waves * batches * costs.kblock_us
        # B once for each block of rows of A; A and D once.
        hbm = 2.0 * (blocks_m * n * k + m * k + m * n)
        rate = min(ctas, slots) * 2 * cfg.batch_bytes / mc.fetch_latency_us
        memory = hbm / min(mc.hbm_bytes_per_us * mc.skinny_hbm_share, rate)
        time = _total_us(mc.launch_us, busiest, memory, mc.overlap_loss)
        return Estimate(kernel_id, 1, ctas, ctas, waves, waves * batches, costs.kblock_us, 0.0, busiest, memory, time)

    def predict_us(self, m: int, n: int, k: int, sm_count: int, kernel_id: str, splits: int,
                   cluster_slots: ClusterSlots = None) -> float:
        """Estimated kernel time of `kernel_id` with `splits` (clamped as plan() does)."""
        return self.estimate(m, n, k, sm_count, kernel_id, splits, cluster_slots).time_us

    def _times(self, m: int, n: int, k: int, sm_count: int, kernel_id: str,
               last: int, cluster_slots: ClusterSlots) -> list[tuple[float, str, int]]:
        """(time, kernel id, splits) for splits 1..last, stopping where units exceed the split-wave cap.

        `estimate` inlined: plan() parses the id (about 5 us, too slow for 16 candidates x 16
        splits a shape), so the layout comes from `_layout` and the loop keeps to locals.
        """
        cfg = _config(kernel_id)
        costs = self.tile_costs(kernel_id)
        mc = self.machine
        cluster, ctas = cfg.cluster, cfg.cluster_ctas
        kblocks = -(-k // cfg.bk)
        tiles, units_per_split, slots = _layout(cfg, m, n, sm_count, cluster_slots)
        partial = cfg.bm * cfg.bn * 4
        split_fixed = mc.split_unit_us
        partial_us = partial / mc.partial_bytes_per_us
        operand_bytes = 2.0 * (m * k + n * k + m * n)
        workspace_limit = mc.l2_bytes / 2
        km, kn = cfg.kernel_dims(m, n)
        feed_bytes = (min(cfg.bm, km) + min(cfg.bn, kn) / cluster) * cfg.bk * 2
        cta_rate = cfg.stages * feed_bytes / mc.fetch_latency_us
        hbm_rate, launch_us, overlap_loss = mc.hbm_bytes_per_us, mc.launch_us, mc.overlap_loss
        unit_us, kblock_us = costs.unit_us, costs.kblock_us
        # Unaligned rows: K blocks at least the CTA's feed, and all of them the L2's time to feed them.
        unaligned = _unaligned_rows(k)
        if unaligned:
            kblock_us = max(kblock_us, feed_bytes / mc.unaligned_feed_bytes_per_us)
        l2_us = units_per_split * cluster * kblocks * feed_bytes / mc.unaligned_l2_bytes_per_us if unaligned else 0.0
        cap = _MAX_SPLIT_WAVES * slots
        out: list[tuple[float, str, int]] = []
        for splits in range(1, last + 1):
            units = units_per_split * splits
            if splits > 1 and units > cap:
                break
            clusters = units if units < slots else slots  # the grid, in clusters
            busy = -(-units // clusters)
            unit_kblocks = cfg.k_share(-(-kblocks // splits))
            kb = max(kblock_us, l2_us / (busy * unit_kblocks))
            unit = unit_us + unit_kblocks * kb
            hbm = operand_bytes
            if splits > 1:
                unit += split_fixed + splits * partial_us
                if tiles * (splits - 1) * partial > workspace_limit:
                    hbm += 2.0 * tiles * (splits - 1) * partial
            busiest = busy * unit
            rate = clusters * ctas * cta_rate
            memory = hbm / (rate if rate < hbm_rate else hbm_rate)
            out.append((_total_us(launch_us, busiest, memory, overlap_loss), kernel_id, splits))
        cluster_tiles = units_per_split
        if cfg.kcluster == 1 and weighs_stream_k(cluster_tiles, slots, kblocks):
            clusters = min(cluster_tiles * kblocks, slots)
            pieces, kbs, written, read = _stream_k_work(cluster_tiles, clusters, kblocks)
            kb = max(kblock_us, l2_us / kbs)
            busiest = (pieces * unit_us + kbs * kb + written * split_fixed
                       + (written + read) * partial_us)
            rate = clusters * cluster * cta_rate
            memory = operand_bytes / (rate if rate < hbm_rate else hbm_rate)
            out.append((_total_us(launch_us, busiest, memory, overlap_loss), kernel_id, _STREAM_K))
        return out

    def copy_us(self, copies: Copies) -> float:
        """What a launch's operand copies add to it (`MachineCosts.copy_us`, `copy_bytes_per_us`)."""
        return copies.count * self.machine.copy_us + copies.bytes / self.machine.copy_bytes_per_us

    def options(self, m: int, n: int, k: int, sm_count: int, candidates: Iterable[str],
                cluster_slots: ClusterSlots = None,
                copies: tuple[Copies, Copies] = (NO_COPIES, NO_COPIES)) -> list[tuple[float, str, int]]:
        """(predicted us, kernel id, splits) of every option the model weighs, unsorted; `copies`:
        what a `gemm` tile's launch and a `skinny` point's copy first (`_gemm.copies_for`). Where both
        families have options, each family's copies beyond the other's are added to its options;
        copies both make, or those of the only family that fits, change no choice and are left out
        (added to every option, they would widen `prefer`'s relative margin)."""
        _check_shape(m, n, k, sm_count)
        tiles: list[tuple[float, str, int]] = []
        skinny: list[tuple[float, str, int]] = []
        for kernel_id in candidates:
            cfg = _config(kernel_id)
            if isinstance(cfg, _configs.SkinnyConfig):
                if m <= cfg.bm and k <= cfg.max_k:  # one block of rows: B is read once
                    skinny.append((self._skinny_estimate(m, n, k, sm_count, kernel_id).time_us, kernel_id, 1))
            elif (cfg.swap or cfg.kcluster > 1) and kernel_id not in self._tiles:
                continue  # the defaults come from unswapped gemm tiles: these are weighed once measured
            elif sm_count >= cfg.cluster_ctas:
                last = 1 if cfg.kcluster > 1 else min(MAX_SPLITS, -(-k // cfg.bk))  # gemm_kc takes no split
                tiles += self._times(m, n, k, sm_count, kernel_id, last, cluster_slots)
        tile_copy, skinny_copy = (self.copy_us(c) for c in copies)
        if tiles and skinny and tile_copy != skinny_copy:
            common = min(tile_copy, skinny_copy)
            tiles = [(time + tile_copy - common, kid, splits) for time, kid, splits in tiles]
            skinny = [(time + skinny_copy - common, kid, splits) for time, kid, splits in skinny]
        return tiles + skinny

    def measured_pick(self, m: int, n: int, k: int, sm_count: int) -> tuple[str, int] | None:
        """The calibration's measured (kernel id, splits) for exactly this shape and SM count, if any."""
        if sm_count != self._picks_sm_count:
            return None
        return self._picks.get((m, n, k))

    def choose(self, m: int, n: int, k: int, sm_count: int, candidates: frozenset[str],
               measured: bool = True, cluster_slots: ClusterSlots = None,
               copies: tuple[Copies, Copies] = (NO_COPIES, NO_COPIES)) -> tuple[str, int]:
        """(kernel id, splits): the measured pick of this exact shape where the library has its kernel
        (unless `measured` is False, or the families copy differently: the calibration timed kernels
        alone), else `prefer` of the options, copies included: the fewest splits among those
        predicted within `split_margin` (`SPLIT_MARGIN`) of the fastest."""
        _check_shape(m, n, k, sm_count)
        pick = self.measured_pick(m, n, k, sm_count) if measured and copies[0] == copies[1] else None
        if pick is not None and pick[0] in candidates:
            return pick
        options = self.options(m, n, k, sm_count, sorted(candidates), cluster_slots, copies)
        if not options:
            raise BadArgumentError(
                f"gemm {m}x{n}x{k} on {sm_count} SMs: expected at least one gemm candidate that fits, "
                f"got {sorted(candidates)!r}"
            )
        return prefer(options, self.split_margin)


def prefer(options: Iterable[tuple[float, str, int]], margin: float = SPLIT_MARGIN) -> tuple[str, int]:
    """(kernel id, splits) of the model's choice among (estimated us, kernel id, splits) options: the
    fewest K splits (stream-K counted as the most) among those within `margin` of the fastest, then
    the fastest; ties go to the smaller id."""
    options = list(options)
    limit = min(options)[0] * (1 + margin)
    _, _, kernel_id, splits = min((MAX_SPLITS + 1 if s == _STREAM_K else s, t, kid, s)
                                  for t, kid, s in options if t <= limit)
    return kernel_id, splits


def calibrated_model(calibration: ModuleType = _calibration) -> Model:
    """The model with a calibration module's constants (MACHINE, TILES) over the defaults, and its PICKS."""
    known = {f.name for f in fields(MachineCosts)}
    unknown = sorted(set(calibration.MACHINE) - known)
    if unknown:
        raise BadArgumentError(
            f"{calibration.__name__}.MACHINE: expected fields of MachineCosts {sorted(known)}, got {unknown}"
        )
    machine = replace(DEFAULT_MACHINE, **calibration.MACHINE)
    tiles = {kid: TileCosts(kblock_us=kb, unit_us=unit) for kid, (kb, unit) in calibration.TILES.items()}
    picks = getattr(calibration, "PICKS", {})  # absent in calibrations written before 2026-12-02's seventh session
    provenance = calibration.PROVENANCE or {}
    for shape, pick in picks.items():
        _check_pick(calibration.__name__, shape, pick)
    if picks and not isinstance(provenance.get("sm_count"), int):
        raise BadArgumentError(f"{calibration.__name__}.PICKS: expected PROVENANCE to name the sm_count they were "
                               f"measured on, got {provenance.get('sm_count')!r}")
    return Model(machine, tiles, picks, provenance.get("sm_count") if picks else None)


def _check_pick(where: str, shape: Any, pick: Any) -> None:
    """A PICKS entry must be (M, N, K) of positive ints -> (a kernel id of either family, a split plan() takes)."""
    what = f"{where}.PICKS[{shape!r}]"
    if (not isinstance(shape, tuple) or len(shape) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape)):
        raise BadArgumentError(f"{what}: expected the key (M, N, K), positive ints, got {shape!r}")
    if not isinstance(pick, tuple) or len(pick) != 2 or not isinstance(pick[0], str):
        raise BadArgumentError(f"{what}: expected (kernel id, splits), got {pick!r}")
    kernel_id, splits = pick
    try:
        _config(kernel_id)
    except BadArgumentError as e:
        raise BadArgumentError(f"{what}: {e}") from None
    if isinstance(splits, bool) or not isinstance(splits, int) or not (splits == _STREAM_K or 1 <= splits <= MAX_SPLITS):
        raise BadArgumentError(f"{what}: expected splits 1..{MAX_SPLITS} or {_STREAM_K} (stream-K), got {splits!r}")


_MODEL: Final = calibrated_model()


def choose(m: int, n: int, k: int, sm_count: int, candidates: frozenset[str],
           measured: bool = True, cluster_slots: ClusterSlots = None,
           copies: tuple[Copies, Copies] = (NO_COPIES, NO_COPIES)) -> tuple[str, int]:
    """(kernel id, splits) for an M x N x K problem on `sm_count` SMs, the id among `candidates`;
    `measured=False` leaves out the calibration's measured picks (the model alone);
    `cluster_slots`: the clusters of each size the device holds at once (`ClusterSlots`);
    `copies`: what a `gemm` tile's launch and a `skinny` point's would copy first.

    Deterministic; raises `BadArgumentError` naming the shape if no candidate fits.
    """
    return _MODEL.choose(m, n, k, sm_count, candidates, measured, cluster_slots, copies)


def predict_us(m: int, n: int, k: int, sm_count: int, kernel_id: str, splits: int,
               cluster_slots: ClusterSlots = None) -> float:
    """The calibrated model's estimate of one launch, in microseconds."""
    return _MODEL.predict_us(m, n, k, sm_count, kernel_id, splits, cluster_slots)

