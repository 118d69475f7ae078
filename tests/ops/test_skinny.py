"""The skinny family's launch contract and its place in the gemm selection model, on the CPU.

The kernel (kernels/skinny) computes D = A * B^T for few rows of A with one CTA per BM x BN
block of D over the whole of K. What is checked here: ids and params agree with the built
manifest, plan() gives that grid and refuses a K split, the model weighs a skinny point only
where M fits its BM rows (B then crosses HBM once), its estimate is the one `options` uses,
and with both families to choose from the calibrated model's picks exist in the manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import Model, gemm_launch as G, gemm_model as _gemm_model
from cubinstore.manifest import Manifest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemm_shapes  # noqa: E402  (the tuning and held-out shape sets)
import tune_gemm  # noqa: E402  (what the calibration times)

MANIFEST = ROOT / "bazel-bin" / "kernels" / "manifest.json"
H200_SMS = 132


def _specs(family: str) -> list:
    if not MANIFEST.is_file():
        pytest.skip(f"no manifest at {MANIFEST}: run `bazel build //kernels:all` (CI does before pytest)")
    return [k for k in Manifest.from_path(MANIFEST) if k.family == family]


def _skinny_ids() -> frozenset[str]:
    ids = frozenset(k.id for k in _specs(G.SKINNY_FAMILY))
    assert ids, "the manifest has no skinny kernels"
    return ids


def _all_ids() -> frozenset[str]:
    return frozenset(k.id for family in G.FAMILIES for k in _specs(family))


# -- the launch contract --------------------------------------------------------------------------


def test_every_built_point_parses_to_its_manifest_params_and_entry() -> None:
    for spec in _specs(G.SKINNY_FAMILY):
        cfg = G.SkinnyConfig.from_id(spec.id)
        assert cfg.kernel_id == spec.id and cfg.params == dict(spec.params), spec.id
        assert G.config_of(spec.id) == cfg
        assert tuple(spec.entries[G.SKINNY_ENTRY]) == G.SKINNY_ENTRY_TYPES, spec.id
        # The residency the model counts: 512 threads an SM (the GPU test asks the driver).
        assert cfg.threads * cfg.ctas_per_sm == 512


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 4096), (16, 4099), (17, 100), (40, 8)])
def test_plan_launches_one_cta_per_block_of_d_and_no_split(m: int, n: int) -> None:
    cfg = G.SkinnyConfig(16, 32, 8, 2)
    launch = G.plan(m, n, 4096, H200_SMS, cfg.kernel_id, 1)
    assert (launch.tiles_m, launch.tiles_n) == (-(-m // 16), -(-n // 32))
    assert launch.grid == launch.units == launch.tiles_m * launch.tiles_n
    assert launch.splits == 1 and launch.workspace_floats == 0 and launch.counters == 0


@pytest.mark.parametrize("splits", [0, 2, 16])
def test_a_k_split_of_a_skinny_point_is_refused(splits: int) -> None:
    kernel_id = G.SkinnyConfig(16, 8, 8, 4).kernel_id
    with pytest.raises(BadArgumentError, match=rf"^gemm: kernel {kernel_id} takes no K split: expected splits 1, "
                                               rf"got {splits}$"):
        G.plan(1, 4096, 4096, H200_SMS, kernel_id, splits)


def test_a_k_whose_offsets_would_overflow_int32_is_refused() -> None:
    cfg = G.SkinnyConfig(16, 16, 16, 4)
    limit = 2**31 - 1 - 2 * cfg.k_step
    assert cfg.max_k == limit and G.plan(1, 8, limit, H200_SMS, cfg.kernel_id, 1).grid == 1
    # The model does not offer it there.
    assert Model().options(1, 8, limit + 8, H200_SMS, [cfg.kernel_id]) == []
    with pytest.raises(BadArgumentError, match=rf"^gemm K = {limit + 8}: kernel {cfg.kernel_id} expects K <= {limit}$"):
        G.plan(1, 8, limit + 8, H200_SMS, cfg.kernel_id, 1)


@pytest.mark.parametrize(("kernel_id", "message"), [
    ("skinny/bm16/bn8/warps8/sm_90a", r"^invalid skinny kernel id 'skinny/bm16/bn8/warps8/sm_90a': expected "),
    ("skinny/bm48/bn8/warps8/unroll4/sm_90a", r"^invalid skinny instantiation .*'bm': 48.*: bm 48 not in \(16, 32\)$"),
    ("skinny/bm16/bn24/warps12/unroll4/sm_90a", r": bn 24 not in \(8, 16, 32\); warps 12 not in \(8, 16\)$"),
])
def test_bad_skinny_ids_name_what_is_wrong(kernel_id: str, message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        G.config_of(kernel_id)


# -- the model ------------------------------------------------------------------------------------


def test_a_skinny_point_is_weighed_only_where_m_fits_its_rows() -> None:
    model = _gemm_model.calibrated_model()
    for kernel_id in sorted(_skinny_ids()):
        bm = G.SkinnyConfig.from_id(kernel_id).bm
        assert [s for _, _, s in model.options(bm, 4096, 4096, H200_SMS, [kernel_id])] == [1]
        assert model.options(bm + 1, 4096, 4096, H200_SMS, [kernel_id]) == []
        assert not _gemm_model.offers_stream_k(1, 4096, 4096, H200_SMS, kernel_id)


def test_options_and_estimate_agree_for_skinny_points() -> None:
    model = _gemm_model.calibrated_model()
    for m, n, k in ((1, 4096, 4096), (16, 1024, 8192), (7, 57344, 8192), (32, 5000, 3000), (1, 8, 8)):
        for time, kernel_id, splits in model.options(m, n, k, H200_SMS, sorted(_skinny_ids())):
            estimate = model.estimate(m, n, k, H200_SMS, kernel_id, splits)
            assert estimate.time_us == pytest.approx(time, rel=1e-12), (m, n, k, kernel_id)
            # Terms the fit reads: waves of CTAs, each walking K in batches.
            cfg = G.SkinnyConfig.from_id(kernel_id)
            waves = -(-estimate.grid // (H200_SMS * cfg.ctas_per_sm))
            assert estimate.busy_units == waves
            assert estimate.busy_kblocks == waves * -(-k // cfg.k_step)


def test_more_rows_of_b_a_cta_help_only_until_the_gpu_is_full() -> None:
    # At N = 1024 a CTA of 32 rows of B leaves most SMs idle (32 CTAs); of 8 it fills them.
    model = Model()
    wide, narrow = G.SkinnyConfig(16, 32, 8, 2).kernel_id, G.SkinnyConfig(16, 8, 8, 4).kernel_id
    assert model.predict_us(1, 1024, 8192, H200_SMS, narrow, 1) < model.predict_us(1, 1024, 8192, H200_SMS, wide, 1)


def test_with_both_families_every_pick_exists_in_the_manifest() -> None:
    ids = _all_ids()
    shapes = sorted({s.mnk for s in gemm_shapes.TUNING + gemm_shapes.HELD_OUT}
                    | {(m, n, k) for m in (1, 2, 8, 16, 17, 32, 33) for n in (8, 1000, 4096, 57344)
                       for k in (8, 1000, 8192)})
    picks = {_gemm_model.choose(m, n, k, H200_SMS, ids) for m, n, k in shapes}
    assert {kernel_id for kernel_id, _ in picks} <= ids
    for kernel_id, splits in picks:
        if kernel_id.startswith(G.SKINNY_FAMILY + "/"):
            assert splits == 1
    # Where M exceeds every skinny BM, only gemm tiles are weighed.
    big = max(G.SkinnyConfig.from_id(i).bm for i in _skinny_ids()) + 1
    assert _gemm_model.choose(big, 4096, 4096, H200_SMS, ids)[0].startswith(G.FAMILY + "/")


def test_the_calibration_times_each_skinny_point_once_where_it_is_offered() -> None:
    model = Model()
    kernel_id = G.SkinnyConfig(16, 16, 8, 2).kernel_id
    assert tune_gemm.split_tries(model, 16, 4096, 4096, tune_gemm.Gpu(H200_SMS), kernel_id) == [1]
    assert tune_gemm.split_tries(model, 64, 4096, 4096, tune_gemm.Gpu(H200_SMS), kernel_id) == []
    planned = tune_gemm.plan_timings([kernel_id], tune_gemm.Gpu(H200_SMS))
    assert planned and all(s.mnk[0] <= 16 and splits == 1 for s, _, splits in planned)


def test_choices_over_both_families_are_the_same_in_another_process_and_set_order() -> None:
    ids = sorted(_all_ids())
    shapes = [[m, n, k] for m in (1, 16, 32, 64) for n in (1000, 4096, 28672) for k in (1000, 8192)]
    code = (
        "import json, sys; from cubinstore.internals import gemm_model as g; ids = json.loads(sys.argv[1]); "
        "print(json.dumps([g.choose(m, n, k, 132, frozenset(ids)) for m, n, k in json.loads(sys.argv[2])]))"
    )
    runs = []
    for seed, order in (("1", ids), ("2", ids[::-1])):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, json.dumps(order), json.dumps(shapes)], env=env,
                             cwd=ROOT, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    here = [list(_gemm_model.choose(m, n, k, H200_SMS, frozenset(ids))) for m, n, k in shapes]
    assert runs[0] == runs[1] == here
