"""The GEMM shapes of the tuning and benchmark scripts, defined once.

`TUNING` is what `tune_gemm.py --calibrate` measures and fits the selection model to
(the 33 shapes of the 2026-11-29 tuning table plus a few that exercise tails and partial
waves, and since issue 32 M, N or K off 8 and few rows with deep K); `HELD_OUT` is what the
model is judged on and the calibration never sees: square, Llama-3 8B/70B projections other
than the tuning set's, MoE-like tall-skinny shapes, odd sizes with tails in M, N and K (issue
32's 777x3333x1111 among them) and more few-row deep-K shapes. The two sets are disjoint
(tests/ops/test_gemm_model.py checks). Each shape is (M, N, K) for D = A @ B.T with A M x K and
B N x K. With K off 8, bench_gemm.py passes contiguous operands (ops.gemm copies them: its
timing counts the copies, as a user's would) and tune_gemm.py passes rows K rounded up to 8
apart (the copies' layout: its timings are of the kernels alone, what the model predicts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["HELD_OUT", "LARGE_M", "TUNING", "Shape"]

#: The issue's goals treat M >= LARGE_M (compute-bound serving batches) apart from smaller M.
LARGE_M: Final = 128


@dataclass(frozen=True)
class Shape:
    """One problem and where it comes from."""

    m: int
    n: int
    k: int
    group: str  # "square", "llm", "moe", "tail", "partial-wave", "deep-k"
    name: str

    @property
    def mnk(self) -> tuple[int, int, int]:
        return self.m, self.n, self.k

    @property
    def large_m(self) -> bool:
        return self.m >= LARGE_M

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def _llm(model: str, projections: dict[str, tuple[int, int]], ms: tuple[int, ...]) -> list[Shape]:
    return [Shape(m, n, k, "llm", f"{model} {proj}") for proj, (n, k) in projections.items() for m in ms]


# Llama-3 8B: hidden 4096, 8 KV heads of 128 (kv 1024), MLP 14336. 70B: hidden 8192, kv 1024,
# MLP 28672. N x K per projection (N output features, K input features); gate-up is fused.
_TUNING_LLM: Final = {"q/o": (4096, 4096), "gate": (14336, 4096), "down": (4096, 14336)}
_HELD_OUT_8B: Final = {"kv": (1024, 4096), "gate-up": (28672, 4096)}
_HELD_OUT_70B: Final = {"q/o": (8192, 8192), "kv": (1024, 8192), "gate-up": (57344, 8192), "down": (8192, 28672)}

TUNING: Final[tuple[Shape, ...]] = tuple(
    [Shape(s, s, s, "square", "square") for s in (1024, 2048, 4096, 8192)]
    + [s for s in _llm("llama3-8b", _TUNING_LLM, (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
       if s.mnk != (4096, 4096, 4096)]
    + [
        # Tails and last waves the LLM shapes lack, so the fit sees them too.
        Shape(300, 2304, 1544, "tail", "tail"),
        Shape(2560, 2560, 520, "partial-wave", "short K"),
        Shape(1280, 3584, 4096, "partial-wave", "140 tiles of 128x256"),
        Shape(96, 8192, 2048, "moe", "small M"),
        Shape(6000, 512, 3000, "moe", "large M, small N"),
        # Issue 32: M, N or K off 8 (K off 8: through ops.gemm's copies), few rows with deep K.
        Shape(1000, 2000, 1001, "tail", "K off 8"),
        Shape(2048, 1001, 4096, "tail", "N off 8"),
        Shape(999, 4096, 2048, "tail", "M off 8"),
        Shape(16, 4096, 28672, "deep-k", "few rows, deep K"),
        Shape(32, 8192, 28672, "deep-k", "few rows, deep K"),
        Shape(64, 2048, 28672, "deep-k", "few rows, deep K"),
        # Twelfth session: `skinny` grids below the SM count (few columns of D). Without them the fit
        # cannot tell its points' K-block costs apart there: refits flipped held-out 1x1024x8192
        # between two points (docs/gemm.md, eleventh session). Chosen for that, after those studies.
        Shape(1, 2048, 8192, "deep-k", "one row, few CTAs"),
        Shape(16, 512, 14336, "deep-k", "few rows, few CTAs"),
    ]
)

HELD_OUT: Final[tuple[Shape, ...]] = tuple(
    [Shape(s, s, s, "square", "square") for s in (1536, 3072, 6144)]
    + _llm("llama3-8b", _HELD_OUT_8B, (1, 16, 128, 512, 2048, 8192))
    # M up to 4096 here: 8192 x 8192 x 8192 is a tuning square.
    + _llm("llama3-70b", _HELD_OUT_70B, (1, 16, 128, 512, 2048, 4096))
    + [
        Shape(48, 2048, 7168, "moe", "expert up, few tokens"),
        Shape(200, 7168, 2048, "moe", "expert down, few tokens"),
        Shape(256, 1408, 2048, "moe", "small expert"),
        Shape(16384, 256, 7168, "moe", "large M, small N"),
        Shape(32768, 128, 1024, "moe", "router-like, N 128"),
        Shape(1000, 3000, 2008, "tail", "tails in M, N, K"),
        Shape(4095, 4097, 4104, "tail", "one past the tiles"),
        Shape(777, 1555, 3112, "tail", "odd"),
        Shape(2049, 2047, 1000, "tail", "odd K"),
        Shape(129, 12289, 4104, "tail", "one row past a tile"),
        Shape(1, 5000, 3000, "tail", "M = 1, odd N"),
        # Issue 32: its shape (K off 8), every dimension off 8, M = 1 with K off 8, few rows with deep K.
        Shape(777, 3333, 1111, "tail", "issue 32: K off 8"),
        Shape(2047, 4095, 4095, "tail", "M, N and K off 8"),
        Shape(1, 4096, 4095, "tail", "M = 1, K off 8"),
        Shape(8, 8192, 28672, "deep-k", "few rows, deep K"),
        Shape(32, 4096, 28672, "deep-k", "few rows, deep K"),
        Shape(16, 8192, 28671, "deep-k", "few rows, deep K off 8"),
    ]
)
