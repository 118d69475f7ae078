"""Split launches far slower than their kernel's other splits (prints tables; not a test).

The eighth session's calibrations and judge (H100) held 15 split timings of 5,974 at 4-36x the
median of the same instantiation's splits at that shape (docs/gemm.md).

    # anywhere: list them in saved --calibrate / --judge-held-out timings
    python benchmarks/gemm_split_outliers.py --scan a.json b.json held_out.json
    # on the GPU: time such options again, with and without splits, three ways each
    PYTHONPATH=. python benchmarks/gemm_split_outliers.py --manifest bazel-bin/kernels/manifest.json
    # on the GPU: time every option of the tuning and held-out shapes as --calibrate does, and
    # look again at each batch that comes out slow (how often, host or GPU, all calls or some)
    PYTHONPATH=. python benchmarks/gemm_split_outliers.py --sweep --manifest bazel-bin/kernels/manifest.json

On the GPU, each option (and the same instantiation unsplit) is timed: as tune_gemm.py does,
three times (median of 30 calls, inputs rotated over 4x the L2); 30 calls on one input set, each
timed alone (min / median / max); and 10 calls, each waited for on the host (wall time). A slow
kernel shows in all three; host time the GPU did not hide, in the rotated medians only.

--sweep repeats the calibration's order (shape by shape, each option checked, then 3 warm-up
calls and 30 timed ones behind a sleep kernel) and records each batch's host time per call. A
batch above OUTLIER x the median of its instantiation's batches before it at that shape (splits
ascending, 1 first) is printed with its calls' spread and the error of every D it wrote, and timed
again at once, twice, and once more waited for call by call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm as bench  # noqa: E402  (the sibling script: loading, operands, timing)
import tune_gemm as tune  # noqa: E402  (the saved timings' format)

OUTLIER = 4.0  # times the median of the instantiation's splits at the shape (16 splits cost up to ~2.7x)

# Options the eighth session's timings flagged (M, N, K), kernel id, splits.
CASES = (
    ((16, 1024, 4096), "gemm/bm256/bn128/bk64/stages4/cluster1/swap0/sm_90a", 6),
    ((16, 1024, 8192), "gemm/bm64/bn64/bk64/stages10/cluster1/swap0/sm_90a", 4),
    ((1, 5000, 3000), "gemm/bm64/bn64/bk64/stages10/cluster1/swap0/sm_90a", 2),
    ((48, 2048, 7168), "gemm/bm64/bn64/bk128/stages5/cluster1/swap0/sm_90a", 2),
    ((300, 2304, 1544), "gemm/bm128/bn200/bk64/stages4/cluster4/swap1/sm_90a", 2),
    ((64, 4096, 4096), "gemm/bm128/bn128/bk64/stages5/cluster2/swap0/sm_90a", 3),
)


def scan(paths: list[Path]) -> None:
    """Each file's split timings above OUTLIER x the median of the same instantiation's splits there."""
    print(f"{'file':>28s} {'M x N x K':>16s} {'instantiation':>52s} {'splits':>6s} {'us':>8s} {'median':>8s}")
    for path in paths:
        timings, _ = tune.load(path)
        flagged = split = 0
        for mnk, measured in tune._by_shape(timings).items():
            by_kernel: dict[str, dict[int, float]] = {}
            for (kernel_id, splits), us in measured.items():
                by_kernel.setdefault(kernel_id, {})[splits] = us
            for kernel_id, runs in by_kernel.items():
                median = statistics.median(runs.values())
                for splits, us in runs.items():
                    if splits == 1:
                        continue
                    split += 1
                    if len(runs) > 1 and us > OUTLIER * median:
                        flagged += 1
                        print(f"{path.name[:28]:>28s} {'x'.join(map(str, mnk)):>16s} {kernel_id:>52s} {splits:6d} "
                              f"{us:8.1f} {median:8.1f}")
        print(f"{path.name[:28]:>28s}: {flagged} of {split} split timings above {OUTLIER}x")


def probe(manifest: Path) -> None:
    import torch

    import cubinstore.ops as ops

    ops.set_library(bench.open_library(manifest, Path(tempfile.mkdtemp(prefix="cubinstore-outliers-"))))
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}; us: rotated = three medians of 30 calls (tune_gemm's timing); one set = "
          "min / median / max of 30 calls timed alone; wall = one call waited for, mean of 10")
    l2 = bench.l2_bytes(props)
    for (m, n, k), kernel_id, splits in CASES:
        data = bench.Operands(torch, m, n, k, bench.ROTATE_L2 * l2)
        ref = data.reference(0)
        for s in (1, splits):
            run = bench.ours_mm(data, kernel_id, s)
            err = bench.checked_error(torch, run, data, ref)
            rotated = [1e3 * bench.time_ms(torch, run, data.sets, 30, 3) for _ in range(3)]
            alone, _ = bench.timed_calls(torch, run, 1, 30, 0)  # 30 calls on input set 0
            wall = waited_for(torch, run)
            print(f"{m}x{n}x{k} {kernel_id} splits {s}: error {err:.1e}, rotated "
                  f"{' / '.join(f'{x:.1f}' for x in rotated)}, one set {alone[0]:.1f} / {alone[15]:.1f} / "
                  f"{alone[-1]:.1f}, wall {wall:.1f} ({data.sets} input sets)", flush=True)
            if not math.isfinite(err):
                print("  (an element of D was left unwritten)")
        del data, ref


def timed_batch(torch: Any, fn: Callable[[int], None], sets: int) -> tuple[list[float], float]:
    """tune_gemm's batch (3 warm-up calls, 30 timed): each call's device time (us, sorted) and the
    host's enqueue time a call (us): above about 250 us a call the sleep kernel no longer hides it."""
    return bench.timed_calls(torch, fn, sets, 30, 3)


def waited_for(torch: Any, fn: Callable[[int], None], calls: int = 10) -> float:
    """Mean wall time (us) of `calls` calls of `fn(0)`, each waited for on the host."""
    began = time.perf_counter()
    for _ in range(calls):
        fn(0)
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls * 1e6


def _spread(calls: list[float]) -> str:
    return f"{calls[0]:.1f} / {statistics.median(calls):.1f} / {calls[-1]:.1f}"


def sweep(manifest: Path, save: Path | None) -> None:
    import torch

    import cubinstore.ops as ops
    from gemm_shapes import HELD_OUT, TUNING

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    library = bench.open_library(manifest, Path(tempfile.mkdtemp(prefix="cubinstore-outliers-")))
    ops.set_library(library)
    ids = sorted(spec.id for spec in bench.op_specs(library.manifest))
    gpu = tune.Gpu(props.multi_processor_count, bench.l2_bytes(props), bench.gemm_module().cluster_slots(library, 0))
    by_shape = tune.plan_by_shape(ids, gpu, TUNING + HELD_OUT)
    print(f"device: {props.name}; {sum(map(len, by_shape.values()))} timings; columns: device us min / median / "
          "max of the batch's 30 calls, host us a call while enqueuing", flush=True)
    batches = flagged = 0
    hosts: list[float] = []
    timings: dict[bool, list[tune.Timing]] = {True: [], False: []}  # by "a tuning shape"
    tuning = {shape.mnk for shape in TUNING}
    started = time.perf_counter()
    for (m, n, k), runs in by_shape.items():
        data = bench.Operands(torch, m, n, k, bench.ROTATE_L2 * gpu.l2_bytes)
        ref = data.reference(0)
        medians: dict[str, dict[int, float]] = {}
        for kid, splits in runs:
            run = bench.ours_mm(data, kid, splits)
            if not bench.checked_error(torch, run, data, ref) < bench.MAX_REL_ERROR:
                print(f"  WRONG {kid} splits {splits} at {m}x{n}x{k}", flush=True)
                continue
            calls, host = timed_batch(torch, run, data.sets)
            batches += 1
            hosts.append(host)
            median = statistics.median(calls)
            timings[(m, n, k) in tuning].append(tune.Timing(m, n, k, kid, splits, median))
            before = medians.setdefault(kid, {})  # this instantiation's batches so far (splits ascending)
            before[splits] = median
            typical = statistics.median(us for s, us in before.items() if s != splits) if len(before) > 1 else 0.0
            if splits == 1 or not typical or median <= OUTLIER * typical:
                continue
            flagged += 1
            # D of every set the batch wrote, against float32, before anything else writes it.
            worst = max(bench.error_of(torch, data.d[i], data.reference(i)) for i in range(min(data.sets, 30)))
            again = [timed_batch(torch, run, data.sets) for _ in range(2)]
            wall = waited_for(torch, run)
            print(f"{m}x{n}x{k} {kid} splits {splits} (its other batches' median {typical:.1f}): "
                  f"{_spread(calls)}, host {host:.1f}, error {worst:.1e}; again {_spread(again[0][0])}, "
                  f"host {again[0][1]:.1f}; {_spread(again[1][0])}, host {again[1][1]:.1f}; waited for {wall:.1f} "
                  f"({data.sets} sets)", flush=True)
        del data, ref
        if save is not None:  # after each shape: a run cut short keeps what it timed
            _save(save, timings, props, gpu, torch)
    hosts.sort()
    print(f"{flagged} of {batches} batches above {OUTLIER}x in {time.perf_counter() - started:.0f} s; host us a call "
          f"while enqueuing: median {statistics.median(hosts):.1f}, p99 {hosts[int(0.99 * len(hosts))]:.1f}, "
          f"max {hosts[-1]:.1f}")


def _save(where: Path, timings: dict[bool, list[tune.Timing]], props: Any, gpu: tune.Gpu, torch: Any) -> None:
    """The timings as --calibrate and --judge-held-out save them (medians of 30 calls, not 15)."""
    for is_tuning, name in ((True, "sweep_tuning.json"), (False, "sweep_held.json")):
        runs = timings[is_tuning]
        tune.save(where / name, runs, tune.provenance_of(torch, props, gpu, 30, runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--scan", type=Path, nargs="+", metavar="MEASUREMENTS", help="saved timings to scan (CPU)")
    mode.add_argument("--manifest", type=Path, help="time the flagged options again (GPU)")
    parser.add_argument("--sweep", action="store_true", help="with --manifest: time every tuning and held-out "
                        "option as --calibrate does and look again at the slow batches (GPU)")
    parser.add_argument("--save", type=Path, help="with --sweep: write the timings there, as sweep_tuning.json "
                        "and sweep_held.json (tune_gemm.py's format: --stability, --judge)")
    args = parser.parse_args()
    if args.scan:
        scan(args.scan)
    elif args.sweep:
        sweep(args.manifest, args.save)
    else:
        probe(args.manifest)


if __name__ == "__main__":
    main()
