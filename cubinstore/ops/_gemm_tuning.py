"""The 2026-11-29 tuning table of cubinstore.ops.gemm: shape bucket -> (kernel id, K splits).

No longer the selection: `ops.gemm` asks the model in `_gemm_model.py`. Kept as measured
winners the model's defaults are checked against (tests/ops/test_gemm_model.py). Written by the
table mode benchmarks/tune_gemm.py had before its calibration; do not edit by hand.
Measured on NVIDIA H200 (132 SMs), 2026-11-29, with torch 2.11.0+cu130: each candidate
(kernel id and split) was checked against torch.matmul and timed 10 times (median of CUDA
event times), inputs rotated over three times the L2 size.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["MEASURED", "TABLE", "lookup"]

MEASURED: Final = "2026-11-29, NVIDIA H200 (132 SMs), torch 2.11.0+cu130"

# Representative (M, N, K) -> (kernel id, splits). A problem uses the entry whose
# shape is nearest in log2 space (sum over M, N, K of |log2(x / x_entry)|).
TABLE: Final[dict[tuple[int, int, int], tuple[str, int]]] = {
    (1024, 1024, 1024): ("gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", 1),
    (2048, 2048, 2048): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (4096, 4096, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (8192, 8192, 8192): ("gemm/bm128/bn256/bk64/stages3/cluster1/swap0/sm_90a", 1),
    (1, 4096, 4096): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 4),
    (16, 4096, 4096): ("gemm/bm128/bn128/bk128/stages3/cluster1/swap0/sm_90a", 4),
    (64, 4096, 4096): ("gemm/bm128/bn128/bk128/stages3/cluster1/swap0/sm_90a", 4),
    (128, 4096, 4096): ("gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", 2),
    (256, 4096, 4096): ("gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", 1),
    (512, 4096, 4096): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 1),
    (1024, 4096, 4096): ("gemm/bm256/bn128/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (2048, 4096, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (8192, 4096, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (1, 14336, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 2),
    (16, 14336, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (64, 14336, 4096): ("gemm/bm128/bn192/bk64/stages5/cluster1/swap0/sm_90a", 1),
    (128, 14336, 4096): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 1),
    (256, 14336, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (512, 14336, 4096): ("gemm/bm256/bn128/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (1024, 14336, 4096): ("gemm/bm128/bn192/bk64/stages5/cluster1/swap0/sm_90a", 1),
    (2048, 14336, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (4096, 14336, 4096): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (8192, 14336, 4096): ("gemm/bm256/bn128/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (1, 4096, 14336): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 8),
    (16, 4096, 14336): ("gemm/bm128/bn192/bk64/stages5/cluster1/swap0/sm_90a", 4),
    (64, 4096, 14336): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 4),
    (128, 4096, 14336): ("gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", 2),
    (256, 4096, 14336): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 2),
    (512, 4096, 14336): ("gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 1),
    (1024, 4096, 14336): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (2048, 4096, 14336): ("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 1),
    (4096, 4096, 14336): ("gemm/bm128/bn256/bk64/stages3/cluster1/swap0/sm_90a", 1),
    (8192, 4096, 14336): ("gemm/bm128/bn256/bk64/stages3/cluster1/swap0/sm_90a", 1),
}


def lookup(m: int, n: int, k: int) -> tuple[str, int]:
    """(kernel id, splits) of the table entry nearest to an M x N x K problem."""
    def distance(shape: tuple[int, int, int]) -> float:
        return sum(abs(math.log2(x / y)) for x, y in zip((m, n, k), shape, strict=True))

    return TABLE[min(TABLE, key=distance)]
