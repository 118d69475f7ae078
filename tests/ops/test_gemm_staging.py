"""Which operands an ``ops.gemm`` launch copies, without a GPU: `_gemm_staging`'s decisions.

Each case is a layout torch.mm takes; the decision says whether A and B are read in place or
through a copy (and with which row stride), and whether D goes through a copy: the same for a
`gemm` tile and a `skinny` point, which both read any K in place. The GPU
tests (test_gemm_gpu.py) run the same layouts against a float32 reference.
"""

from __future__ import annotations

import pytest

from cubinstore.internals import Feed, Operand, Staging, check_operands, padded, reads_in_place, staging, writes_in_place
from cubinstore.internals import gemm_staging

BASE = 0x7F0000000000  # 512-byte aligned, as torch's caching allocator hands out


def op(name: str, shape: tuple[int, int], strides: tuple[int, int] | None = None, *, offset: int = 0) -> Operand:
    """A bf16 CUDA operand; `offset` in elements from an aligned start (a view's storage offset)."""
    return Operand(name, "bfloat16", shape, strides or (shape[1], 1), "cuda:0", BASE + 2 * offset)


def decide(a: Operand, b: Operand, out: Operand | None = None) -> Staging:
    check_operands(a, b, out)  # every case is a valid problem first
    return staging(a, b, out)


IN_PLACE_1000 = Feed(False, 1000)


def test_padded_rounds_up_to_16_bytes() -> None:
    assert [padded(k) for k in (1, 7, 8, 9, 1111, 1112, 28671)] == [8, 8, 8, 16, 1112, 1112, 28672]


def test_contiguous_aligned_operands_copy_nothing() -> None:
    s = decide(op("a", (300, 1000)), op("b", (500, 1000)), op("out", (300, 500)))
    assert s == Staging(IN_PLACE_1000, IN_PLACE_1000, False) and not s.copies


def test_k_off_8_copies_both_into_rows_of_k_rounded_up() -> None:
    # The shape: the kernel reads K = 1111 columns of rows 1112 apart (TMA fills zeros past
    # K itself; skinny loads the last 7 one by one).
    s = decide(op("a", (777, 1111)), op("b", (3333, 1111)))
    assert s == Staging(Feed(True, 1112), Feed(True, 1112), False)


def test_a_weight_stored_in_padded_rows_is_read_in_place_with_k_off_8() -> None:
    # torch.empty(n, 1152)[:, :1111]: rows 16-byte apart already; only the activations are copied.
    s = decide(op("a", (777, 1111)), op("b", (3333, 1111), (1152, 1)))
    assert (s.a, s.b) == (Feed(True, 1112), Feed(False, 1152))
    # A decode step (few rows of A, a skinny point) copies its activations, never the weight.
    s = decide(op("a", (16, 1111)), op("b", (4096, 1111), (1152, 1)))
    assert (s.a, s.b) == (Feed(True, 1112), Feed(False, 1152))


def test_one_row_is_read_in_place_at_any_k_with_a_16_byte_stride_for_the_map() -> None:
    s = decide(op("a", (1, 1111), (1, 1)), op("b", (4096, 1111), (1112, 1)))
    assert s.a == Feed(False, 1112) and s.b == Feed(False, 1112) and not s.copies


@pytest.mark.parametrize(("a", "why"), [
    (op("a", (64, 1000), (1, 64)), "a transposed view: K not contiguous"),
    (op("a", (64, 1000), (1004, 1)), "rows 2008 bytes apart: off 16"),
    (op("a", (64, 1000), (0, 1)), "an expanded row: rows overlap"),
    (op("a", (64, 1000), (500, 1)), "rows closer than K"),
    (op("a", (64, 1000), offset=4), "a view 8 bytes in"),
    (op("a", (64, 1000), offset=1), "a view 2 bytes in"),
    (op("a", (64, 1000), (2**31, 1)), "a row stride past int32"),
])
def test_layouts_the_kernels_cannot_read_are_copied_into_contiguous_rows(a: Operand, why: str) -> None:
    assert not reads_in_place(a, 64, 1000), why
    s = decide(a, op("b", (64, 1000)))
    assert s.a == Feed(True, 1000) and s.b == IN_PLACE_1000, why


@pytest.mark.parametrize(("a", "why"), [
    (op("a", (64, 1000), (1064, 1)), "padded rows, 16-byte multiple"),
    (op("a", (64, 1000), (1000, 1), offset=8), "a view 16 bytes in"),
    (op("a", (64, 1), (8, 7)), "one column: its stride is never stepped"),
    (op("a", (1, 1000), (3, 1)), "one row: its stride is never stepped"),
])
def test_layouts_the_kernels_read_as_they_are(a: Operand, why: str) -> None:
    assert reads_in_place(a, *a.shape), why


def test_k_of_one_column_copies_rows_of_8() -> None:
    s = decide(op("a", (7, 1)), op("b", (9, 1)))
    assert s == Staging(Feed(True, 8), Feed(True, 8), False)


@pytest.mark.parametrize(("out", "copied"), [
    (op("out", (64, 32)), False),
    (op("out", (64, 32), (1, 64)), True),  # a transposed D
    (op("out", (64, 32), (40, 1)), True),  # a column slice of a wider D
    (op("out", (64, 32), offset=1), False),  # 2 bytes in: every store off TMA is one element
    (op("out", (64, 32), offset=2), False),  # 4 bytes in (TMA is skipped, not the kernel)
    (op("out", (64, 33), offset=1), False),  # N odd: stored one element at a time
    (op("out", (1, 32), (7, 1)), False),  # one row: its stride is never stepped
    (op("out", (64, 1), (5, 9)), True),  # one column, rows 5 apart
])
def test_d_is_copied_only_where_the_kernel_cannot_store_it(out: Operand, copied: bool) -> None:
    m, n = out.shape
    assert writes_in_place(out, m, n) is not copied
    assert decide(op("a", (m, 64)), op("b", (n, 64)), out).copy_out is copied


def test_without_out_d_is_never_copied() -> None:
    assert not decide(op("a", (3, 5), (1, 3)), op("b", (7, 5), offset=1)).copy_out


@pytest.mark.parametrize("m", [1, 7, 9, 15, 127, 1111])
@pytest.mark.parametrize("n", [1, 7, 9, 15, 127, 1111])
@pytest.mark.parametrize("k", [1, 7, 8, 9, 15, 127, 1111, 28671])
def test_every_odd_shape_gets_rows_the_kernels_can_read(m: int, n: int, k: int) -> None:
    # Over contiguous operands: whatever is decided, what the kernel reads meets its contract.
    s = decide(op("a", (m, k)), op("b", (n, k)))
    for feed, rows in ((s.a, m), (s.b, n)):
        assert feed.row_stride % 8 == 0 and feed.row_stride >= k
        assert feed.copy == (k % 8 != 0 and rows > 1)


def test_copies_count_each_copy_and_the_bytes_it_reads_and_writes() -> None:
    # K off 8, contiguous: A (16 rows) and B (8192 rows) are each read in rows of K and written
    # in rows of padded(K); the selection weighs what that moves (941 MB at 16x8192x28671).
    s = decide(op("a", (16, 28671)), op("b", (8192, 28671)))
    assert gemm_staging.copies_of(s, 16, 8192, 28671) == gemm_staging.Copies(2, 2 * (16 + 8192) * (28671 + 28672))
    # D through a copy: written into a fresh D, then read back and written into `out`.
    s = decide(op("a", (300, 1000)), op("b", (500, 1000)), op("out", (300, 500), (1, 300)))
    assert gemm_staging.copies_of(s, 300, 500, 1000) == gemm_staging.Copies(1, 2 * 2 * 300 * 500)
    assert gemm_staging.copies_of(decide(op("a", (300, 1000)), op("b", (500, 1000))), 300, 500, 1000) == (
        gemm_staging.NO_COPIES)


@pytest.mark.parametrize(("b_strides", "twin", "runs_twin", "b_copied"), [
    ((4095, 1), True, True, False),  # K off 8, contiguous: the twin reads B where it lies
    ((4095, 1), False, False, True),  # no twin in the library: the point copies B
    ((4096, 1), True, False, False),  # B padded: the point reads it, no twin
    ((1, 4095), True, False, True),  # not contiguous along K: copied whichever runs
])
def test_a_skinny_point_gives_way_to_its_twin_only_where_that_saves_copying_b(
        b_strides: tuple[int, int], twin: bool, runs_twin: bool, b_copied: bool) -> None:
    a, b = op("a", (16, 4095)), op("b", (8192, 4095), b_strides)
    ran_twin, stage = gemm_staging.skinny_staging(a, b, None, has_twin=twin)
    assert (ran_twin, stage.b.copy) == (runs_twin, b_copied)
