"""Host time of an operator call, for benchmarks and the host-overhead test.

    from cubinstore.ops._timing import host_us_per_call
    host_us_per_call(lambda: ops.gemm(a, b, out=d))      # vs lambda: torch.mm(a, b.T, out=d)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["host_us_per_call"]


def host_us_per_call(fn: Callable[[], Any], *, calls: int = 2000, warmup: int = 100, rounds: int = 5) -> float:
    """Microseconds of host time per call of `fn`, called back to back (the median of `rounds`).

    Each round times `calls` calls with no synchronisation between them, so a call costs
    what it takes to enqueue its work, not to run it, as long as the GPU keeps up; the GPU
    is drained before each round so no round waits on an earlier one.
    """
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]
