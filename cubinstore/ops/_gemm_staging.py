"""Which operands of an ``ops.gemm`` call the kernels read where they lie, and which go through a copy.

``torch.mm(a, b.T)`` takes any bf16 problem: any M, N, K >= 1, any strides, views at any offset.
The kernels read A and B through TMA (``gemm``) or 16-byte loads (``skinny``), which need rows
of contiguous elements, a row stride that is a multiple of 8 elements (16 bytes) and a 16-byte
aligned start. An operand that lacks any of these is copied, inside the launch and on its
stream, into a fresh buffer of rows of K rounded up to 8 (``padded``); the kernel then reads the
copy. Any K is read in place: the columns past K are never read (``gemm``'s tensor maps end at
K, and TMA fills zeros past the end; ``skinny`` loads K's last 1..7 elements one by one), so a
copy's padding stays unwritten.

D is written in place when it is row-major, at any element address; otherwise into a fresh D,
copied into ``out`` after the launch. Every store of D the kernels make without TMA is one bf16
element (``gemm``'s staged and element stores, ``skinny``'s), and TMA stores only a D whose start
and rows are 16-byte aligned (``stores_by_tma``, decided per launch). (Before the eighth session
of 2026-12-06, a D with N even also had to start on 4 bytes: the element-pair stores' rule.)

A ``skinny_any`` point (``any_rows``) reads rows at any element address and any stride, so only
an operand whose elements are not contiguous along K (or whose rows overlap) is copied for it:
a contiguous operand with K off 8 is read in place.

What each layout costs is in docs/gemm.md ("Layouts that copy"). Pure Python, no torch: CPU tests
check every decision (tests/ops/test_gemm_staging.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cubinstore.ops._gemm_config import Operand

__all__ = [
    "NO_COPIES", "ROW_ELEMS", "Copies", "Feed", "Staging", "copies_of", "padded", "reads_in_place", "skinny_staging",
    "staging", "writes_in_place",
]

#: bf16 elements in 16 bytes: the row-stride multiple the kernels need.
ROW_ELEMS: Final = 8
_ALIGN_BYTES: Final = 16  # the start of a TMA tensor, and of skinny's 16-byte loads
_ELEM_BYTES: Final = 2  # a bf16 element: all skinny_any needs
_I32_MAX: Final = 2**31 - 1  # skinny takes its row strides as int32


def padded(cols: int) -> int:
    """`cols` rounded up to a multiple of 8: the row stride (in elements) of a copy the kernels can read."""
    return -(-cols // ROW_ELEMS) * ROW_ELEMS


def reads_in_place(op: Operand, rows: int, cols: int, *, any_rows: bool = False) -> bool:
    """Whether the kernels can read `op` (rows x cols, K-major) where it lies, at its address.

    Contiguous rows (any inner stride when there is one column), a row stride of at least
    `cols` and a multiple of 8 elements (any stride when there is one row: it never steps), and
    a 16-byte aligned start; with `any_rows` (a ``skinny_any`` point) any row stride of at least
    `cols` and any element address.
    """
    row_stride, col_stride = op.strides
    if cols > 1 and col_stride != 1:
        return False
    if rows > 1 and not (cols <= row_stride <= _I32_MAX and (any_rows or row_stride % ROW_ELEMS == 0)):
        return False
    return op.address % (_ELEM_BYTES if any_rows else _ALIGN_BYTES) == 0


def writes_in_place(out: Operand, m: int, n: int) -> bool:
    """Whether D is stored into `out` (M x N) directly: row-major rows of N, at any element address
    (see the module's docstring)."""
    row_stride, col_stride = out.strides
    return not ((n > 1 and col_stride != 1) or (m > 1 and row_stride != n))


@dataclass(frozen=True)
class Feed:
    """How the kernel reads one of A and B."""

    copy: bool  # through a copy made in the launch, of rows `row_stride` apart
    row_stride: int  # elements: what the tensor map (gemm) or the kernel (skinny) is given


@dataclass(frozen=True)
class Staging:
    """What one call copies before (A, B) and after (D) the launch."""

    a: Feed
    b: Feed
    copy_out: bool  # D is computed into a fresh tensor, then copied into `out`

    @property
    def copies(self) -> bool:
        return self.a.copy or self.b.copy or self.copy_out


def _feed(op: Operand, rows: int, k: int, any_rows: bool) -> Feed:
    if not reads_in_place(op, rows, k, any_rows=any_rows):
        return Feed(True, padded(k))
    # A single row's stride is never stepped over; a map still wants one of >= K and 16 bytes.
    return Feed(False, op.strides[0] if rows > 1 else padded(k))


def staging(a: Operand, b: Operand, out: Operand | None, *, any_rows: bool = False) -> Staging:
    """The copies of a call whose operands passed `check_operands` (M, N, K >= 1), for a `skinny`
    point or a `gemm` tile alike, or with `any_rows` for a `skinny_any` point."""
    (m, k), n = a.shape, b.shape[0]
    copy_out = out is not None and not writes_in_place(out, m, n)
    return Staging(_feed(a, m, k, any_rows), _feed(b, n, k, any_rows), copy_out)


def skinny_staging(a: Operand, b: Operand, out: Operand | None, *, has_twin: bool) -> tuple[bool, Staging]:
    """(whether its ``skinny_any`` twin runs instead, and the copies) for a selected ``skinny``
    point whose library has (`has_twin`) the ``skinny_any`` point of its BM and BN.

    The twin runs where the point would copy B and the twin reads B in place: copying B, the
    operand a skinny launch is bound by, costs more than the twin's slower loads.
    """
    stage = staging(a, b, out)
    if not (has_twin and stage.b.copy):
        return False, stage
    in_place = staging(a, b, out, any_rows=True)
    return (True, in_place) if not in_place.b.copy else (False, stage)


@dataclass(frozen=True)
class Copies:
    """What a launch's copies move: the selection weighs them (``_gemm_model.Model.choose``)."""

    count: int  # copy launches
    bytes: int  # read and written, together


NO_COPIES: Final = Copies(0, 0)


def copies_of(stage: Staging, m: int, n: int, k: int) -> Copies:
    """The copies of `stage` for an M x N x K problem: each operand copied is read (K a row) and
    written (rows of ``padded(K)``); D copied out is written once more and read back."""
    count = total = 0
    for copied, rows in ((stage.a.copy, m), (stage.b.copy, n)):
        if copied:
            count, total = count + 1, total + 2 * rows * (k + padded(k))
    if stage.copy_out:
        count, total = count + 1, total + 2 * 2 * m * n
    return Copies(count, total)
