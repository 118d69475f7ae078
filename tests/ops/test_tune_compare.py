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
