"""``CUtensorMap`` values for TMA kernels: a frozen 128-byte ``TensorMap`` and tiled encoders.

A kernel parameter declared ``tensormap`` in a manifest takes any object with a
``.raw`` of exactly 128 bytes; ``TensorMap`` is that object.

``encode_tiled`` asks the driver (``cuTensorMapEncodeTiled``) for a map of a
1- to 5-dimensional tensor in global memory, read in boxes. Shapes, strides,
boxes and element strides are given **outermost first, in elements**, the way
torch's ``.shape`` and ``.stride()`` read; the encoder reverses them into the
driver's innermost-first order and turns strides into bytes. ``from_tensor``
does the same for a CUDA torch tensor, and ``encode_2d_bf16`` (the GEMM's map)
is a thin wrapper.

Every argument is checked in pure Python first (``check_tiled``), against the
rules ``cuda.h`` documents for ``cuTensorMapEncodeTiled``, so a bad argument is a
``BadArgumentError`` naming the field, testable without a GPU, rather than the
driver's bare ``CUDA_ERROR_INVALID_VALUE``.

Nothing here touches CUDA at import: ``cuda.bindings`` is imported (and the
driver initialised) on the first encode. torch is never imported: its dtypes
are recognised by their type's module and name.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError

__all__ = [
    "AddressEncoder",
    "DTYPES",
    "SWIZZLE_BYTES",
    "TENSORMAP_BYTES",
    "TensorMap",
    "TiledArgs",
    "check_tiled",
    "encode_2d_bf16",
    "encoder_2d_bf16",
    "encode_tiled",
    "from_tensor",
]

logger = get_logger(__name__)

TENSORMAP_BYTES: Final = 128
#: Swizzle widths the encoder accepts, in bytes (0 = no swizzle).
SWIZZLE_BYTES: Final = (0, 32, 64, 128)

# Driver limits (cuda.h, cuTensorMapEncodeTiled).
_MAX_RANK: Final = 5
_MAX_DIM: Final = 2**32  # each size in [1, 2**32]
_MAX_STRIDE: Final = 2**40  # byte strides below 2**40
_STRIDE_ALIGN: Final = 16  # byte strides and the base address: multiples of 16 (32 with 32B interleave)
_MAX_BOX: Final = 256
_MAX_ELEMENT_STRIDE: Final = 8
_BF16_BYTES: Final = 2


@dataclass(frozen=True)
class _Dtype:
    name: str  # the canonical name, used in messages
    enum: str  # CUtensorMapDataType member
    size: int  # bytes per element
    is_float: bool  # whether the driver sees a floating-point type (NaN fill is allowed)


# There is no signed 8- or 16-bit CUtensorMapDataType, nor an fp8 one: TMA copies
# bytes and never converts, so int8, int16 and both fp8 formats travel as UINT8 /
# UINT16 of the same width. The driver then sees an integer type, so NaN fill is
# refused for them.
_DTYPE_TABLE: Final = (
    _Dtype("bf16", "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2, True),
    _Dtype("fp16", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2, True),
    _Dtype("fp32", "CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4, True),
    _Dtype("tf32", "CU_TENSOR_MAP_DATA_TYPE_TFLOAT32", 4, True),
    _Dtype("fp64", "CU_TENSOR_MAP_DATA_TYPE_FLOAT64", 8, True),
    _Dtype("e4m3", "CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, False),
    _Dtype("e5m2", "CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, False),
    _Dtype("int8", "CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, False),
    _Dtype("uint8", "CU_TENSOR_MAP_DATA_TYPE_UINT8", 1, False),
    _Dtype("int16", "CU_TENSOR_MAP_DATA_TYPE_UINT16", 2, False),
    _Dtype("uint16", "CU_TENSOR_MAP_DATA_TYPE_UINT16", 2, False),
    _Dtype("int32", "CU_TENSOR_MAP_DATA_TYPE_INT32", 4, False),
    _Dtype("uint32", "CU_TENSOR_MAP_DATA_TYPE_UINT32", 4, False),
    _Dtype("int64", "CU_TENSOR_MAP_DATA_TYPE_INT64", 8, False),
    _Dtype("uint64", "CU_TENSOR_MAP_DATA_TYPE_UINT64", 8, False),
)
#: Canonical dtype names ``encode_tiled`` accepts (aliases and torch dtypes map onto these).
DTYPES: Final = tuple(d.name for d in _DTYPE_TABLE)
_BY_NAME: Final = {d.name: d for d in _DTYPE_TABLE}
# The manifest's spellings (f32, f64, ...) and torch's dtype names, as aliases.
_ALIASES: Final = {
    "f16": "fp16", "f32": "fp32", "f64": "fp64",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float64": "fp64", "double": "fp64",
    "fp8_e4m3": "e4m3", "float8_e4m3fn": "e4m3", "float8_e4m3fnuz": "e4m3",
    "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2", "float8_e5m2fnuz": "e5m2",
    "i8": "int8", "u8": "uint8", "short": "int16", "i32": "int32", "int": "int32", "u32": "uint32",
    "i64": "int64", "long": "int64", "u64": "uint64",
}

# name -> (bytes, driver enum member); ints are accepted as bytes too.
_SWIZZLES: Final = {
    "none": (0, "CU_TENSOR_MAP_SWIZZLE_NONE"),
    "32B": (32, "CU_TENSOR_MAP_SWIZZLE_32B"),
    "64B": (64, "CU_TENSOR_MAP_SWIZZLE_64B"),
    "128B": (128, "CU_TENSOR_MAP_SWIZZLE_128B"),
}
_L2_PROMOTIONS: Final = {
    "none": (0, "CU_TENSOR_MAP_L2_PROMOTION_NONE"),
    "64B": (64, "CU_TENSOR_MAP_L2_PROMOTION_L2_64B"),
    "128B": (128, "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"),
    "256B": (256, "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"),
}
_INTERLEAVES: Final = {
    "none": (0, "CU_TENSOR_MAP_INTERLEAVE_NONE"),
    "16B": (16, "CU_TENSOR_MAP_INTERLEAVE_16B"),
    "32B": (32, "CU_TENSOR_MAP_INTERLEAVE_32B"),
}
_OOB_FILLS: Final = {
    "none": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE",  # out-of-bounds elements read as zero
    "nan_request_zero_fma": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA",
}


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


@dataclass(frozen=True)
class TiledArgs:
    """The checked arguments of one ``cuTensorMapEncodeTiled`` call, in the driver's order.

    ``global_dim``, ``box_dim`` and ``element_strides`` are innermost first;
    ``global_strides`` are the byte strides of dimensions 1..rank-1 (dimension 0
    is dense). Enum fields hold the driver's member names.
    """

    dtype: str
    data_type: str
    rank: int
    address: int
    global_dim: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dim: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: str
    swizzle: str
    l2_promotion: str
    oob_fill: str

    def describe(self) -> str:
        """A short outermost-first summary for error messages."""
        shape = "x".join(str(d) for d in reversed(self.global_dim))
        box = "x".join(str(d) for d in reversed(self.box_dim))
        return f"{self.dtype} {shape}, box {box}, {self.swizzle.rsplit('_', 1)[-1].lower()} swizzle"


# -- validation -----------------------------------------------------------------------------------


def _int(value: object) -> int | None:
    """``value`` as an int when it is one (numpy and torch ints included), never a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _dtype(value: object) -> _Dtype:
    name: object = value
    kind = type(value)
    # A torch dtype, without importing torch: str(torch.bfloat16) == "torch.bfloat16".
    if kind.__name__ == "dtype" and kind.__module__ == "torch":
        name = str(value).removeprefix("torch.")
    if isinstance(name, str):
        key = name.lower()
        found = _BY_NAME.get(_ALIASES.get(key, key))
        if found is not None:
            return found
    raise BadArgumentError(
        f"tensor map dtype: expected one of {', '.join(DTYPES)} or a torch dtype of those, got {value!r}"
    )


def _choice(field: str, value: object, table: dict[str, tuple[int, str]]) -> tuple[str, int, str]:
    """Resolve a name ('128B', case-insensitive) or a byte count (128) to (name, bytes, enum)."""
    number = _int(value)
    for name, (size, enum) in table.items():
        if (isinstance(value, str) and value.upper() == name.upper()) or (number is not None and number == size):
            return name, size, enum
    names = ", ".join(repr(n) for n in table)
    sizes = ", ".join(str(size) for size, _ in table.values())
    raise BadArgumentError(f"tensor map {field}: expected one of {names} (or {sizes} bytes), got {value!r}")


def _ints(field: str, value: object, rank: int | None) -> list[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        want = "a sequence of ints" if rank is None else f"a sequence of {rank} ints (one per dimension of shape)"
        raise BadArgumentError(f"tensor map {field}: expected {want}, got {type(value).__name__}")
    items = list(value)
    if rank is not None and len(items) != rank:
        raise BadArgumentError(
            f"tensor map {field}: expected {rank} entries (one per dimension of shape), got {len(items)}"
        )
    return items


def _in_range(field: str, value: object, low: int, high: int) -> int:
    number = _int(value)
    if number is None or not low <= number <= high:
        raise BadArgumentError(f"tensor map {field}: expected an int in [{low}, {high}], got {value!r}")
    return number


def check_tiled(
    address: int,
    *,
    dtype: Any,
    shape: Iterable[int],
    box: Iterable[int],
    strides: Iterable[int] | None = None,
    element_strides: Iterable[int] | None = None,
    swizzle: int | str = "none",
    interleave: int | str = "none",
    l2_promotion: int | str = "256B",
    oob_fill: str = "none",
) -> TiledArgs:
    """Check the arguments of ``encode_tiled`` and return them in the driver's order.

    Pure Python: raises ``BadArgumentError`` naming the field (``shape[2]``,
    ``box[1]``, ...; indices are the caller's, outermost first) for anything
    the driver would refuse.
    """
    kind = _dtype(dtype)
    il_name, il_bytes, il_enum = _choice("interleave", interleave, _INTERLEAVES)
    sw_name, sw_bytes, sw_enum = _choice("swizzle", swizzle, _SWIZZLES)
    l2_name, _, l2_enum = _choice("l2_promotion", l2_promotion, _L2_PROMOTIONS)
    fill = oob_fill.lower() if isinstance(oob_fill, str) else None
    if fill not in _OOB_FILLS:
        names = ", ".join(repr(n) for n in _OOB_FILLS)
        raise BadArgumentError(f"tensor map oob_fill: expected one of {names}, got {oob_fill!r}")
    if fill != "none" and not kind.is_float:
        raise BadArgumentError(
            f"tensor map oob_fill: expected 'none' for {kind.name} (encoded as "
            f"{kind.enum.removeprefix('CU_TENSOR_MAP_DATA_TYPE_')}, not a float type), got {oob_fill!r}"
        )
    if il_name == "32B" and sw_name != "32B":
        raise BadArgumentError(f"tensor map swizzle: expected '32B' with interleave '32B', got {sw_name!r}")

    dims = _ints("shape", shape, None)
    min_rank = 1 if il_name == "none" else 3  # interleaved layouts need rank >= 3
    if not min_rank <= len(dims) <= _MAX_RANK:
        with_il = "" if il_name == "none" else f" with interleave {il_name!r}"
        raise BadArgumentError(
            f"tensor map shape: expected {min_rank} to {_MAX_RANK} dimensions{with_il}, got {len(dims)}"
        )
    rank = len(dims)
    sizes = [_in_range(f"shape[{i}]", d, 1, _MAX_DIM) for i, d in enumerate(dims)]

    align = 32 if il_name == "32B" else _STRIDE_ALIGN
    addr = _int(address)
    if addr is None or not 0 < addr < 2**64:
        raise BadArgumentError(f"tensor map address: expected a device pointer (an int in [1, 2**64)), got {address!r}")
    if addr % align:
        raise BadArgumentError(f"tensor map address: expected a multiple of {align} bytes, got 0x{addr:x}")

    inner = rank - 1  # the caller's index of the innermost dimension
    if strides is None:
        elem_strides_out = [1] * rank  # dense, row-major
        for i in range(inner - 1, -1, -1):
            elem_strides_out[i] = elem_strides_out[i + 1] * sizes[i + 1]
        raw_strides: list[object] = list(elem_strides_out)
    else:
        raw_strides = _ints("strides", strides, rank)
    if _int(raw_strides[inner]) != 1:
        raise BadArgumentError(
            f"tensor map strides[{inner}]: expected 1 (the innermost dimension must be dense), "
            f"got {raw_strides[inner]!r}"
        )
    byte_strides = []
    for i in range(inner):
        number = _int(raw_strides[i])
        if number is None or number < 1:
            raise BadArgumentError(
                f"tensor map strides[{i}]: expected a positive int (elements), got {raw_strides[i]!r}"
            )
        nbytes = number * kind.size
        if nbytes % align or nbytes >= _MAX_STRIDE:
            raise BadArgumentError(
                f"tensor map strides[{i}]: expected a multiple of {align} bytes below 2**40, "
                f"got {number} elements ({nbytes} bytes of {kind.name})"
            )
        byte_strides.append(nbytes)

    boxes = [_in_range(f"box[{i}]", b, 1, _MAX_BOX) for i, b in enumerate(_ints("box", box, rank))]
    inner_bytes = boxes[inner] * kind.size
    # Both rules hold only without interleave; an interleaved layout fixes the inner chunk itself.
    if il_name == "none" and inner_bytes % 16:
        raise BadArgumentError(
            f"tensor map box[{inner}]: expected the innermost box edge to be a multiple of 16 bytes, "
            f"got {boxes[inner]} {kind.name} elements ({inner_bytes} bytes)"
        )
    if il_name == "none" and sw_bytes and inner_bytes > sw_bytes:
        raise BadArgumentError(
            f"tensor map box[{inner}]: expected at most {sw_bytes} bytes (the {sw_name} swizzle span) in the "
            f"innermost box edge, got {boxes[inner]} {kind.name} elements ({inner_bytes} bytes)"
        )

    if element_strides is None:
        steps = [1] * rank
    else:
        steps = [
            _in_range(f"element_strides[{i}]", s, 1, _MAX_ELEMENT_STRIDE)
            for i, s in enumerate(_ints("element_strides", element_strides, rank))
        ]

    return TiledArgs(
        dtype=kind.name,
        data_type=kind.enum,
        rank=rank,
        address=addr,
        global_dim=tuple(reversed(sizes)),
        global_strides=tuple(reversed(byte_strides)),
        box_dim=tuple(reversed(boxes)),
        element_strides=tuple(reversed(steps)),
        interleave=il_enum,
        swizzle=sw_enum,
        l2_promotion=l2_enum,
        oob_fill=_OOB_FILLS[fill],
    )


# -- encoding -------------------------------------------------------------------------------------


def _encode(args: TiledArgs, device: int | None) -> TensorMap:
    return AddressEncoder(args, device).encode(args.address)


class AddressEncoder:
    """``cuTensorMapEncodeTiled`` of checked ``TiledArgs`` at any address: the driver's arguments built once.

    A map holds nothing but these arguments, so one encoder gives the maps of every tensor
    of one shape, strides and box; ``encode`` checks only what changes, the address.
    """

    def __init__(self, args: TiledArgs, device: int | None = None) -> None:
        from cubinstore._driver import cuda as _cuda

        drv = _cuda.driver()
        self.args = args
        self._device = device
        self._align = 32 if args.interleave == "CU_TENSOR_MAP_INTERLEAVE_32B" else _STRIDE_ALIGN
        strides = list(args.global_strides)
        if not strides:
            # Rank 1 has no strides, but cuda.bindings turns an empty list into NULL; hand
            # the driver one (unread) entry, as C callers of a 1-D map do.
            strides = [-(-args.global_dim[0] * _BY_NAME[args.dtype].size // 16) * 16]
        self._head = (getattr(drv.CUtensorMapDataType, args.data_type), args.rank)
        self._tail = (
            # cuda.bindings takes its own fixed-width integer wrappers here, not ints.
            [drv.cuuint64_t(d) for d in args.global_dim],
            [drv.cuuint64_t(s) for s in strides],
            [drv.cuuint32_t(b) for b in args.box_dim],
            [drv.cuuint32_t(e) for e in args.element_strides],
            getattr(drv.CUtensorMapInterleave, args.interleave),
            getattr(drv.CUtensorMapSwizzle, args.swizzle),
            getattr(drv.CUtensorMapL2promotion, args.l2_promotion),
            getattr(drv.CUtensorMapFloatOOBfill, args.oob_fill),
        )
        self._encode_tiled = drv.cuTensorMapEncodeTiled
        self._success = drv.CUresult.CUDA_SUCCESS

    def encode(self, address: int) -> TensorMap:
        """The map of the tensor at device ``address``; ``BadArgumentError`` for a bad address."""
        if isinstance(address, bool) or not isinstance(address, int) or not 0 < address < 2**64:
            raise BadArgumentError(f"tensor map address: expected a device pointer (an int in [1, 2**64)), got {address!r}")
        if address % self._align:
            raise BadArgumentError(f"tensor map address: expected a multiple of {self._align} bytes, got 0x{address:x}")
        result = self._encode_tiled(*self._head, address, *self._tail)
        if result[0] != self._success:
            from cubinstore._driver import cuda as _cuda

            where = "" if self._device is None else f" on device {self._device}"
            _cuda.check(result, f"cuTensorMapEncodeTiled({self.args.describe()}) at 0x{address:x}{where}")
        return TensorMap(struct.pack("<16Q", *(int(word) for word in result[1].opaque)))


def encode_tiled(
    address: int,
    *,
    dtype: Any,
    shape: Iterable[int],
    box: Iterable[int],
    strides: Iterable[int] | None = None,
    element_strides: Iterable[int] | None = None,
    swizzle: int | str = "none",
    interleave: int | str = "none",
    l2_promotion: int | str = "256B",
    oob_fill: str = "none",
    device: int | None = None,
) -> TensorMap:
    """Tensor map of a tensor at device ``address``, read in boxes of ``box`` elements.

    All sequences are outermost first, like torch's ``.shape``/``.stride()``:

    - ``dtype``: one of ``DTYPES`` (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"e4m3"``,
      ``"e5m2"``, ``"int8"``, ...; also ``"f32"``-style and torch names) or a torch
      dtype. fp8 and int8 are encoded as UINT8, int16 as UINT16: the driver has
      no such types, and TMA copies bytes without converting them.
    - ``shape``: 1 to 5 sizes, each in [1, 2**32].
    - ``strides``: in elements; the innermost must be 1, the others multiples of
      16 bytes below 2**40. Default: dense row-major.
    - ``box``: edges in [1, 256]; the innermost spans a multiple of 16 bytes and
      at most the swizzle span.
    - ``element_strides``: in [1, 8], default 1 (the innermost one is ignored by
      TMA without interleave).
    - ``swizzle``: ``"none"``, ``"32B"``, ``"64B"``, ``"128B"`` (or 0/32/64/128).
    - ``interleave``: ``"none"`` (default), ``"16B"``, ``"32B"`` (rank >= 3; 32B
      needs a 32-byte aligned address and strides and a 32B swizzle).
    - ``l2_promotion``: ``"none"``, ``"64B"``, ``"128B"``, ``"256B"`` (default).
    - ``oob_fill``: ``"none"`` (reads outside the tensor give zeros) or
      ``"nan_request_zero_fma"`` (float types only).

    Encoding needs a driver but no context, so ``device`` is only named in errors.
    """
    args = check_tiled(
        address, dtype=dtype, shape=shape, box=box, strides=strides, element_strides=element_strides,
        swizzle=swizzle, interleave=interleave, l2_promotion=l2_promotion, oob_fill=oob_fill,
    )
    return _encode(args, device)


def from_tensor(tensor: Any, box: Iterable[int], *, swizzle: int | str = "none", **options: Any) -> TensorMap:
    """Tensor map of a CUDA torch tensor: its ``data_ptr()``, ``shape``, ``stride()`` and ``dtype``.

    ``options`` are ``encode_tiled``'s (``element_strides``, ``l2_promotion``,
    ``oob_fill``, ``interleave``). The map holds the address, not the tensor:
    keep the tensor alive while a kernel uses the map.
    """
    for attr in ("data_ptr", "shape", "stride", "dtype", "device"):
        if not hasattr(tensor, attr):
            raise BadArgumentError(f"tensor map tensor: expected a torch tensor, got {type(tensor).__name__}")
    if getattr(tensor.device, "type", None) != "cuda":
        raise BadArgumentError(f"tensor map tensor: expected a CUDA tensor, got one on {tensor.device}")
    shape = [int(d) for d in tensor.shape]
    strides = [int(s) for s in tensor.stride()]
    kind = _dtype(tensor.dtype)
    # A size-1 dimension is only ever indexed at 0, so its stride never reaches an
    # address; torch leaves arbitrary values there (views, transposes), which the
    # driver's stride rules would refuse. Give such dimensions a stride that passes.
    for i, size in enumerate(shape):
        if size != 1:
            continue
        if i == len(shape) - 1:
            strides[i] = 1
        elif (strides[i] * kind.size) % _STRIDE_ALIGN or strides[i] < 1:
            strides[i] = _STRIDE_ALIGN // kind.size
    return encode_tiled(
        int(tensor.data_ptr()), dtype=tensor.dtype, shape=shape, strides=strides, box=box, swizzle=swizzle,
        device=getattr(tensor.device, "index", None), **options,
    )


# -- the GEMM's 2-D bf16 map ----------------------------------------------------------------------


def _check_positive(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise BadArgumentError(f"tensor map {name}: expected an int in [1, {limit}], got {value!r}")
    return value


def check_2d_bf16(
    address: int, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int, swizzle: int
) -> None:
    """Validate what ``encode_2d_bf16`` would send to the driver; raises ``BadArgumentError``.

    Pure Python, so argument errors are caught (and testable) without a GPU.
    Stricter than ``check_tiled`` in one way: rows may not overlap
    (``row_stride >= cols``), since the GEMM reads every row as its own.
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
    l2_promotion: int | str = "256B",
) -> TensorMap:
    """Tensor map of a row-major ``rows x cols`` bf16 matrix at device ``address``.

    ``row_stride`` is in elements. Boxes are ``box_rows x box_cols``; reads
    outside the matrix are filled with zeros (``oob_fill="none"``), which is what
    lets a GEMM run on shapes that are not multiples of its tile. L2 promotion
    is 256 bytes unless ``l2_promotion`` says otherwise. The same map as
    ``encode_tiled`` with those arguments.
    """
    return encoder_2d_bf16(address, rows, cols, row_stride, box_rows, box_cols, swizzle=swizzle,
                           device=device, l2_promotion=l2_promotion).encode(address)


def encoder_2d_bf16(
    address: int,
    rows: int,
    cols: int,
    row_stride: int,
    box_rows: int,
    box_cols: int,
    *,
    swizzle: int = 128,
    device: int | None = None,
    l2_promotion: int | str = "256B",
) -> AddressEncoder:
    """The encoder of ``encode_2d_bf16``'s maps for this shape, stride and box, checked at ``address``."""
    check_2d_bf16(address, rows, cols, row_stride, box_rows, box_cols, swizzle)
    args = check_tiled(
        address, dtype="bf16", shape=(rows, cols), strides=(row_stride, 1), box=(box_rows, box_cols),
        swizzle=swizzle, l2_promotion=l2_promotion, oob_fill="none",
    )
    return AddressEncoder(args, device)
