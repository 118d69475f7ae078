"""The general tensor-map encoder against the real driver (compute capability 9.0+).

Maps are encoded over a real ``cuMemAlloc`` buffer. The driver must accept every
dtype at every rank and every option ``check_tiled`` lets through; it must refuse
each documented case ``check_tiled`` refuses (called raw, bypassing our checks),
so the pure-Python rules are neither looser nor invented; and the GEMM's
``encode_2d_bf16`` must give the bytes of the direct driver call it replaced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import cuda as _cuda, device
from cubinstore.tensormap import DTYPES, TENSORMAP_BYTES, check_tiled, encode_2d_bf16, encode_tiled, from_tensor

pytestmark = pytest.mark.gpu

BUFFER_BYTES = 8 << 20  # every map below describes memory inside it
# Outermost first; rank r uses the last r sizes. 3*5*7*9*64 fp64 elements fit in the buffer.
FULL_SHAPE = (3, 5, 7, 9, 64)
SIZES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "e4m3": 1, "e5m2": 1, "int8": 1, "uint8": 1,
         "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}


@pytest.fixture(scope="module")
def buffer() -> Iterator[int]:
    """A real device allocation (256-byte aligned) on device 0."""
    ok, why = _cuda.available()
    if not ok:
        pytest.skip(why)
    if device.compute_capability(0) < (9, 0):
        pytest.skip(f"tensor maps need compute capability 9.0+, device 0 is {device.compute_capability(0)}")
    drv = _cuda.driver()
    with _cuda.on_device(0):
        ptr = _cuda.check(drv.cuMemAlloc(BUFFER_BYTES), "cuMemAlloc for the tensor map tests")
    yield int(ptr)
    with _cuda.on_device(0):
        _cuda.check(drv.cuMemFree(ptr), "cuMemFree")


def test_the_dtype_table_here_covers_every_encoder_dtype() -> None:
    assert set(SIZES) == set(DTYPES)


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_driver_accepts_every_dtype_at_every_rank(buffer: int, dtype: str, rank: int) -> None:
    shape = FULL_SHAPE[len(FULL_SHAPE) - rank:]
    size = SIZES[dtype]
    swizzle = "none" if rank == 1 else "128B"
    inner = min(shape[-1], 128 // size)  # 128 bytes at most: the 128B swizzle span
    box = tuple(min(d, 4) for d in shape[:-1]) + (inner,)
    first = encode_tiled(buffer, dtype=dtype, shape=shape, box=box, swizzle=swizzle, device=0)
    again = encode_tiled(buffer, dtype=dtype, shape=shape, box=box, swizzle=swizzle, device=0)
    assert len(first.raw) == TENSORMAP_BYTES and first.raw != bytes(TENSORMAP_BYTES)
    assert first.raw == again.raw  # a map is a function of its arguments: the GEMM caches them by key


def test_each_swizzle_and_fill_gives_its_own_map_and_every_l2_promotion_is_accepted(buffer: int) -> None:
    maps = {}
    for swizzle, inner in (("none", 64), ("32B", 16), ("64B", 32), ("128B", 64)):
        for fill in ("none", "nan_request_zero_fma"):
            maps[(swizzle, fill)] = encode_tiled(buffer, dtype="bf16", shape=(256, 64), box=(32, inner),
                                                 swizzle=swizzle, oob_fill=fill, device=0).raw
    assert len(set(maps.values())) == len(maps)
    for promotion in ("none", "64B", "128B", "256B"):
        tmap = encode_tiled(buffer, dtype="fp32", shape=(256, 64), box=(32, 32), swizzle="128B",
                            l2_promotion=promotion, device=0)
        assert len(tmap.raw) == TENSORMAP_BYTES


def test_driver_accepts_padded_strides_and_element_strides(buffer: int) -> None:
    # A (16, 64, 100) bf16 view of a (16, 64, 128) buffer, every other row and plane.
    tmap = encode_tiled(buffer, dtype="bf16", shape=(16, 64, 100), strides=(64 * 128, 128, 1), box=(4, 32, 64),
                        element_strides=(2, 2, 1), swizzle="128B", device=0)
    assert len(tmap.raw) == TENSORMAP_BYTES


def test_driver_accepts_interleaved_layouts(buffer: int) -> None:
    # NC/8HWC8-style fp16: the innermost 8 channels are one 16-byte chunk; C16 is 32 bytes.
    tmap16 = encode_tiled(buffer, dtype="fp16", shape=(2, 32, 8), box=(1, 32, 8), interleave="16B", device=0)
    tmap32 = encode_tiled(buffer, dtype="fp16", shape=(2, 32, 16), box=(1, 32, 16), interleave="32B",
                          swizzle="32B", device=0)
    assert tmap16.raw != tmap32.raw


# The old encode_2d_bf16, a direct driver call, kept here as the reference the wrapper must match.
def _reference_2d_bf16(address: int, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int,
                       swizzle: int) -> bytes:
    import struct

    drv = _cuda.driver()
    swizzle_enum = {0: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                    32: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
                    64: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
                    128: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
    tmap = _cuda.check(drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, address,
        [drv.cuuint64_t(cols), drv.cuuint64_t(rows)], [drv.cuuint64_t(row_stride * 2)],
        [drv.cuuint32_t(box_cols), drv.cuuint32_t(box_rows)], [drv.cuuint32_t(1), drv.cuuint32_t(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_enum,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    ), "reference cuTensorMapEncodeTiled")
    return struct.pack("<16Q", *(int(word) for word in tmap.opaque))


@pytest.mark.parametrize(("rows", "cols", "row_stride", "box_rows", "box_cols", "swizzle"), [
    (1024, 4096, 4096, 128, 64, 128),
    (1000, 1000, 1008, 64, 64, 128),
    (7, 8, 8, 64, 8, 0),
    (300, 520, 520, 256, 32, 64),
    (129, 72, 80, 128, 16, 32),
])
def test_bf16_wrapper_matches_the_direct_driver_call_and_the_general_encoder(
    buffer: int, rows: int, cols: int, row_stride: int, box_rows: int, box_cols: int, swizzle: int
) -> None:
    reference = _reference_2d_bf16(buffer, rows, cols, row_stride, box_rows, box_cols, swizzle)
    wrapped = encode_2d_bf16(buffer, rows, cols, row_stride, box_rows, box_cols, swizzle=swizzle, device=0)
    general = encode_tiled(buffer, dtype="bf16", shape=(rows, cols), strides=(row_stride, 1),
                           box=(box_rows, box_cols), swizzle=swizzle, l2_promotion="256B", oob_fill="none")
    assert wrapped.raw == reference
    assert general.raw == reference


# -- the driver refuses what check_tiled refuses ---------------------------------------------------

# A valid raw call, innermost first: bf16 (64 rows x 128 cols), 32x64 boxes, 128B swizzle.
_RAW_OK: dict[str, Any] = {"data_type": "BFLOAT16", "rank": 2, "offset": 0, "dims": [128, 64], "strides": [256],
                           "box": [64, 32], "elems": [1, 1], "interleave": "NONE", "swizzle": "128B",
                           "fill": "NONE"}
_REFUSED = [
    ("address not 16-byte aligned", {"offset": 8}, {"address_offset": 8}),
    ("size 0", {"dims": [128, 0]}, {"shape": (0, 128)}),
    ("size above 2**32", {"dims": [128, 2**32 + 1]}, {"shape": (2**32 + 1, 128)}),
    ("stride not a multiple of 16 bytes", {"strides": [264]}, {"strides": (132, 1)}),
    ("stride of 2**40 bytes", {"strides": [2**40]}, {"strides": (2**39, 1)}),
    ("box edge 257", {"box": [64, 257]}, {"box": (257, 64)}),
    ("box edge 0", {"box": [64, 0]}, {"box": (0, 64)}),
    ("inner box of 8 bytes", {"box": [4, 32], "swizzle": "NONE"}, {"box": (32, 4), "swizzle": "none"}),
    ("inner box wider than the swizzle", {"box": [128, 32]}, {"box": (32, 128)}),
    ("element stride 9", {"elems": [1, 9]}, {"element_strides": (9, 1)}),
    ("rank 6", {"rank": 6, "dims": [128, 64, 1, 1, 1, 1], "strides": [256] * 5, "box": [64, 32, 1, 1, 1, 1],
                "elems": [1] * 6}, {"shape": (1, 1, 1, 1, 64, 128), "box": (1, 1, 1, 1, 32, 64)}),
    ("NaN fill of an integer type", {"data_type": "UINT8", "dims": [256, 64], "box": [128, 32], "fill": "NAN"},
     {"dtype": "uint8", "shape": (64, 256), "box": (32, 128), "oob_fill": "nan_request_zero_fma"}),
    ("interleave with rank 2", {"interleave": "16B", "swizzle": "NONE", "box": [8, 32]},
     {"interleave": "16B", "swizzle": "none", "box": (32, 8)}),
]


def _raw_encode(buffer: int, call: dict[str, Any]) -> object:
    """The driver's answer to a raw cuTensorMapEncodeTiled call: a CUresult, or what cuda.bindings raised."""
    drv = _cuda.driver()
    fill = {"NONE": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "NAN": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA"}
    swizzle = "CU_TENSOR_MAP_SWIZZLE_" + call["swizzle"]
    try:
        err, _ = drv.cuTensorMapEncodeTiled(
            getattr(drv.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + call["data_type"]), call["rank"],
            buffer + call["offset"], [drv.cuuint64_t(d) for d in call["dims"]],
            [drv.cuuint64_t(s) for s in call["strides"]], [drv.cuuint32_t(b) for b in call["box"]],
            [drv.cuuint32_t(e) for e in call["elems"]],
            getattr(drv.CUtensorMapInterleave, "CU_TENSOR_MAP_INTERLEAVE_" + call["interleave"]),
            getattr(drv.CUtensorMapSwizzle, swizzle), drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            getattr(drv.CUtensorMapFloatOOBfill, fill[call["fill"]]),
        )
    except Exception as exc:  # cuda.bindings may refuse an argument itself; that is a refusal too
        return exc
    return err


def test_the_raw_baseline_call_is_accepted(buffer: int) -> None:
    assert _raw_encode(buffer, _RAW_OK) == _cuda.driver().CUresult.CUDA_SUCCESS


@pytest.mark.parametrize(("raw_change", "ours"), [pytest.param(raw, ours, id=why) for why, raw, ours in _REFUSED])
def test_driver_refuses_each_case_that_check_tiled_refuses(buffer: int, raw_change: dict[str, Any],
                                                           ours: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"dtype": "bf16", "shape": (64, 128), "box": (32, 64), "swizzle": "128B"} | ours
    address = buffer + kwargs.pop("address_offset", 0)
    with pytest.raises(BadArgumentError, match=r"^tensor map "):
        check_tiled(address, **kwargs)
    assert _raw_encode(buffer, _RAW_OK | raw_change) != _cuda.driver().CUresult.CUDA_SUCCESS


# -- torch tensors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch(buffer: int) -> Any:
    return pytest.importorskip("torch", reason="from_tensor reads torch tensors")


def test_from_tensor_equals_encode_tiled_over_the_same_fields(torch: Any) -> None:
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.float8_e4m3fn, torch.float8_e5m2]
    for dtype in dtypes:
        t = torch.zeros(8, 64, 128, dtype=torch.uint8, device="cuda:0").view(dtype)  # fp8 has no zeros() kernel
        inner = 128 // t.element_size()
        box = (2, 32, inner)
        got = from_tensor(t, box, swizzle="128B")
        want = encode_tiled(t.data_ptr(), dtype=dtype, shape=tuple(t.shape), strides=t.stride(), box=box,
                            swizzle="128B")
        assert got.raw == want.raw, dtype


def test_from_tensor_reads_a_padded_view(torch: Any) -> None:
    base = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda:0")
    view = base[:, :100]
    got = from_tensor(view, (32, 64), swizzle="128B")
    want = encode_tiled(base.data_ptr(), dtype="bf16", shape=(64, 100), strides=(128, 1), box=(32, 64),
                        swizzle="128B")
    assert got.raw == want.raw


def test_from_tensor_ignores_the_stride_of_a_size_1_dimension(torch: Any) -> None:
    # torch leaves any stride on a size-1 dimension; 3 elements (6 bytes) would break the 16-byte rule.
    t = torch.zeros(4096, dtype=torch.bfloat16, device="cuda:0").as_strided((1, 64), (3, 1))
    with pytest.raises(BadArgumentError, match=r"^tensor map strides\[0\]: expected a multiple of 16 bytes"):
        encode_tiled(t.data_ptr(), dtype=t.dtype, shape=t.shape, strides=t.stride(), box=(1, 64))
    assert len(from_tensor(t, (1, 64)).raw) == TENSORMAP_BYTES


def test_from_tensor_refuses_a_tensor_that_is_not_dense_inside(torch: Any) -> None:
    t = torch.zeros(64, 64, dtype=torch.float32, device="cuda:0").t()
    with pytest.raises(BadArgumentError, match=r"^tensor map strides\[1\]: expected 1 \(the innermost dimension"):
        from_tensor(t, (32, 32))
