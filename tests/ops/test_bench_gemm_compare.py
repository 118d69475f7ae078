"""`bench_gemm.py run --json` and `compare`: two runs' per-shape ratios side by side (no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gemm  # noqa: E402
import gemm_shapes  # noqa: E402

TUNING = gemm_shapes.TUNING[:3]
HELD_OUT = [s for s in gemm_shapes.HELD_OUT if s.m >= gemm_shapes.LARGE_M][:2] + \
    [s for s in gemm_shapes.HELD_OUT if s.m < gemm_shapes.LARGE_M][:1]


def _rows(shapes: list[gemm_shapes.Shape], ours_ms: list[float]) -> list[bench_gemm.Row]:
    return [bench_gemm.Row(s, ("gemm/x", 1 + i % 2), ours, 1.0, 1e-3, 5) for i, (s, ours) in enumerate(zip(shapes, ours_ms))]


def test_a_saved_run_reads_back_shape_by_shape(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    bench_gemm.save_rows(path, "NVIDIA H100 80GB HBM3", {"tuning": _rows(list(TUNING), [0.5, 1.0, 2.0])})
    doc = json.loads(path.read_text())
    assert doc["schema"] == bench_gemm.RESULTS_SCHEMA and doc["device"] == "NVIDIA H100 80GB HBM3"
    assert [(s["m"], s["n"], s["k"], s["splits"], s["torch_ms"] / s["ours_ms"]) for s in doc["shapes"]] == [
        (*TUNING[0].mnk, 1, 2.0), (*TUNING[1].mnk, 2, 1.0), (*TUNING[2].mnk, 1, 0.5)]


def test_compare_sets_two_runs_side_by_side_with_each_ones_means_and_worst(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    bench_gemm.save_rows(a, "gpu", {"tuning": _rows(list(TUNING), [1.0, 1.0, 1.0]),
                                    "held-out": _rows(HELD_OUT, [1.0, 2.0, 1.0])})
    bench_gemm.save_rows(b, "gpu", {"tuning": _rows(list(TUNING), [0.5, 1.0, 2.0]),
                                    "held-out": _rows(HELD_OUT, [1.0, 1.0, 4.0])})
    bench_gemm.compare(a, b)
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip() and "x" in line.split()[0]}
    assert lines[TUNING[0].label][1:4] == ["1.000", "2.000", "2.000"]  # A, B, B / A
    assert lines[TUNING[2].label][1:4] == ["1.000", "0.500", "0.500"]
    assert f"worst shape, A {HELD_OUT[1].label} 0.500" in out and f"worst shape, B {HELD_OUT[2].label} 0.250" in out
    assert f"geometric mean, M >= {gemm_shapes.LARGE_M} (2)" in out


def test_compare_refuses_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"schema": "something/else"}))
    with pytest.raises(SystemExit, match=r"x.json: not a bench_gemm.py run --json file"):
        bench_gemm.compare(other, other)


class _Clock:
    """A stand-in for torch.cuda's events: each event records the device time the calls before it took."""

    def __init__(self, call_us: list[float]) -> None:
        self.now_ms, self.durations = 0.0, iter(call_us)
        self.sleeps: list[int] = []

    def call(self) -> None:
        self.now_ms += next(self.durations) / 1e3

    def stand_in(self) -> object:
        clock = self

        class Event:
            def __init__(self, enable_timing: bool) -> None:
                assert enable_timing
                self.at = None

            def record(self) -> None:
                self.at = clock.now_ms

            def elapsed_time(self, end: "Event") -> float:
                return end.at - self.at

        cuda = type("cuda", (), {"Event": Event, "synchronize": staticmethod(lambda: None),
                                 "_sleep": staticmethod(self.sleeps.append)})
        return type("torch", (), {"cuda": cuda})


def test_a_batch_times_each_call_alone_after_the_warm_up_and_time_ms_is_their_median() -> None:
    # 2 warm-up calls (untimed, 1000 us each), then 5 timed: the sets rotate from the first call.
    clock = _Clock([1000.0, 1000.0, 30.0, 10.0, 50.0, 20.0, 40.0] * 2)
    seen: list[int] = []

    def fn(i: int) -> None:
        seen.append(i)
        clock.call()

    calls, host_us = bench_gemm.timed_calls(clock.stand_in(), fn, 3, 5, 2)
    assert calls == pytest.approx([10.0, 20.0, 30.0, 40.0, 50.0]) and host_us >= 0.0
    assert seen == [0, 1, 0, 1, 2, 0, 1]
    assert clock.sleeps == [int(2e6 + 5 * 4e5)]  # the GPU kept busy while the 5 are enqueued
    assert bench_gemm.time_ms(clock.stand_in(), fn, 3, 5, 2) == pytest.approx(0.030)
