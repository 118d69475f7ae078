"""benchmarks/gemm_split_cost.py's variants still fit the kernel, without a GPU or nvcc.

Each variant is a set of edits of kernels/gemm/sm90_bf16_gemm.cuh whose text must occur exactly
once: a change of the split protocol that moves one fails here, not in a device run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemm_split_cost as split_cost  # noqa: E402  (the benchmark script)


@pytest.mark.parametrize("variant", sorted(split_cost.VARIANTS))
def test_every_edit_of_a_variant_applies_once(variant: str) -> None:
    source = (ROOT / split_cost.HEADER).read_text()
    edited = split_cost.edited(source, split_cost.VARIANTS[variant], variant)
    assert (edited == source) == (variant == "as_built")


def test_an_edit_whose_text_moved_names_the_variant() -> None:
    with pytest.raises(SystemExit, match=r"^variant no_read: expected one occurrence"):
        split_cost.edited("no such text", (("for (int sl", "x"),), "no_read")


def test_the_cases_time_only_points_the_variants_build() -> None:
    assert split_cost.CORRECT <= set(split_cost.VARIANTS)
    for options in split_cost.CASES.values():
        assert {point for point, _ in options} <= set(split_cost.POINTS)
