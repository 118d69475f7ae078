"""Split launches far slower than their kernel's other splits (prints tables; not a test).

The eighth session's calibrations and judge (H100) held 15 split timings of 5,974 at 4-36x the
median of the same instantiation's splits at that shape (docs/gemm.md).

    # anywhere: list them in saved --calibrate / --judge-held-out timings
    python benchmarks/gemm_split_outliers.py --scan a.json b.json held_out.json
    # on the GPU: time such options again, with and without splits, three ways each
    PYTHONPATH=. python benchmarks/gemm_split_outliers.py --manifest bazel-bin/kernels/manifest.json

On the GPU, each option (and the same instantiation unsplit) is timed: as tune_gemm.py does,
three times (median of 30 calls, inputs rotated over 4x the L2); 30 calls on one input set, each
timed alone (min / median / max); and 10 calls, each waited for on the host (wall time). A slow
kernel shows in all three; host time the GPU did not hide, in the rotated medians only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(30)]
            torch.cuda._sleep(int(2e7))  # the GPU kept busy while the 30 calls are enqueued
            for start, end in events:
                start.record()
                run(0)
                end.record()
            torch.cuda.synchronize()
            alone = sorted(1e3 * start.elapsed_time(end) for start, end in events)
            began = time.perf_counter()
            for _ in range(10):
                run(0)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - began) / 10 * 1e6
            print(f"{m}x{n}x{k} {kernel_id} splits {s}: error {err:.1e}, rotated "
                  f"{' / '.join(f'{x:.1f}' for x in rotated)}, one set {alone[0]:.1f} / {alone[15]:.1f} / "
                  f"{alone[-1]:.1f}, wall {wall:.1f} ({data.sets} input sets)", flush=True)
            if not math.isfinite(err):
                print("  (an element of D was left unwritten)")
        del data, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--scan", type=Path, nargs="+", metavar="MEASUREMENTS", help="saved timings to scan (CPU)")
    mode.add_argument("--manifest", type=Path, help="time the flagged options again (GPU)")
    args = parser.parse_args()
    if args.scan:
        scan(args.scan)
    else:
        probe(args.manifest)


if __name__ == "__main__":
    main()
