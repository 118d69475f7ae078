"""``CUtensorMap`` values for TMA kernels: a frozen 128-byte ``TensorMap`` and a 2D bf16 encoder.

A kernel parameter declared ``tensormap`` in a manifest takes any object with a
``.raw`` of exactly 128 bytes; ``TensorMap`` is that object. ``encode_2d_bf16``
asks the driver (``cuTensorMapEncodeTiled``) to describe a row-major bf16
matrix in global memory as boxes of ``box_rows x box_cols`` elements.

Nothing here touches CUDA at import: ``cuda.bindings`` is imported (and the
driver initialised) on the first ``encode_2d_bf16`` call.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Final

from cubinstore.errors import BadArgumentError

__all__ = ["SWIZZLE_BYTES", "TENSORMAP_BYTES", "TensorMap", "encode_2d_bf16"]

logger = logging.getLogger(__name__)

TENSORMAP_BYTES: Final = 128
#: Swizzle widths the encoder accepts, in bytes (0 = no swizzle).
SWIZZLE_BYTES: Final = (0, 32, 64, 128)
_BF16_BYTES: Final = 2
# Driver limits (cuTensorMapEncodeTiled): box edges 1..256, dims < 2**32, strides
# multiples of 16 bytes below 2**40, the base 16-byte aligned.
_MAX_BOX: Final = 256
_MAX_DIM: Final = 2**32
_MAX_STRIDE: Final = 2**40


@dataclass(frozen=True)
class TensorMap:
    """An encoded ``CUtensorMap``: 128 opaque bytes, passed to a kernel by value."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != TENSORMAP_BYTES:
            size = len(self.raw) if isinstance(self.raw, (bytes, bytearray, memoryview)) else None
            raise BadArgumentError(
                f"TensorMap.raw: expected {TENSORMAP_BYTES} bytes, got "
                f"{type(self.raw).__name__}" + ("" if size is None else f" of {size} bytes")
            )

    def __repr__(self) -> str:
        return f"TensorMap({self.raw[:8].hex()}...)"


def _check_positive(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise BadArgumentError(f"tensor map {name}: expected an int in [1, {limit}], got {value!r}")
    return value


def check_2d_bf16(
    address: int, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int, swizzle: int
) -> None:
    """Validate what ``encode_2d_bf16`` would send to the driver; raises ``BadArgumentError``.

    Pure Python, so argument errors are caught (and testable) without a GPU.
    """
    if isinstance(address, bool) or not isinstance(address, int) or not 0 < address < 2**64:
        raise BadArgumentError(f"tensor map address: expected a device pointer, got {address!r}")
    if address % 16:
        raise BadArgumentError(f"tensor map address 0x{address:x}: expected 16-byte alignment")
    _check_positive("rows", rows, _MAX_DIM)
    _check_positive("cols", cols, _MAX_DIM)
    _check_positive("box_rows", box_rows, _MAX_BOX)
    _check_positive("box_cols", box_cols, _MAX_BOX)
    if isinstance(row_stride, bool) or not isinstance(row_stride, int) or row_stride < cols:
        raise BadArgumentError(
            f"tensor map row_stride: expected an int >= cols ({cols}) elements, got {row_stride!r}"
        )
    if (row_stride * _BF16_BYTES) % 16 or row_stride * _BF16_BYTES >= _MAX_STRIDE:
        raise BadArgumentError(
            f"tensor map row_stride {row_stride} elements ({row_stride * _BF16_BYTES} bytes): "
            f"expected a multiple of 16 bytes below 2**40"
        )
    if swizzle not in SWIZZLE_BYTES:
        raise BadArgumentError(f"tensor map swizzle: expected one of {SWIZZLE_BYTES} bytes, got {swizzle!r}")
    if swizzle and box_cols * _BF16_BYTES > swizzle:
        raise BadArgumentError(
            f"tensor map box_cols {box_cols} ({box_cols * _BF16_BYTES} bytes): a {swizzle}-byte swizzle "
            f"needs the inner box edge to be at most {swizzle} bytes"
        )
    if (box_cols * _BF16_BYTES) % 16:
        raise BadArgumentError(
            f"tensor map box_cols {box_cols}: expected a multiple of 8 bf16 elements (16 bytes)"
        )


def encode_2d_bf16(
    address: int,
    rows: int,
    cols: int,
    row_stride: int,
    box_rows: int,
    box_cols: int,
    *,
    swizzle: int = 128,
    device: int | None = None,
) -> TensorMap:
    """Tensor map of a row-major ``rows x cols`` bf16 matrix at device ``address``.

    ``row_stride`` is in elements. Boxes are ``box_rows x box_cols``; reads
    outside the matrix are filled with zeros (``OOB_FILL_NONE``), which is what
    lets a GEMM run on shapes that are not multiples of its tile. L2 promotion
    is 256 bytes. Encoding needs a driver but no context, so ``device`` is
    accepted only to be named in errors.
    """
    check_2d_bf16(address, rows, cols, row_stride, box_rows, box_cols, swizzle)
    from cubinstore import _cuda

    drv = _cuda.driver()
    swizzle_enum = {
        0: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        32: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
        64: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        128: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
    }[swizzle]
    where = "" if device is None else f" on device {device}"
    tmap = _cuda.check(
        drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            address,
            # cuda.bindings takes its own fixed-width integer wrappers here, not ints.
            [drv.cuuint64_t(cols), drv.cuuint64_t(rows)],  # innermost dimension first
            [drv.cuuint64_t(row_stride * _BF16_BYTES)],  # stride of dimension 1; dimension 0 is dense
            [drv.cuuint32_t(box_cols), drv.cuuint32_t(box_rows)],
            [drv.cuuint32_t(1), drv.cuuint32_t(1)],
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle_enum,
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        f"cuTensorMapEncodeTiled(bf16 {rows}x{cols}, row stride {row_stride}, box {box_rows}x{box_cols}, "
        f"swizzle {swizzle}B) at 0x{address:x}{where}",
    )
    raw = struct.pack("<16Q", *(int(word) for word in tmap.opaque))
    return TensorMap(raw)
