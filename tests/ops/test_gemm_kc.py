"""The gemm_kc family (a K split inside a cluster) on the CPU: its ids, launch contract, plan and model.

The kernel is ``kernels/gemm/sm90_bf16_gemm.cu`` built with CLUSTER_K (README.md, "A K split inside
a cluster"); its GPU tests are in test_gemm_kc_gpu.py.
"""

from __future__ import annotations

import re

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import gemm_launch as G, gemm_model as _gemm_model

from test_gemm_model import BUILT, H200_SLOTS, H200_SMS, _manifest_ids, bench_gemm

# The //kernels/gemm:gemm_kc target's points (bench_gemm.KC_GRID mirrors its BUILD grid).
KC_BUILT = sorted(G.GemmConfig(*point).kernel_id for point in bench_gemm.KC_GRID)


def _kc(bm: int = 64, bn: int = 128, bk: int = 64, stages: int = 6, kcluster: int = 2) -> G.GemmConfig:
    return G.GemmConfig(bm, bn, bk, stages, 1, 0, kcluster)


def test_the_target_has_k_clusters_of_2_and_4_and_kernels_all_leaves_them_out() -> None:
    # Measured slower than the split-K launches they would replace (docs/gemm.md), so not shipped.
    assert {G.GemmConfig.from_id(i).kcluster for i in KC_BUILT} == {2, 4}
    assert not set(KC_BUILT) & _manifest_ids()
    for kernel_id in KC_BUILT:
        assert G.config_of(kernel_id).kernel_id == kernel_id
        assert G.entry_of(kernel_id) == (G.ENTRY, G.ENTRY_TYPES)


def test_an_id_names_its_own_family_and_keys_so_no_gemm_id_changes() -> None:
    cfg = _kc()
    assert cfg.kernel_id == "gemm_kc/bm64/bn128/bk64/stages6/kcluster2/sm_90a"
    assert cfg.family == G.KC_FAMILY and tuple(cfg.params) == G.KC_KEYS
    assert cfg.defines[-1] == "-DCLUSTER_K=2"
    plain = G.GemmConfig(64, 128, 64, 8, 1)
    assert plain.kernel_id == "gemm/bm64/bn128/bk64/stages8/cluster1/swap0/sm_90a"
    assert not any("CLUSTER_K" in d for d in plain.defines)  # the gemm family's flags, so its bytes, unchanged
    assert (plain.cluster_ctas, cfg.cluster_ctas, _kc(kcluster=4, stages=4).cluster_ctas) == (1, 2, 4)


@pytest.mark.parametrize(("kernel_id", "message"), [
    ("gemm_kc/bm64/bn128/bk64/stages6/kcluster1/sm_90a", "expected kcluster 2 or 4"),
    ("gemm_kc/bm64/bn128/bk64/stages6/kcluster3/sm_90a", "invalid gemm_kc instantiation {'bm': 64, 'bn': 128, "
                                                         "'bk': 64, 'stages': 6, 'kcluster': 3}: kcluster 3 not in (1, 2, 4)"),
    ("gemm_kc/bm64/bn128/bk64/stages6/cluster1/swap0/sm_90a", "invalid gemm_kc kernel id"),
    ("gemm_kc/bm64/bn128/bk64/stages6/kcluster2/sm_80", "invalid gemm_kc kernel id"),
    ("gemm_kc/bm128/bn256/bk64/stages4/kcluster2/sm_90a", "shared memory"),
])
def test_a_bad_kc_id_is_refused_naming_what_is_wrong(kernel_id: str, message: str) -> None:
    with pytest.raises(BadArgumentError, match=re.escape(message)):
        G.config_of(kernel_id)


@pytest.mark.parametrize(("cluster", "swap"), [(2, 0), (1, 1)])
def test_a_k_cluster_takes_no_b_multicast_and_no_swap(cluster: int, swap: int) -> None:
    with pytest.raises(BadArgumentError, match="expected cluster 1 and swap 0"):
        G.GemmConfig(64, 128, 64, 6, cluster, swap, 2)


def test_the_peers_partials_take_shared_memory_as_the_kernel_lays_it_out() -> None:
    # kRedBytes: (kcluster - 1) fp32 BM x BN buffers and two mbarriers, before the D boxes.
    for kcluster, stages in ((2, 6), (4, 4)):
        cfg, plain = _kc(kcluster=kcluster, stages=stages), G.GemmConfig(64, 128, 64, stages, 1)
        assert cfg.partials_bytes == (kcluster - 1) * 64 * 128 * 4 + 16
        assert cfg.smem_bytes == plain.smem_bytes + cfg.partials_bytes
    # Every built point fits within its gemm twin's shared memory (the stages it gave up hold the buffers).
    twins = {(c.bm, c.bn, c.bk): c for c in map(G.GemmConfig.from_id, BUILT)
             if c.family == G.FAMILY and c.cluster == 1 and not c.swap}
    for kernel_id in KC_BUILT:
        cfg = G.GemmConfig.from_id(kernel_id)
        assert cfg.smem_bytes <= twins[cfg.bm, cfg.bn, cfg.bk].smem_bytes, kernel_id


def test_plan_launches_a_cluster_a_tile_and_takes_no_split() -> None:
    cfg = _kc()
    launch = G.plan(512, 1024, 4096, H200_SMS, cfg.kernel_id, 1)
    assert (launch.tiles_m, launch.tiles_n, launch.units, launch.splits) == (8, 8, 64, 1)
    assert launch.grid == 128  # 64 tiles x 2 CTAs: all of them fit in 66 pairs
    assert launch.workspace_floats == 0 and launch.counters == 0  # nothing through global memory
    big = G.plan(4096, 4096, 4096, H200_SMS, cfg.kernel_id, 1)
    assert big.grid == H200_SMS  # 66 clusters of 2, persistent
    four = G.plan(4096, 4096, 4096, H200_SMS, _kc(kcluster=4, stages=4).kernel_id, 1, max_clusters=30)
    assert four.grid == 120  # the H200 holds 30 clusters of 4
    for splits in (2, G.STREAM_K):
        with pytest.raises(BadArgumentError, match=r"takes no K split.*expected splits 1"):
            G.plan(512, 1024, 4096, H200_SMS, cfg.kernel_id, splits)
    with pytest.raises(BadArgumentError, match="cannot hold a cluster of 4"):
        G.plan(64, 64, 64, 3, _kc(kcluster=4, stages=4).kernel_id, 1)


def test_the_model_weighs_a_kc_point_only_once_measured_and_unsplit() -> None:
    kc = _kc().kernel_id
    plain = G.GemmConfig(64, 128, 64, 8, 1).kernel_id
    bare = _gemm_model.Model()
    assert {kid for _, kid, _ in bare.options(512, 1024, 4096, H200_SMS, [kc, plain])} == {plain}
    assert not _gemm_model.offers_stream_k(512, 1024, 4096, H200_SMS, kc)
    measured = _gemm_model.Model(tiles={kc: _gemm_model.default_tile_costs(G.GemmConfig.from_id(kc))})
    options = measured.options(512, 1024, 4096, H200_SMS, [kc])
    assert [(kid, splits) for _, kid, splits in options] == [(kc, 1)]


def test_the_busiest_cta_of_a_cluster_takes_its_share_of_k() -> None:
    # 4096 / 64 = 64 K blocks: 32 a CTA in pairs, 16 in fours; the unsplit gemm twin walks all 64.
    costs = _gemm_model.TileCosts(kblock_us=0.2, unit_us=1.0)
    two, four = _kc().kernel_id, _kc(kcluster=4, stages=4).kernel_id
    plain = G.GemmConfig(64, 128, 64, 8, 1).kernel_id
    model = _gemm_model.Model(tiles={two: costs, four: costs, plain: costs})
    e2, e4, e1 = (model.estimate(512, 1024, 4096, H200_SMS, kid, 1, H200_SLOTS) for kid in (two, four, plain))
    assert (e1.busy_units, e1.busy_kblocks) == (1, 64)
    assert (e2.busy_units, e2.busy_kblocks, e2.grid) == (1, 32, 128)
    assert (e4.busy_units, e4.busy_kblocks, e4.grid) == (3, 48, 120)  # 64 tiles over the 30 fours held at once
    assert e2.busiest_us == pytest.approx(1.0 + 32 * 0.2) and e2.busy_extra_us == 0


def test_the_fast_path_agrees_with_the_plan_based_estimate_for_kc_points() -> None:
    model = _gemm_model.Model(tiles={kid: _gemm_model.default_tile_costs(G.GemmConfig.from_id(kid))
                                     for kid in KC_BUILT})
    for m, n, k in ((1, 4096, 4096), (512, 1024, 4096), (128, 1024, 4096), (4096, 4096, 4096), (300, 4099, 1111),
                    (7, 13, 8)):
        for sms, slots in ((8, None), (H200_SMS, None), (H200_SMS, H200_SLOTS), (H200_SMS, {4: 7})):
            options = model.options(m, n, k, sms, KC_BUILT, slots)
            assert {kid for _, kid, _ in options} == set(KC_BUILT)
            for time, kernel_id, splits in options:
                assert time == pytest.approx(model.estimate(m, n, k, sms, kernel_id, splits, slots).time_us,
                                             rel=1e-12), f"{m}x{n}x{k} {kernel_id}"
