"""benchmarks/gemm_split_cost.py's variants still fit the kernel, without a GPU or nvcc.

Each variant is a set of edits of kernels/gemm/sm90_bf16_gemm.cuh whose text must occur exactly
once: a change of the split protocol that moves one fails here, not in a device run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cubinstore.errors import BadArgumentError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemm_split_cost as split_cost  # noqa: E402  (the benchmark script)


@pytest.mark.parametrize("variant", sorted(split_cost.VARIANTS))
def test_every_edit_of_a_variant_applies_once(variant: str) -> None:
    source = (ROOT / split_cost.HEADER).read_text()
    edited = split_cost.edited(source, split_cost.VARIANTS[variant], variant)
    # cluster_k2 and cluster_k4 edit nothing: the header's CLUSTER_K define builds them (_cluster_k_defines).
    assert (edited == source) == (variant == "as_built" or variant in split_cost.CLUSTER_K)


def test_an_edit_whose_text_moved_names_the_variant() -> None:
    with pytest.raises(SystemExit, match=r"^variant no_read: expected one occurrence"):
        split_cost.edited("no such text", (("for (int sl", "x"),), "no_read")


def test_the_cases_time_only_points_the_variants_build() -> None:
    assert split_cost.CORRECT <= set(split_cost.VARIANTS)
    for options in split_cost.CASES.values():
        assert {point for point, _ in options} <= set(split_cost.POINTS)


def _kc_smem(cfg: object, stages: int, size: int) -> float:
    """Shared memory of the gemm_kc build of `cfg` with `stages` (GemmConfig's layout, the partials
    included); infinite where that build is refused (above the opt-in limit)."""
    try:
        return type(cfg)(cfg.bm, cfg.bn, cfg.bk, stages, 1, 0, size).smem_bytes  # type: ignore[attr-defined]
    except BadArgumentError:
        return float("inf")


@pytest.mark.parametrize("size", [2, 4])
def test_cluster_k_trades_stages_for_the_partials_within_the_points_shared_memory(size: int) -> None:
    built = 0
    for point in split_cost.POINTS:
        cfg = split_cost._config(point)
        defines = split_cost._cluster_k_defines(cfg, size)
        if cfg.cluster != 1 or cfg.swap:
            assert defines is None, cfg.kernel_id  # a multicast or swapped point has no K cluster
            continue
        if defines is None:
            continue
        built += 1
        assert f"-DCLUSTER_K={size}" in defines
        stages = int(next(d for d in defines if d.startswith("-DSTAGES=")).removeprefix("-DSTAGES="))
        assert 2 <= stages < cfg.stages and _kc_smem(cfg, stages, size) <= cfg.smem_bytes, cfg.kernel_id
        if stages + 1 < cfg.stages:  # the most stages that fit
            assert _kc_smem(cfg, stages + 1, size) > cfg.smem_bytes, cfg.kernel_id
    assert built >= (3 if size == 2 else 2)  # 64x128 and 64x64 at least; at 2, 128x128 too


def test_the_gemm_kc_points_are_the_cluster_k_builds_it_times() -> None:
    # The README and docs/gemm.md say the clusterk step times the gemm_kc target's CUBINs byte for
    # byte: the same defines, so the same command line.
    twins = {(p[0], p[1], p[2]): split_cost._config(p) for p in split_cost.POINTS if p[4] == 1 and p[5] == 0}
    points = [split_cost._config(row) for row in split_cost.bench.KC_GRID]
    assert points
    for cfg in points:
        twin = twins[cfg.bm, cfg.bn, cfg.bk]
        assert split_cost._cluster_k_defines(twin, cfg.kcluster) == cfg.defines, cfg.kernel_id


def test_a_cluster_k_variant_runs_only_where_its_clusters_tile_the_grid() -> None:
    point = split_cost.POINTS[0]  # 64x128, unswapped, no multicast
    assert split_cost.runs_as("as_built", point, (512, 1024, 4096), 2, 132)
    assert split_cost.runs_as("cluster_k2", point, (512, 1024, 4096), 2, 132)  # 64 tiles x 2: a grid of 128
    assert not split_cost.runs_as("cluster_k4", point, (64, 64, 4096), 3, 132)  # one tile x 3: a grid of 3
    assert not split_cost.runs_as("cluster_k2", (128, 104, 64, 6, 1, 1), (200, 7168, 2048), 2, 132)  # swapped
