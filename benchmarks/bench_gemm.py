"""Benchmark of cubinstore.ops.gemm against torch.mm on an H200/H100 (prints tables; not a test).

  # on the GPU host (torch, cuda-python; no Bazel): about 1-2 minutes of GPU time
  PYTHONPATH=. python benchmarks/bench_gemm.py [run] --manifest <dir>/manifest.json [--json a.json]

  # anywhere: two runs' per-shape ratios side by side, with each run's means and worst shapes
  python benchmarks/bench_gemm.py compare a.json b.json

  # anywhere with nvcc 13 and the CUTLASS headers, for a GPU host without Bazel: compile
  # every instantiation (GRID), recording nvcc's CPU seconds, into a directory with a manifest
  python benchmarks/bench_gemm.py compile --out .device/gemm

`run` prints, for the tuning shapes and for the held-out shapes of `gemm_shapes.py` in
separate tables, the TFLOP/s of `ops.gemm` (with its selection) and of `torch.mm` and their
ratio, the geometric means (held-out also for M >= 128 alone) against the issue's goals;
then what the layouts ops.gemm copies cost (LAYOUTS: K off 8, transposed or offset views,
each beside the same values in a layout read in place and beside torch.mm); then the host time per call of both (2,000 back-to-back calls at 1x4096x4096 and
128x4096x4096, the GPU kept ahead so no call waits on it) and the device time per call of
both replayed from a CUDA graph. Timing: CUDA events around each call, the median of a
round's calls, and of `--rounds` rounds (3; ours and torch's taking turns); the GPU is kept
busy (torch.cuda._sleep) while Python enqueues, so host overhead is not in the device
times; inputs are fresh random data rotated over 4x the L2 (read from the device), so no
call finds its operands in L2; every result is NaN-poisoned first and checked against a
float32 reference (relative error < 1e-2). Repetitions are capped by `--shape-budget-ms`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing cubinstore
SOURCE = "kernels/gemm/sm90_bf16_gemm.cu"

log = logging.getLogger("bench_gemm")

# The gemm family's instantiations in //kernels:all; mirrors kernels/gemm/BUILD.bazel
# (tests/ops/test_gemm_model.py checks), for building without Bazel. Each row: (bm, bn, bk, stages,
# cluster, swap).
GRID: tuple[tuple[int, ...], ...] = tuple(
    [(128, 256, 64, s, c, 0) for s in (3, 4) for c in (1, 2)]
    + [(128, bn, 64, 5, c, 0) for bn in (128, 192) for c in (1, 2)]
    + [(128, 64, 64, 8, c, 0) for c in (1, 2)]
    + [(256, bn, 64, 4, c, 0) for bn in (64, 128) for c in (1, 2)]
    + [(128, 128, 128, 3, c, 0) for c in (1, 2)]
    + [(64, 64, 64, 10, 1, 0), (64, 128, 64, 8, 1, 0), (64, 256, 64, 5, 1, 0)]
    + [(64, 64, 128, 5, 1, 0), (64, 128, 128, 4, 1, 0)]
    + [(128, 104, 64, 6, 1, 1), (128, 152, 64, 5, 1, 1), (64, 104, 64, 10, 1, 1), (64, 112, 64, 9, 2, 1)]
    + [(64, 104, 64, 10, 4, 1), (128, 200, 64, 4, 4, 1)]
)
# The //kernels/gemm:gemm_kc target's points (a K split inside a cluster of kcluster CTAs; the last
# field): built by name only, not in //kernels:all (docs/gemm.md, fourteenth session).
KC_GRID: tuple[tuple[int, ...], ...] = (
    (64, 128, 64, 6, 1, 0, 2), (64, 128, 64, 4, 1, 0, 4), (64, 64, 128, 4, 1, 0, 2), (64, 64, 128, 3, 1, 0, 4),
    (128, 128, 64, 3, 1, 0, 2), (128, 64, 64, 6, 1, 0, 2), (128, 64, 64, 4, 1, 0, 4),
)

# (M, N, K) of the LLM projections the issue names; 4096^3 first.
SQUARE = (4096, 4096, 4096)
LLM_NK = ((4096, 4096), (14336, 4096), (4096, 14336))
LLM_M = (1, 64, 128, 4096)


def gemm_module() -> Any:
    # Imported on first use: the tests import this file for its grid without cubinstore's modules.
    from cubinstore.internals import gemm_launch as _gemm

    return _gemm


def target_name(cfg: Any) -> str:
    return cfg.family + "_" + "_".join(f"{k}{v}" for k, v in cfg.params.items()) + "_sm_90a"


# -- compile ---------------------------------------------------------------------------------------


def compile_grid(out: Path, nvcc: str, include: Path) -> None:
    from cubinstore.manifest import Manifest

    g = gemm_module()
    out.mkdir(parents=True, exist_ok=True)
    kernels = []
    seconds: dict[str, float] = {}
    for row in GRID:
        cfg = g.GemmConfig(*row)
        final = out / f"{target_name(cfg)}.cubin"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".cubin")
        os.close(fd)
        cmd = [nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", f"-I{ROOT}", f"-I{include}",
               *cfg.defines, str(ROOT / SOURCE), "-o", tmp]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            subprocess.run(cmd, check=True, timeout=600, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            os.unlink(tmp)
            sys.exit(f"nvcc failed for {cfg.kernel_id} (exit {exc.returncode}):\n{exc.stderr}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        data = Path(tmp).read_bytes()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        seconds[cfg.kernel_id] = round(cpu, 3)
        kernels.append({
            "id": cfg.kernel_id, "family": cfg.family, "params": cfg.params, "arch": g.ARCH,
            "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data),
            "entries": {g.ENTRY: list(g.ENTRY_TYPES)}, "target": f"//kernels/gemm:{target_name(cfg)}",
        })
        print(f"{cfg.kernel_id:50s} {cpu:6.2f} s CPU  {len(data):7d} bytes", flush=True)
    write_atomic(out / "manifest.json", Manifest.build(kernels, source=str(out / "manifest.json")).raw)
    write_atomic(out / "compile_seconds.json", (json.dumps(seconds, indent=1, sort_keys=True) + "\n").encode())


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- GPU helpers (shared with tune_gemm.py) --------------------------------------------------------

# Inputs rotate over at least this many times the L2, so no call finds its operands there.
ROTATE_L2 = 4
# ||D - ref|| / ||ref|| against a float32 reference of the same bf16 inputs.
MAX_REL_ERROR = 1e-2


def l2_bytes(props: Any) -> int:
    return int(props.L2_cache_size)


def open_library(manifest_path: Path, home: Path) -> Any:
    """A Library over `manifest_path` whose blobs come from the local store `home`,
    filled from the directory the manifest sits in (as after a local build)."""
    from cubinstore import launch
    from cubinstore.manifest import Manifest
    from cubinstore.store import DirectorySource, LocalLayer, Store

    manifest = Manifest.from_path(manifest_path)
    store = Store([LocalLayer(home), DirectorySource(manifest_path.parent)])
    return launch.open(manifest, store)


def gemm_specs(library: Any) -> list[Any]:
    """The kernels of the gemm family and its K-cluster family (gemm_kc)."""
    g = gemm_module()
    return [k for k in library.manifest.kernels if k.family in (g.FAMILY, g.KC_FAMILY)]


def op_specs(manifest: Any) -> list[Any]:
    """The kernels of `manifest` that ops.gemm may select: the gemm family's and the skinny family's."""
    return [k for k in manifest.kernels if k.family in gemm_module().FAMILIES]


class Operands:
    """`sets` independent (A, B, D) triples of fresh random data for one shape, together over `min_bytes`.

    With K off 8, `contiguous` False gives A and B as views of rows K rounded up to 8 apart: the
    layout ops.gemm's copy makes (cubinstore/ops/_gemm_staging.py), which a gemm tile reads in
    place, so a timing is of the kernel alone (what tune_gemm.py fits the model to). True gives
    plain contiguous tensors, as a user passes them: what `run` compares with torch.mm, the copies
    included. With K a multiple of 8 both are the same contiguous tensors.
    """

    def __init__(self, torch: Any, m: int, n: int, k: int, min_bytes: int, *, contiguous: bool = False) -> None:
        per_set = 2 * (m * k + n * k + m * n)
        self.sets = max(2, math.ceil(min_bytes / per_set))
        rows_of = k if contiguous else -(-k // 8) * 8

        def operand(rows: int) -> Any:
            x = torch.randn(rows, rows_of, device="cuda").to(torch.bfloat16)
            return x if rows_of == k else x[:, :k]

        self.a = [operand(m) for _ in range(self.sets)]
        self.b = [operand(n) for _ in range(self.sets)]
        self.d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(self.sets)]

    def reference(self, i: int) -> Any:
        """float32 A @ B.T of set i."""
        return self.a[i].float() @ self.b[i].float().T


def timed_calls(torch: Any, fn: Callable[[int], None], sets: int, reps: int, warmup: int) -> tuple[list[float], float]:
    """Each of `reps` calls of `fn(i % sets)`, after `warmup` untimed ones: its device time (us,
    sorted), and the host's time a call to enqueue them (us)."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # Keep the GPU busy while Python enqueues (at most about 0.2 ms of host time a call).
    torch.cuda._sleep(int(2e6 + reps * 4e5))
    began = time.perf_counter()
    for i in range(reps):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    host_us = (time.perf_counter() - began) / reps * 1e6
    torch.cuda.synchronize()
    return sorted(1e3 * s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)), host_us


def time_ms(torch: Any, fn: Callable[[int], None], sets: int, reps: int, warmup: int) -> float:
    """Median device time of `fn(i % sets)` over `reps` calls, in milliseconds."""
    return statistics.median(timed_calls(torch, fn, sets, reps, warmup)[0]) / 1e3


def torch_mm(torch: Any, data: Operands) -> Callable[[int], None]:
    """torch.mm of set i (cuBLAS, D = A @ B.T) into the same output buffers."""
    def run(i: int) -> None:
        torch.mm(data.a[i], data.b[i].T, out=data.d[i])

    return run


def ours_mm(data: Operands, kernel_id: str | None = None, splits: int | None = None) -> Callable[[int], None]:
    """cubinstore.ops.gemm of set i; with `kernel_id`, that instantiation and split instead of the selection's."""
    import cubinstore.ops as ops

    def run(i: int) -> None:
        if kernel_id is None:
            ops.gemm(data.a[i], data.b[i], out=data.d[i])
        else:
            ops.gemm_with(data.a[i], data.b[i], out=data.d[i], kernel_id=kernel_id, splits=splits)

    return run


def checked_error(torch: Any, fn: Callable[[int], None], data: Operands, ref: Any) -> float:
    """Relative error of `fn(0)` into a NaN-poisoned D against `ref` (inf where an element stays unwritten)."""
    return poisoned_error(torch, fn, data.d[0], ref)


def poisoned_error(torch: Any, fn: Callable[[int], None], d: Any, ref: Any) -> float:
    """`error_of` the D that `fn(0)` writes into `d`, NaN-poisoned first."""
    d.fill_(float("nan"))
    fn(0)
    torch.cuda.synchronize()
    return error_of(torch, d, ref)


def error_of(torch: Any, d: Any, ref: Any) -> float:
    """Relative error of D against the float32 `ref`; inf where an element is NaN (left unwritten)."""
    d = d.float()
    if bool(torch.isnan(d).any()):
        return math.inf
    return float((d - ref).norm() / ref.norm())


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


# -- run -------------------------------------------------------------------------------------------

# The goals (ratios of torch.mm's time to ops.gemm's).
# Issue 32's goals (ratio = torch.mm time / ops.gemm time).
GOAL_TUNING = 1.0  # geometric mean, tuning shapes
GOAL_HELD_OUT_LARGE_M = 0.95  # geometric mean, held-out shapes with M >= gemm_shapes.LARGE_M
GOAL_FLOOR = 0.85  # every held-out shape
GOAL_HOST = 2.0  # eager host time per call, at most this many times torch's
GOAL_COMPILED_HOST = 1.0  # host time per call of a compiled function, at most torch's
HOST_SHAPES = ((1, 4096, 4096), (128, 4096, 4096))


class Row:
    """One shape's result: ops.gemm and torch.mm times (ms), the selection, the error."""

    def __init__(self, shape: Any, choice: tuple[str, int], ours_ms: float, torch_ms: float, error: float,
                 reps: int, model: tuple[tuple[str, int], float] | None = None) -> None:
        self.shape, self.choice, self.ours_ms, self.torch_ms, self.error, self.reps = (
            shape, choice, ours_ms, torch_ms, error, reps)
        self.model = model  # where a measured pick replaced the model's choice: that choice and its time (ms)

    @property
    def ratio(self) -> float:
        return self.torch_ms / self.ours_ms

    @property
    def model_ratio(self) -> float:
        """The ratio with the model's own choice (the measured picks left out)."""
        return self.torch_ms / (self.model[1] if self.model else self.ours_ms)

    @property
    def right(self) -> bool:
        return self.error < MAX_REL_ERROR


def _reps(torch: Any, fn: Callable[[int], None], args: argparse.Namespace) -> int:
    """Repetitions within `--shape-budget-ms` of one call's device time, between --min-reps and --reps."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(1)
    end.record()
    torch.cuda.synchronize()
    return max(args.min_reps, min(args.reps, int(args.shape_budget_ms / max(start.elapsed_time(end), 1e-3))))


def bench_shape(torch: Any, library: Any, shape: Any, l2: int, args: argparse.Namespace) -> Row:
    m, n, k = shape.mnk
    data = Operands(torch, m, n, k, ROTATE_L2 * l2, contiguous=True)  # as a user passes them: copies counted
    ours, theirs = ours_mm(data), torch_mm(torch, data)
    error = checked_error(torch, ours, data, data.reference(0))
    reps = _reps(torch, theirs, args)
    copies = gemm_module().layout_copies(library, data.a[0], data.b[0], data.d[0])
    choice, model_fn = selection(library, m, n, k, copies), None
    own = model_choice(library, m, n, k, copies)
    if own != choice:  # a measured pick: time the model's own choice beside it
        model_fn = ours_mm(data, *own)
    # Rounds taking turns, each side's median over them: one round of a small shape (10 us) has
    # read 0.74 of torch where 16 rounds in one process read 0.86-0.91 (docs/gemm.md).
    ours_t, torch_t, model_t = [], [], []
    for _ in range(args.rounds):
        ours_t.append(time_ms(torch, ours, data.sets, reps, args.warmup))
        torch_t.append(time_ms(torch, theirs, data.sets, reps, args.warmup))
        if model_fn is not None:
            model_t.append(time_ms(torch, model_fn, data.sets, reps, args.warmup))
    model = (own, statistics.median(model_t)) if model_fn is not None else None
    return Row(shape, choice, statistics.median(ours_t), statistics.median(torch_t), error, reps, model)


def model_choice(library: Any, m: int, n: int, k: int, copies: Any = None) -> tuple[str, int]:
    """What the model alone chooses for M x N x K on device 0 (the calibration's measured picks left
    out), with `copies` (`layout_copies` of the operands) as `select` weighs them."""
    from cubinstore.internals import gemm_model as _gemm_model

    g = gemm_module()
    return _gemm_model.choose(m, n, k, g.sm_count(0), g.candidates(library), measured=False,
                              cluster_slots=g.cluster_slots(library, 0), copies=copies or (g.NO_COPIES,) * 2)


def selection(library: Any, m: int, n: int, k: int, copies: Any = None) -> tuple[str, int]:
    """What ops.gemm runs for M x N x K on device 0 (gemm.select, cached there), with `copies`
    (`layout_copies` of the operands) where the layout makes a family copy."""
    g = gemm_module()
    return g.select(library, 0, m, n, k, copies or (g.NO_COPIES,) * 2)


def print_table(title: str, rows: Sequence[Row]) -> None:
    print(f"\n== {title}")
    print(f"{'M x N x K':>18s} {'group':>12s} {'from':24s} {'kernel (splits; 0 = stream-K)':>52s} {'ours TF/s':>9s} "
          f"{'torch TF/s':>10s} {'ratio':>7s} {'reps':>4s} {'rel err':>8s}")
    for r in rows:
        m, n, k = r.shape.mnk
        flag = "" if r.right else "  WRONG"
        print(f"{r.shape.label:>18s} {r.shape.group:>12s} {r.shape.name[:24]:24s} "
              f"{f'{r.choice[0]} ({r.choice[1]})':>52s} {tflops(m, n, k, r.ours_ms):9.1f} "
              f"{tflops(m, n, k, r.torch_ms):10.1f} {r.ratio:7.1%} {r.reps:4d} {r.error:8.1e}{flag}", flush=True)
        if r.model:
            print(f"{'':>18s} {'':>12s} {'(measured pick; the model:)':24s} {f'{r.model[0][0]} ({r.model[0][1]})':>52s} "
                  f"{tflops(m, n, k, r.model[1]):9.1f} {'':>10s} {r.torch_ms / r.model[1]:7.1%}", flush=True)


RESULTS_SCHEMA = "cubinstore/bench-gemm/v1"


def save_rows(path: Path, device: str, sets: dict[str, Sequence[Row]]) -> None:
    """One run's per-shape times (`run --json`), for `compare` to set beside another run's."""
    shapes = [{"set": name, "m": r.shape.m, "n": r.shape.n, "k": r.shape.k, "group": r.shape.group,
               "kernel": r.choice[0], "splits": r.choice[1], "ours_ms": r.ours_ms, "torch_ms": r.torch_ms,
               "rel_err": r.error} for name, rows in sets.items() for r in rows]
    doc = {"schema": RESULTS_SCHEMA, "device": device, "date": time.strftime("%Y-%m-%d"), "shapes": shapes}
    write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode())


def _results(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("schema") != RESULTS_SCHEMA:
        raise SystemExit(f"{path}: not a bench_gemm.py run --json file (schema {RESULTS_SCHEMA})")
    return doc


def compare(first: Path, second: Path) -> None:
    """Two runs' ratios (torch.mm time / ops.gemm time) side by side, per shape and per set: the
    geometric means and worst shapes, each run's and how far they differ."""
    from gemm_shapes import LARGE_M

    runs = [_results(first), _results(second)]
    ratios = [{(s["set"], s["m"], s["n"], s["k"]): s["torch_ms"] / s["ours_ms"] for s in run["shapes"]} for run in runs]
    picks = [{(s["set"], s["m"], s["n"], s["k"]): f"{s['kernel']} ({s['splits']})" for s in run["shapes"]} for run in runs]
    print(f"A: {first.name}, {runs[0]['device']}, {runs[0]['date']}\nB: {second.name}, {runs[1]['device']}, {runs[1]['date']}")
    for name in ("tuning", "held-out"):
        keys = [key for key in ratios[0] if key[0] == name and key in ratios[1]]
        if not keys:
            continue
        print(f"\n== {name} shapes: ratio = torch.mm time / ops.gemm time")
        print(f"{'M x N x K':>18s} {'A':>7s} {'B':>7s} {'B / A':>7s}  pick (A; B where it differs)")
        for key in keys:
            a, b = ratios[0][key], ratios[1][key]
            pick = picks[0][key] if picks[0][key] == picks[1][key] else f"{picks[0][key]}; {picks[1][key]}"
            print(f"{'x'.join(map(str, key[1:])):>18s} {a:7.3f} {b:7.3f} {b / a:7.3f}  {pick}")
        large = [key for key in keys if key[1] >= LARGE_M]
        summary = [("geometric mean", keys), (f"geometric mean, M >= {LARGE_M}", large)] if name == "held-out" \
            else [("geometric mean", keys)]
        for what, subset in summary:
            if subset:
                print(f"{what + ' (' + str(len(subset)) + ')':>40s} " + "  ".join(
                    f"{label} {geomean([r[key] for key in subset]):.3f}" for label, r in zip("AB", ratios)))
        for label, r in zip("AB", ratios):
            worst = min(keys, key=lambda key: r[key])
            print(f"{'worst shape, ' + label:>40s} {'x'.join(map(str, worst[1:]))} {r[worst]:.3f}")


def _goal(what: str, value: float, goal: float, at_least: bool = True) -> str:
    met = value >= goal if at_least else value <= goal
    return f"{what:58s} {value:7.3f}  goal {'>=' if at_least else '<='} {goal:.2f}: {'met' if met else 'NOT MET'}"


def host_us(torch: Any, fn: Callable[[], Any], calls: int, cycles_per_us: float, chunk: int = 200) -> float:
    """CPU time per call of `fn` over `calls` back-to-back calls, the GPU kept busy so no call waits on it."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    pilot_us = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(max(1, calls // chunk)):
        # Twice the chunk's host time of GPU sleep: launches queue behind it, none waits.
        torch.cuda._sleep(int(2 * chunk * pilot_us * cycles_per_us))
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / (max(1, calls // chunk) * chunk) * 1e6


def graph_us(torch: Any, fn: Callable[[], Any], per_graph: int = 20, replays: int = 10) -> float:
    """Device time per call of `fn` captured `per_graph` times in a CUDA graph, over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream (split-K counters are per stream)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * per_graph)


def bindings_host_us(torch: Any, fn: Callable[[], Any], calls: int, cycles_per_us: float) -> str:
    """`host_us` of `fn` with its launches prepared through the bindings' cuLaunchKernelEx instead of the
    compiled helper's launch ("-" where the helper was not built): what the helper saves a call."""
    from cubinstore.internals import cuda, gemm_launch

    if cuda.native_launch() is None:
        return "-"
    try:
        with cuda.using_native_launch(None):
            gemm_launch.forget_calls()
            return f"{host_us(torch, fn, calls, cycles_per_us):.2f}"
    finally:
        gemm_launch.forget_calls()  # the helper's launches again


def overheads(torch: Any, args: argparse.Namespace, cycles_per_us: float) -> list[str]:
    import cubinstore.ops as ops

    print(f"\n== host time per call ({args.host_calls} back-to-back calls, GPU kept ahead) "
          f"and CUDA-graph replay time per call")
    print(f"{'M x N x K':>18s} {'ours host us':>12s} {'torch host us':>13s} {'ratio':>6s} "
          f"{'ours graph us':>13s} {'torch graph us':>14s} {'ours, bindings us':>17s}")
    goals = []
    for m, n, k in HOST_SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ours = host_us(torch, lambda: ops.gemm(a, b), args.host_calls, cycles_per_us)
        theirs = host_us(torch, lambda: torch.mm(a, b.T), args.host_calls, cycles_per_us)
        bindings = bindings_host_us(torch, lambda: ops.gemm(a, b), args.host_calls, cycles_per_us)
        graphs = []
        for fn in (lambda: ops.gemm(a, b, out=d), lambda: torch.mm(a, b.T, out=d)):
            try:
                graphs.append(f"{graph_us(torch, fn):.2f}")
            except Exception as exc:  # a capture failure is a result to print, not a crash
                graphs.append(f"failed: {type(exc).__name__}: {str(exc)[:60]}")
        print(f"{f'{m}x{n}x{k}':>18s} {ours:12.2f} {theirs:13.2f} {ours / theirs:6.2f} {graphs[0]:>13s} "
              f"{graphs[1]:>14s} {bindings:>17s}", flush=True)
        goals.append(_goal(f"host time per call vs torch at {m}x{n}x{k}", ours / theirs, GOAL_HOST, at_least=False))
    goals += compiled_overheads(torch, args, cycles_per_us)
    return goals


def compiled_overheads(torch: Any, args: argparse.Namespace, cycles_per_us: float) -> list[str]:
    """Host time per call of a function compiled by torch.compile (inductor, default mode) that calls
    ops.gemm, beside the same function on torch.mm: the GEMM alone, and with a ReLU after it. Each is
    the median of `--rounds` rounds, ours and torch's taking turns (which goes first alternating):
    one pair of runs on a shared host swung by 0.8-1.2 between runs."""
    import cubinstore.ops as ops

    print(f"\n== host time per call under torch.compile (inductor, default mode; {args.host_calls} back-to-back calls, "
          f"median of {args.rounds} rounds taking turns)")
    print(f"{'M x N x K':>18s} {'function':>10s} {'ours host us':>12s} {'torch host us':>13s} {'ratio':>6s}")
    goals = []
    bodies = {
        "gemm": (lambda a, b: ops.gemm(a, b), lambda a, b: torch.mm(a, b.T)),
        "relu(gemm)": (lambda a, b: torch.relu(ops.gemm(a, b)), lambda a, b: torch.relu(torch.mm(a, b.T))),
    }
    for m, n, k in HOST_SHAPES:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        for name, (ours_fn, torch_fn) in bodies.items():
            compiled = []
            torch._dynamo.reset()
            for fn in (ours_fn, torch_fn):
                c = torch.compile(fn, fullgraph=True)
                c(a, b)  # compile outside the clock
                compiled.append(c)
            rounds: list[list[float]] = [[], []]
            for r in range(args.rounds):
                for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                    rounds[i].append(host_us(torch, lambda c=compiled[i]: c(a, b), args.host_calls, cycles_per_us))
            times = [statistics.median(t) for t in rounds]
            print(f"{f'{m}x{n}x{k}':>18s} {name:>10s} {times[0]:12.2f} {times[1]:13.2f} {times[0] / times[1]:6.2f}",
                  flush=True)
            goals.append(_goal(f"compiled {name}: host time per call vs torch at {m}x{n}x{k}", times[0] / times[1],
                               GOAL_COMPILED_HOST, at_least=False))
    return goals


# Layouts ops.gemm copies (cubinstore/ops/_gemm_staging.py), each beside the same problem with no
# copy and beside torch.mm on the same tensors: (what, M x N x K, layout of A, of B, of D). "padded":
# rows 64 elements (128 bytes) apart, as docs/gemm.md advises storing weights; "transposed":
# column-major; "2 bytes in": a view one element into its buffer.
LAYOUTS = (
    ("K off 8, contiguous", (777, 3333, 1111), "contiguous", "contiguous", "contiguous"),
    ("K off 8, B padded", (777, 3333, 1111), "contiguous", "padded", "contiguous"),
    ("K off 8, both padded", (777, 3333, 1111), "padded", "padded", "contiguous"),
    ("M = 1, K off 8, contiguous", (1, 4096, 4095), "contiguous", "contiguous", "contiguous"),
    ("M = 1, K off 8, B padded", (1, 4096, 4095), "contiguous", "padded", "contiguous"),
    ("deep K off 8, contiguous", (16, 8192, 28671), "contiguous", "contiguous", "contiguous"),
    ("deep K off 8, B padded", (16, 8192, 28671), "contiguous", "padded", "contiguous"),
    ("K off 8, large, contiguous", (4096, 4096, 4095), "contiguous", "contiguous", "contiguous"),
    ("B transposed", (4096, 4096, 4096), "contiguous", "transposed", "contiguous"),
    ("A transposed", (128, 4096, 4096), "transposed", "contiguous", "contiguous"),
    ("A 2 bytes in", (128, 4096, 4096), "2 bytes in", "contiguous", "contiguous"),
    ("D transposed", (4096, 4096, 4096), "contiguous", "contiguous", "transposed"),
    ("D 2 bytes in", (128, 4096, 4096), "contiguous", "contiguous", "2 bytes in"),
)


def in_layout(torch: Any, x: Any, layout: str) -> Any:
    """`x` (rows x cols) as a view with the same values in `layout` (see LAYOUTS)."""
    rows, cols = x.shape
    if layout == "contiguous":
        return x
    if layout == "transposed":
        return x.T.contiguous().T
    if layout == "padded":
        view = torch.empty(rows, -(-cols // 64) * 64, dtype=x.dtype, device=x.device)[:, :cols]
    elif layout == "2 bytes in":
        view = torch.empty(rows * cols + 1, dtype=x.dtype, device=x.device)[1:].view(rows, cols)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    view.copy_(x)
    return view


def layout_costs(torch: Any, library: Any, l2: int, args: argparse.Namespace) -> list[str]:
    """Time each of LAYOUTS: ops.gemm as given (with its copies), ops.gemm on the same values in layouts it
    reads in place (rows K rounded up to 8 apart, D contiguous), and torch.mm as given. Returns wrong cases."""
    import cubinstore.ops as ops

    print("\n== layouts ops.gemm copies (ratio = torch.mm / ops.gemm as given; copy = as given - in place)")
    print(f"{'case':28s} {'M x N x K':>16s} {'copies':>8s} {'ours us':>8s} {'in place':>9s} {'copy us':>8s} "
          f"{'torch us':>9s} {'ratio':>7s} {'rel err':>8s}")
    wrong = []
    g = gemm_module()
    for what, (m, n, k), layout_a, layout_b, layout_d in LAYOUTS:
        plain = Operands(torch, m, n, k, ROTATE_L2 * l2)  # in place: rows of K rounded up to 8
        given_a = [in_layout(torch, a.contiguous(), layout_a) for a in plain.a]
        given_b = [in_layout(torch, b.contiguous(), layout_b) for b in plain.b]
        given_d = [d if layout_d == "contiguous" else in_layout(torch, d, layout_d) for d in plain.d]

        def given(i: int) -> None:
            ops.gemm(given_a[i], given_b[i], out=given_d[i])

        def in_place(i: int) -> None:
            ops.gemm(plain.a[i], plain.b[i], out=plain.d[i])

        def theirs(i: int) -> None:
            torch.mm(given_a[i], given_b[i].T, out=given_d[i])

        error = poisoned_error(torch, given, given_d[0], plain.reference(0))
        if not error < MAX_REL_ERROR:
            wrong.append(f"{what} {m}x{n}x{k}")
        # What the launch runs and copies: the selection's kernel, or the skinny_any point standing in for it.
        chosen = selection(library, m, n, k, g.layout_copies(library, given_a[0], given_b[0], given_d[0]))
        ran, decided = g.reads(library, chosen[0], g._describe("a", given_a[0]),
                               g._describe("b", given_b[0]), g._describe("out", given_d[0]), chosen=True)
        copies = "+".join(name for name, on in (("A", decided.a.copy), ("B", decided.b.copy),
                                                ("D", decided.copy_out)) if on) or "none"
        if ran.startswith(g.SKINNY_ANY_FAMILY + "/"):
            copies += "*"
        reps = _reps(torch, theirs, args)
        ours_t, place_t, torch_t = [], [], []
        for _ in range(args.rounds):
            ours_t.append(time_ms(torch, given, plain.sets, reps, args.warmup))
            place_t.append(time_ms(torch, in_place, plain.sets, reps, args.warmup))
            torch_t.append(time_ms(torch, theirs, plain.sets, reps, args.warmup))
        ours, place, their = (1e3 * statistics.median(t) for t in (ours_t, place_t, torch_t))
        print(f"{what:28s} {f'{m}x{n}x{k}':>16s} {copies:>8s} {ours:8.1f} {place:9.1f} {ours - place:8.1f} "
              f"{their:9.1f} {their / ours:7.1%} {error:8.1e}{'' if error < MAX_REL_ERROR else '  WRONG'}", flush=True)
    print("* run by the skinny_any point of the selected skinny point's BM and BN, which reads rows off 16 bytes in place")
    return wrong


def run(args: argparse.Namespace) -> int:
    import torch

    import gemm_shapes
    import cubinstore.ops as ops
    from cubinstore.internals import gemm_calibration as _gemm_calibration

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    l2 = l2_bytes(props)
    cycles_per_us = getattr(props, "clock_rate", 2_000_000) / 1e3  # kHz
    home = Path(args.home or tempfile.mkdtemp(prefix="cubinstore-bench-"))
    library = open_library(args.manifest, home)
    ops.set_library(library)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}")
    provenance = _gemm_calibration.PROVENANCE
    print(f"selection model calibration: {provenance if provenance else 'none (defaults from specifications)'}")
    print(f"timing: CUDA events, median of up to {args.reps} calls (about {args.shape_budget_ms:.0f} ms of "
          f"torch.mm a shape, at least {args.min_reps}), then the median of {args.rounds} such rounds, ours and "
          f"torch's taking turns; inputs rotated over {ROTATE_L2}x the L2; every result "
          f"NaN-poisoned and checked against float32 (relative error < {MAX_REL_ERROR})")
    if args.layouts_only:  # the "Layouts that copy" table of docs/gemm.md alone: about a minute
        return 1 if layout_costs(torch, library, l2, args) else 0
    if args.host_only:  # the host-time tables alone, eager and compiled
        print("\n== against the issue's goals (ratio = ops.gemm host time / torch.mm's)")
        print("\n".join(overheads(torch, args, cycles_per_us)))
        return 0
    # What ops.gemm will run on each shape, first: a selection that fails costs no GPU time.
    choices = {s.mnk: selection(library, *s.mnk) for s in gemm_shapes.TUNING + gemm_shapes.HELD_OUT}
    log.info("%d selections", len(choices))
    if args.instantiations:
        every_instantiation(torch, library, home, l2, args)

    tuning = [bench_shape(torch, library, s, l2, args) for s in gemm_shapes.TUNING]
    print_table("tuning shapes (what tune_gemm.py --calibrate measured)", tuning)
    held = [bench_shape(torch, library, s, l2, args) for s in gemm_shapes.HELD_OUT]
    print_table("held-out shapes (never seen by the calibration)", held)
    large = [r for r in held if r.shape.large_m]
    small = [r for r in held if not r.shape.large_m]
    worst = min(held, key=lambda r: r.ratio)
    worst_large = min(large, key=lambda r: r.ratio)
    lm = gemm_shapes.LARGE_M
    goals = [
        _goal(f"tuning shapes, geometric mean ({len(tuning)})", geomean([r.ratio for r in tuning]), GOAL_TUNING),
        _goal(f"held-out, M >= {lm}, geometric mean ({len(large)})", geomean([r.ratio for r in large]),
              GOAL_HELD_OUT_LARGE_M),
        _goal(f"held-out, worst shape ({worst.shape.label})", worst.ratio, GOAL_FLOOR),
        _goal(f"held-out, M >= {lm}, worst shape ({worst_large.shape.label})", worst_large.ratio, GOAL_FLOOR),
    ]
    picked = [r for r in tuning if r.model]
    info = [f"{'tuning shapes, the model alone (' + str(len(picked)) + ' measured picks out)':58s} "
            f"{geomean([r.model_ratio for r in tuning]):7.3f}",
            f"{'held-out, all, geometric mean (' + str(len(held)) + ')':58s} {geomean([r.ratio for r in held]):7.3f}",
            f"{'held-out, M < ' + str(lm) + ', geometric mean (' + str(len(small)) + ')':58s} "
            f"{geomean([r.ratio for r in small]):7.3f}"]
    # torch.mm falls off its fast path when a row stride is not a multiple of 8 elements (16 bytes);
    # the geometric mean without those shapes says how we do against cuBLAS at its best.
    aligned = [r for r in large if r.shape.n % 8 == 0 and r.shape.k % 8 == 0]
    info.append(f"{'held-out, M >= ' + str(lm) + ', N and K multiples of 8 (' + str(len(aligned)) + ')':58s} "
                f"{geomean([r.ratio for r in aligned]):7.3f}")
    if args.json:
        save_rows(args.json, props.name, {"tuning": tuning, "held-out": held})
    wrong_layouts = layout_costs(torch, library, l2, args)
    goals += overheads(torch, args, cycles_per_us)
    print("\n== against the issue's goals (ratio = torch.mm time / ops.gemm time)")
    print("\n".join(goals[:4] + info + goals[4:]))
    wrong = [r.shape.label for r in tuning + held if not r.right] + wrong_layouts
    if wrong:
        print(f"WRONG results at {', '.join(wrong)}")
        return 1
    return 0


def every_instantiation(torch: Any, library: Any, home: Path, l2: int, args: argparse.Namespace) -> None:
    """Every instantiation at 4096^3, unsplit, next to torch on the same tensors, with its load time."""
    from cubinstore import launch
    from cubinstore.store import LocalLayer, Store

    specs = gemm_specs(library)
    for spec in specs:  # fill the local store first, then load through it alone
        library.store.get(spec.digest, spec.size, name=spec.id)
    local_only = launch.open(library.manifest, Store([LocalLayer(home)]))
    m = n = k = 4096
    data = Operands(torch, m, n, k, ROTATE_L2 * l2)
    torch_ms = time_ms(torch, torch_mm(torch, data), data.sets, args.reps, args.warmup)
    print(f"\n== every instantiation at {m}x{n}x{k}, unsplit (torch.mm {tflops(m, n, k, torch_ms):.0f} TFLOP/s)")
    print(f"{'kernel id':50s} {'load ms':>8s} {'TFLOP/s':>8s} {'vs torch':>8s}")
    for spec in specs:
        t0 = time.perf_counter()
        local_only.kernel(spec.id, device=0)
        load_ms = (time.perf_counter() - t0) * 1e3
        ms = time_ms(torch, ours_mm(data, spec.id, 1), data.sets, args.reps, args.warmup)
        print(f"{spec.id:50s} {load_ms:8.2f} {tflops(m, n, k, ms):8.1f} {torch_ms / ms:8.1%}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile every instantiation and write a manifest")
    c.add_argument("--out", type=Path, default=ROOT / ".device" / "gemm")
    c.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    c.add_argument("--include", type=Path, default=None,
                   help="CUTLASS include dir (default: $CUBINSTORE_CUTLASS_INCLUDE, else nvidia-cutlass's)")
    r = sub.add_parser("run", help="time on the GPU")
    r.add_argument("--manifest", type=Path, default=ROOT / "bazel-bin" / "kernels" / "manifest.json")
    r.add_argument("--home", type=Path, default=None, help="local store root (default: a fresh temp dir)")
    r.add_argument("--reps", type=int, default=30, help="most timed calls a shape")
    r.add_argument("--min-reps", type=int, default=5, help="fewest timed calls a shape")
    r.add_argument("--shape-budget-ms", type=float, default=60.0, help="torch.mm device time a shape, about")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--rounds", type=int, default=3, help="rounds of timings a shape, ours and torch's taking turns")
    r.add_argument("--host-calls", type=int, default=2000)
    r.add_argument("--layouts-only", action="store_true",
                   help="only the table of the layouts ops.gemm copies (docs/gemm.md, 'Layouts that copy')")
    r.add_argument("--host-only", action="store_true",
                   help="only the host time per call tables (eager, CUDA-graph replay, under torch.compile)")
    r.add_argument("--json", type=Path, default=None,
                   help="also write each shape's times and pick here, for `compare` with another run")
    cmp = sub.add_parser("compare", help="two runs' --json files side by side (no GPU)")
    cmp.add_argument("first", type=Path)
    cmp.add_argument("second", type=Path)
    r.add_argument("--instantiations", action="store_true",
                   help="also time every instantiation at 4096^3 with its load time from the local store")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("compile", "run", "compare", "-h", "--help"):
        argv.insert(0, "run")  # the default command
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "compile":
        from cubinstore.errors import BadArgumentError
        from cubinstore.internals import cutlass_include

        try:
            include = args.include or cutlass_include()
        except BadArgumentError as exc:
            raise SystemExit(f"compile: {exc}") from None
        compile_grid(args.out, args.nvcc, include)
    elif args.command == "compare":
        compare(args.first, args.second)
    else:
        sys.exit(run(args))


if __name__ == "__main__":
    main()
