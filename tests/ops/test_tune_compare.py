"""`tune_gemm.py --compare`: how far a refit moves the held-out shapes, judged by saved timings (no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cubinstore.internals import gemm_calibration, gemm_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tune_gemm  # noqa: E402

SHAPES = [(16, 8192, 28672), (512, 1024, 4096), (1000, 3000, 2008)]
GPU = {"gpu": "test", "date": "2026-12-06", "sm_count": 132, "l2_bytes": 52428800, "cluster_slots": {"2": 66, "4": 30}}


def _held_out(tmp_path: Path, us_of: dict[tuple[int, int, int, str, int], float]) -> Path:
    timings = [{"m": m, "n": n, "k": k, "kernel_id": kid, "splits": s, "us": us} for (m, n, k, kid, s), us in us_of.items()]
    path = tmp_path / "held_out.json"
    path.write_text(json.dumps({"schema": tune_gemm.SCHEMA, "provenance": GPU, "timings": timings}))
    return path


def _shipped_picks(ids: frozenset[str]) -> dict[tuple[int, int, int], tuple[str, int]]:
    model = gemm_model.calibrated_model()
    return {s: model.choose(*s, 132, ids, cluster_slots={2: 66, 4: 30}) for s in SHAPES}


def _options() -> frozenset[str]:
    return frozenset(gemm_calibration.TILES)


def test_the_shipped_calibration_against_itself_moves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = _options()
    us = {(*s, *pick): 10.0 for s, pick in _shipped_picks(ids).items()}
    us.update({(*s, kid, 1): 20.0 for s in SHAPES for kid in sorted(ids) if (*s, kid, 1) not in us})
    moved = tune_gemm.compare(ROOT / "cubinstore/ops/_gemm_calibration.py", _held_out(tmp_path, us))
    out = capsys.readouterr().out
    assert moved == 0 and "3 held-out shapes; the refit moves 0 by more than 5%" in out, out


def test_a_refit_whose_picks_are_slower_is_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A calibration whose costs favour one tile everywhere: its picks differ where that tile is slower.
    ids = _options()
    favoured = sorted(ids)[0]
    text = (ROOT / "cubinstore/ops/_gemm_calibration.py").read_text()
    module = tmp_path / "refit.py"
    tiles = {kid: (0.01, 0.01) if kid == favoured else (100.0, 100.0) for kid in ids}
    module.write_text(text + f"\nTILES = {tiles!r}\nPICKS = {{}}\n")
    shipped = _shipped_picks(ids)
    us = {(*s, kid, sp): 30.0 for s in SHAPES for kid in sorted(ids) for sp in (1, 2, 3, 4, 6, 8, 16, 0)}
    us.update({(*s, *pick): 10.0 for s, pick in shipped.items()})
    moved = tune_gemm.compare(module, _held_out(tmp_path, us))
    refit = gemm_model.calibrated_model(_load(module))
    differ = sum(refit.choose(*s, 132, ids, cluster_slots={2: 66, 4: 30}) != shipped[s] for s in SHAPES)
    assert differ > 0 and moved == differ, capsys.readouterr().out


def _load(path: Path) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("refit_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- --stability: refits of fresh-like timings, per split margin ------------------------------------


def _timings(us_of: dict[tuple[int, int, int, str, int], float]) -> list[tune_gemm.Timing]:
    return [tune_gemm.Timing(m=m, n=n, k=k, kernel_id=kid, splits=s, us=us) for (m, n, k, kid, s), us in us_of.items()]


def test_a_mix_takes_each_timing_from_one_run_or_the_other() -> None:
    ids = sorted(_options())[:6]
    first = _timings({(*s, kid, 1): 10.0 for s in SHAPES for kid in ids})
    second = _timings({(*s, kid, 1): 20.0 for s in SHAPES for kid in ids})
    mix = tune_gemm.mixed(first, second, seed=1)
    assert [(t.m, t.n, t.k, t.kernel_id, t.splits) for t in mix] == [(t.m, t.n, t.k, t.kernel_id, t.splits) for t in first]
    assert {t.us for t in mix} == {10.0, 20.0}
    assert tune_gemm.mixed(first, second, seed=1) == mix and tune_gemm.mixed(first, second, seed=2) != mix


def test_the_split_margin_is_the_models_own() -> None:
    options = [(10.0, "a", 2), (10.2, "b", 1)]
    assert gemm_model.prefer(options) == ("b", 1)  # within SPLIT_MARGIN: the fewer splits
    assert gemm_model.prefer(options, 0.0) == ("a", 2)
    ids = _options()
    for margin in (0.0, 0.05):
        model = gemm_model.Model(split_margin=margin)
        for shape in SHAPES:
            options = model.options(*shape, 132, sorted(ids), {2: 66, 4: 30})
            assert model.choose(*shape, 132, ids, measured=False, cluster_slots={2: 66, 4: 30}) == \
                gemm_model.prefer(options, margin)


def test_identical_timings_refit_to_identical_picks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = sorted(_options())[:6]
    us = {(*s, kid, sp): 10.0 + 0.7 * i + sp for s in SHAPES for i, kid in enumerate(ids) for sp in (1, 2)}
    path = _held_out(tmp_path, us)
    tune_gemm.stability([path, path], path, [0.0, 0.03], mixes=1)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().endswith("%")]
    assert [row[0] for row in rows] == ["0.0%", "3.0%"]
    assert all(row[1:5] == ["3", "0", "0", "0.0%"] for row in rows), rows  # 3 fits, 3 pairs, nothing moved


def test_a_shape_that_moves_is_named_with_the_options_the_fits_took(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Two fits, each favouring another tile everywhere; the judge times the first's 20% faster.
    ids = sorted(_options())
    first, second = [kid for kid in ids if kid.startswith("gemm/bm128/bn256")][:2]
    machine = gemm_model.DEFAULT_MACHINE
    cheap, dear = gemm_model.TileCosts(0.01, 0.01), gemm_model.TileCosts(100.0, 100.0)
    fits = iter([(machine, {kid: cheap if kid == favoured else dear for kid in ids}) for favoured in (first, second)])
    monkeypatch.setattr(tune_gemm, "fit", lambda timings, gpu: next(fits))
    us = {(*s, kid, sp): 30.0 for s in SHAPES for kid in ids for sp in (1, 2, 3, 4, 6, 8, 16, 0)}
    us.update({(*s, first, sp): 10.0 for s in SHAPES for sp in (1, 2, 3, 4, 6, 8, 16, 0)})
    us.update({(*s, second, sp): 12.0 for s in SHAPES for sp in (1, 2, 3, 4, 6, 8, 16, 0)})
    path = _held_out(tmp_path, us)
    tune_gemm.stability([path, path], path, [0.03], mixes=0)
    out = capsys.readouterr().out
    moved = [line for line in out.splitlines() if "%: " in line]
    assert len(moved) == len(SHAPES), out
    for line in moved:
        assert "moves 20.0%" in line and f"{first} (" in line and f"{second} (" in line, line
        assert "10.0 us in 1 fits" in line and "12.0 us in 1 fits" in line, line


# -- --margin-cv: each split margin judged on the tuning shapes alone --------------------------------


def test_each_margin_is_judged_by_the_same_fits_and_the_models_own_margin_is_the_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = sorted(_options())[:6]
    us = {(*s, kid, sp): 10.0 + 0.7 * i + 0.3 * sp for s in SHAPES for i, kid in enumerate(ids) for sp in (1, 2)}
    timings = _timings(us)
    gpu = tune_gemm.Gpu.of(GPU)
    by_margin = tune_gemm.cross_validate_margins(timings, gpu, (gemm_model.SPLIT_MARGIN, 0.0, 0.2), repeats=1)
    assert by_margin[gemm_model.SPLIT_MARGIN] == tune_gemm.cross_validate(timings, gpu, repeats=1)
    assert all(len(r) == len(SHAPES) and min(r) >= 1.0 for r in by_margin.values())
    path = _held_out(tmp_path, us)
    tune_gemm.margin_cv([path, path], [0.0, 0.2], repeats=1)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().endswith("%")]
    assert [row[0] for row in rows] == ["0.0%", "20.0%"]
    assert all(row[1] == row[2] == row[3] for row in rows)  # the same file twice: the same regret, and its mean


def test_saved_timings_read_back_with_the_gpu_they_were_measured_on(tmp_path: Path) -> None:
    from types import SimpleNamespace

    torch = SimpleNamespace(__version__="2.11.0+cu130", version=SimpleNamespace(cuda="13.0"))
    gpu = tune_gemm.Gpu(132, 62914560, {2: 66, 4: 30})
    timings = _timings({(16, 8192, 28672, "gemm/x", 2): 118.2, (16, 8192, 28672, "gemm/x", 1): 150.0,
                        (1, 5000, 3000, "gemm/x", 1): 22.5})
    path = tmp_path / "t.json"
    tune_gemm.save(path, timings, tune_gemm.provenance_of(torch, SimpleNamespace(name="NVIDIA H200"), gpu, 30, timings))
    back, provenance = tune_gemm.load(path)
    assert back == timings and tune_gemm.Gpu.of(provenance) == gpu
    assert (provenance["gpu"], provenance["reps"], provenance["shapes"], provenance["timings"]) == ("NVIDIA H200", 30, 2, 3)
