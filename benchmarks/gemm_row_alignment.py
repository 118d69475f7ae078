"""Which operand's rows off the 128-byte lines cost ops.gemm time (prints a table; not a test).

For shapes whose K is not a multiple of 64, times ops.gemm and torch.mm with A and B each in
contiguous rows or in a row stride padded to a multiple of 64 elements (a view of a wider
tensor): the same shape, so ops.gemm makes the same pick. Operands stay resident in L2; each
figure is bench_gemm's device time (CUDA events around each call, the GPU kept busy while Python
enqueues, median), in us. Results are checked against float32.

  PYTHONPATH=. python benchmarks/gemm_row_alignment.py --manifest bazel-bin/kernels/manifest.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm as bench  # noqa: E402  (the sibling script: the checkout on sys.path, loading, timing)

SHAPES = ((300, 2304, 1544), (1000, 3000, 2008), (2560, 2560, 520), (6000, 512, 3000), (4096, 4096, 4104))


def device_us(torch, fn, reps: int = 100, warmup: int = 5) -> float:
    return bench.time_ms(torch, lambda _: fn(), 1, reps, warmup) * 1e3


def operand(torch, rows: int, k: int, padded: bool):
    if not padded:
        return torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    return torch.randn(rows, -(-k // 64) * 64, device="cuda", dtype=torch.bfloat16)[:, :k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from cubinstore import ops

    ops.set_library(bench.open_library(args.manifest.resolve(), Path(tempfile.mkdtemp(prefix="gemm-rows-"))))
    print("| M x N x K | both contiguous | B padded | A padded | both padded | torch, both contiguous |")
    print("|---|---|---|---|---|---|")
    for m, n, k in SHAPES:
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ours = []
        for pad_a, pad_b in ((False, False), (False, True), (True, False), (True, True)):
            a, b = operand(torch, m, k, pad_a), operand(torch, n, k, pad_b)
            ops.gemm(a, b, out=d)
            ref = a.float() @ b.float().T
            error = ((d.float() - ref).norm() / ref.norm()).item()
            if not error < 1e-2:
                raise SystemExit(f"{m}x{n}x{k}: relative error {error:.2e}")
            ours.append(device_us(torch, lambda: ops.gemm(a, b, out=d)))
            if not (pad_a or pad_b):
                theirs = device_us(torch, lambda: torch.mm(a, b.T, out=d))
        print(f"| {m}x{n}x{k} | " + " | ".join(f"{t:.1f}" for t in ours) + f" | {theirs:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
