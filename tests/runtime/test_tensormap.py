"""The general tensor-map encoder without a GPU: every validation rule, the driver's argument order.

Each rule of ``cuTensorMapEncodeTiled`` (cuda.h) that ``check_tiled`` mirrors has
one accepted and one refused case. Refused cases go through ``encode_tiled``
itself: the error must come before the driver is touched, so they pass on a
machine with no driver at all.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from cubinstore.errors import BadArgumentError, CudaError
from cubinstore.internals import cuda as _cuda
from cubinstore.tensormap import DTYPES, check_tiled, encode_tiled, from_tensor

# A 3-D bf16 tensor (4, 64, 128), dense, read in 1x32x64 boxes with a 128-byte swizzle.
BASE: dict[str, Any] = {"address": 0x10000, "dtype": "bf16", "shape": (4, 64, 128), "box": (1, 32, 64),
                        "swizzle": "128B"}
# The same tensor, laid out for a 32-byte interleave (which needs a 32-byte swizzle).
INTERLEAVED: dict[str, Any] = BASE | {"interleave": "32B", "swizzle": "32B", "box": (1, 32, 16)}


def _args(base: dict[str, Any], changes: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    kwargs = base | changes
    return kwargs.pop("address"), kwargs


# (rule, changes that pass, changes that fail, the error's start)
RULES = [
    ("address is a pointer", {"address": 0x7F00_0000_0000}, {"address": 0},
     r"tensor map address: expected a device pointer \(an int in \[1, 2\*\*64\)\), got 0$"),
    ("address is not a bool", {"address": 16}, {"address": True},
     r"tensor map address: expected a device pointer \(an int in \[1, 2\*\*64\)\), got True$"),
    ("address is 16-byte aligned", {"address": 0x10010}, {"address": 0x10008},
     r"tensor map address: expected a multiple of 16 bytes, got 0x10008$"),
    ("rank at most 5", {"shape": (2, 2, 2, 4, 128), "box": (1, 1, 1, 2, 64)},
     {"shape": (2, 2, 2, 2, 4, 128), "box": (1, 1, 1, 1, 2, 64)},
     r"tensor map shape: expected 1 to 5 dimensions, got 6$"),
    ("rank at least 1", {"shape": (128,), "box": (64,)}, {"shape": (), "box": ()},
     r"tensor map shape: expected 1 to 5 dimensions, got 0$"),
    ("shape is a sequence", {"shape": [4, 64, 128]}, {"shape": 128},
     r"tensor map shape: expected a sequence of ints, got int$"),
    ("size at least 1", {"shape": (1, 64, 128)}, {"shape": (4, 0, 128)},
     r"tensor map shape\[1\]: expected an int in \[1, 4294967296\], got 0$"),
    ("size at most 2**32", {"shape": (2**32, 1, 128), "strides": (128, 128, 1)},
     {"shape": (2**32 + 1, 1, 128), "strides": (128, 128, 1)},
     r"tensor map shape\[0\]: expected an int in \[1, 4294967296\], got 4294967297$"),
    ("size is an int", {"shape": (4, 64, 128)}, {"shape": (4, 64.0, 128)},
     r"tensor map shape\[1\]: expected an int in \[1, 4294967296\], got 64.0$"),
    ("innermost stride is 1", {"strides": (8192, 128, 1)}, {"strides": (8192, 128, 2)},
     r"tensor map strides\[2\]: expected 1 \(the innermost dimension must be dense\), got 2$"),
    ("strides are multiples of 16 bytes", {"strides": (64 * 136, 136, 1)}, {"strides": (64 * 132, 132, 1)},
     r"tensor map strides\[1\]: expected a multiple of 16 bytes below 2\*\*40, got 132 elements "
     r"\(264 bytes of bf16\)$"),
    ("strides below 2**40 bytes", {"strides": (2**39 - 8, 128, 1)}, {"strides": (2**39, 128, 1)},
     r"tensor map strides\[0\]: expected a multiple of 16 bytes below 2\*\*40, got 549755813888 elements "
     r"\(1099511627776 bytes of bf16\)$"),
    ("strides are positive", {"strides": (8, 128, 1)}, {"strides": (0, 128, 1)},
     r"tensor map strides\[0\]: expected a positive int \(elements\), got 0$"),
    ("strides have one entry per dimension", {"strides": (8192, 128, 1)}, {"strides": (128, 1)},
     r"tensor map strides: expected 3 entries \(one per dimension of shape\), got 2$"),
    ("box edges at most 256", {"box": (256, 32, 64)}, {"box": (257, 32, 64)},
     r"tensor map box\[0\]: expected an int in \[1, 256\], got 257$"),
    ("box edges at least 1", {"box": (1, 1, 64)}, {"box": (1, 0, 64)},
     r"tensor map box\[1\]: expected an int in \[1, 256\], got 0$"),
    ("box has one entry per dimension", {"box": (1, 32, 64)}, {"box": (32, 64)},
     r"tensor map box: expected 3 entries \(one per dimension of shape\), got 2$"),
    ("inner box spans a multiple of 16 bytes", {"box": (1, 32, 8), "swizzle": "none"},
     {"box": (1, 32, 4), "swizzle": "none"},
     r"tensor map box\[2\]: expected the innermost box edge to be a multiple of 16 bytes, "
     r"got 4 bf16 elements \(8 bytes\)$"),
    ("inner box within the 128B swizzle span", {"box": (1, 32, 64)}, {"box": (1, 32, 128)},
     r"tensor map box\[2\]: expected at most 128 bytes \(the 128B swizzle span\) in the innermost box edge, "
     r"got 128 bf16 elements \(256 bytes\)$"),
    ("inner box within the 32B swizzle span", {"box": (1, 32, 16), "swizzle": 32},
     {"box": (1, 32, 32), "swizzle": 32},
     r"tensor map box\[2\]: expected at most 32 bytes \(the 32B swizzle span\) in the innermost box edge, "
     r"got 32 bf16 elements \(64 bytes\)$"),
    ("no swizzle: the inner box may exceed 128 bytes", {"box": (1, 32, 256), "swizzle": "none"},
     {"box": (1, 32, 256), "swizzle": "64B"},
     r"tensor map box\[2\]: expected at most 64 bytes \(the 64B swizzle span\)"),
    ("element strides at most 8", {"element_strides": (8, 2, 1)}, {"element_strides": (9, 1, 1)},
     r"tensor map element_strides\[0\]: expected an int in \[1, 8\], got 9$"),
    ("element strides at least 1", {"element_strides": (1, 1, 1)}, {"element_strides": (1, 0, 1)},
     r"tensor map element_strides\[1\]: expected an int in \[1, 8\], got 0$"),
    ("element strides have one entry per dimension", {"element_strides": [1, 1, 1]}, {"element_strides": [1, 1]},
     r"tensor map element_strides: expected 3 entries \(one per dimension of shape\), got 2$"),
    ("dtype is known", {"dtype": "e4m3", "box": (1, 32, 128)}, {"dtype": "int4"},
     r"tensor map dtype: expected one of bf16, fp16, fp32, tf32, fp64, e4m3, e5m2, int8, uint8, int16, uint16, "
     r"int32, uint32, int64, uint64 or a torch dtype of those, got 'int4'$"),
    ("swizzle is known", {"swizzle": 64, "box": (1, 32, 32)}, {"swizzle": 16},
     r"tensor map swizzle: expected one of 'none', '32B', '64B', '128B' \(or 0, 32, 64, 128 bytes\), got 16$"),
    ("swizzle name is known", {"swizzle": "128b"}, {"swizzle": "256B"},
     r"tensor map swizzle: expected one of 'none', '32B', '64B', '128B' \(or 0, 32, 64, 128 bytes\), got '256B'$"),
    ("L2 promotion is known", {"l2_promotion": "none"}, {"l2_promotion": "512B"},
     r"tensor map l2_promotion: expected one of 'none', '64B', '128B', '256B' \(or 0, 64, 128, 256 bytes\), "
     r"got '512B'$"),
    ("L2 promotion in bytes is known", {"l2_promotion": 64}, {"l2_promotion": 32},
     r"tensor map l2_promotion: expected one of 'none', '64B', '128B', '256B'"),
    ("OOB fill is known", {"oob_fill": "nan_request_zero_fma"}, {"oob_fill": "zero"},
     r"tensor map oob_fill: expected one of 'none', 'nan_request_zero_fma', got 'zero'$"),
    ("NaN fill needs a float type", {"dtype": "fp16", "oob_fill": "nan_request_zero_fma"},
     {"dtype": "e4m3", "box": (1, 32, 128), "oob_fill": "nan_request_zero_fma"},
     r"tensor map oob_fill: expected 'none' for e4m3 \(encoded as UINT8, not a float type\), "
     r"got 'nan_request_zero_fma'$"),
    ("interleave is known", {"interleave": "16B"}, {"interleave": "8B"},
     r"tensor map interleave: expected one of 'none', '16B', '32B' \(or 0, 16, 32 bytes\), got '8B'$"),
    ("interleave needs rank 3", {"interleave": "16B"},
     {"interleave": "16B", "shape": (64, 128), "box": (32, 64)},
     r"tensor map shape: expected 3 to 5 dimensions with interleave '16B', got 2$"),
]

INTERLEAVED_RULES = [
    ("32B interleave needs a 32-byte aligned address", {"address": 0x10020}, {"address": 0x10010},
     r"tensor map address: expected a multiple of 32 bytes, got 0x10010$"),
    ("32B interleave needs 32-byte strides", {"strides": (64 * 144, 144, 1)}, {"strides": (64 * 136, 136, 1)},
     r"tensor map strides\[1\]: expected a multiple of 32 bytes below 2\*\*40, got 136 elements "
     r"\(272 bytes of bf16\)$"),
    ("32B interleave needs the 32B swizzle", {"swizzle": "32B"}, {"swizzle": "128B"},
     r"tensor map swizzle: expected '32B' with interleave '32B', got '128B'$"),
]


_CASES = [pytest.param(BASE, ok, bad, msg, id=rule) for rule, ok, bad, msg in RULES] + [
    pytest.param(INTERLEAVED, ok, bad, msg, id=rule) for rule, ok, bad, msg in INTERLEAVED_RULES
]


@pytest.mark.parametrize(("base", "ok", "bad", "message"), _CASES)
def test_each_rule_accepts_one_case_and_refuses_the_other_before_the_driver(
    base: dict[str, Any], ok: dict[str, Any], bad: dict[str, Any], message: str
) -> None:
    address, kwargs = _args(base, ok)
    checked = check_tiled(address, **kwargs)
    assert checked.rank == len(kwargs["shape"])
    address, kwargs = _args(base, bad)
    with pytest.raises(BadArgumentError, match="^" + message):
        encode_tiled(address, **kwargs)  # refused before cuda.bindings is even imported


def test_arguments_are_reversed_into_the_drivers_innermost_first_order_with_byte_strides() -> None:
    args = check_tiled(0x20000, dtype="fp32", shape=(2, 3, 8), box=(1, 2, 4), element_strides=(2, 1, 1),
                       swizzle="none", l2_promotion=128, oob_fill="nan_request_zero_fma")
    assert args.data_type == "CU_TENSOR_MAP_DATA_TYPE_FLOAT32"
    assert args.rank == 3 and args.address == 0x20000
    assert args.global_dim == (8, 3, 2)
    assert args.global_strides == (8 * 4, 3 * 8 * 4)  # dense default, bytes, dimensions 1 and 2
    assert args.box_dim == (4, 2, 1)
    assert args.element_strides == (1, 1, 2)
    assert args.swizzle == "CU_TENSOR_MAP_SWIZZLE_NONE"
    assert args.interleave == "CU_TENSOR_MAP_INTERLEAVE_NONE"
    assert args.l2_promotion == "CU_TENSOR_MAP_L2_PROMOTION_L2_128B"
    assert args.oob_fill == "CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA"


def test_explicit_strides_become_bytes_of_the_element_size() -> None:
    # A (64, 100) fp16 view of a (64, 128) buffer: rows 256 bytes apart.
    args = check_tiled(0x20000, dtype="fp16", shape=(64, 100), strides=(128, 1), box=(64, 64), swizzle=128)
    assert args.global_dim == (100, 64)
    assert args.global_strides == (256,)
    assert args.swizzle == "CU_TENSOR_MAP_SWIZZLE_128B"


def test_a_rank_1_map_has_no_strides() -> None:
    args = check_tiled(0x20000, dtype="int32", shape=(1000,), box=(256,))
    assert args.global_dim == (1000,) and args.global_strides == () and args.box_dim == (256,)
    assert args.l2_promotion == "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"  # the default


@pytest.mark.parametrize(("dtype", "data_type", "size"), [
    ("bf16", "BFLOAT16", 2), ("fp16", "FLOAT16", 2), ("f16", "FLOAT16", 2), ("float16", "FLOAT16", 2),
    ("fp32", "FLOAT32", 4), ("f32", "FLOAT32", 4), ("tf32", "TFLOAT32", 4), ("fp64", "FLOAT64", 8),
    ("e4m3", "UINT8", 1), ("float8_e4m3fn", "UINT8", 1), ("e5m2", "UINT8", 1), ("int8", "UINT8", 1),
    ("uint8", "UINT8", 1), ("int16", "UINT16", 2), ("int32", "INT32", 4), ("uint32", "UINT32", 4),
    ("int64", "INT64", 8), ("uint64", "UINT64", 8), ("BF16", "BFLOAT16", 2),
])
def test_dtype_names_map_to_the_driver_type_of_the_same_width(dtype: str, data_type: str, size: int) -> None:
    # The innermost stride of dimension 1 is 16 elements: its byte count reveals the element size.
    args = check_tiled(0x20000, dtype=dtype, shape=(4, 16), box=(4, 16))
    assert args.data_type == "CU_TENSOR_MAP_DATA_TYPE_" + data_type
    assert args.global_strides == (16 * size,)


def test_every_canonical_dtype_name_is_accepted() -> None:
    for name in DTYPES:
        assert check_tiled(0x20000, dtype=name, shape=(16,), box=(16,)).dtype == name


class _TorchLikeDtype:
    """An object whose type is named like torch's (``torch.dtype``), for a host without torch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


_TorchLikeDtype.__name__ = "dtype"
_TorchLikeDtype.__module__ = "torch"


def test_a_torch_dtype_is_recognised_by_its_type_without_importing_torch() -> None:
    args = check_tiled(0x20000, dtype=_TorchLikeDtype("float8_e5m2"), shape=(32,), box=(32,))
    assert args.dtype == "e5m2" and args.data_type == "CU_TENSOR_MAP_DATA_TYPE_UINT8"
    with pytest.raises(BadArgumentError, match=r"^tensor map dtype: expected one of bf16, .* got <"):
        check_tiled(0x20000, dtype=_TorchLikeDtype("complex64"), shape=(32,), box=(32,))


def test_real_torch_dtypes_are_accepted() -> None:
    torch = pytest.importorskip("torch", reason="needs torch's own dtypes")
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"),
                        (torch.float64, "fp64"), (torch.int8, "int8"), (torch.uint8, "uint8"),
                        (torch.int32, "int32"), (torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")]:
        assert check_tiled(0x20000, dtype=dtype, shape=(64,), box=(16,)).dtype == name


def test_checking_a_map_imports_neither_torch_nor_cuda() -> None:
    code = ("import sys; from cubinstore.tensormap import check_tiled; "
            "check_tiled(0x20000, dtype='bf16', shape=(64, 64), box=(64, 64), swizzle='128B'); "
            "bad = [m for m in ('torch', 'cuda', 'cuda.bindings') if m in sys.modules]; "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_from_tensor_refuses_what_is_not_a_tensor() -> None:
    with pytest.raises(BadArgumentError, match=r"^tensor map tensor: expected a torch tensor, got list$"):
        from_tensor([1, 2, 3], (16,))


def test_from_tensor_refuses_a_cpu_tensor() -> None:
    torch = pytest.importorskip("torch", reason="needs a real CPU tensor")
    with pytest.raises(BadArgumentError, match=r"^tensor map tensor: expected a CUDA tensor, got one on cpu$"):
        from_tensor(torch.zeros(64, 64, dtype=torch.bfloat16), (64, 64))


def test_valid_arguments_reach_the_driver_which_is_absent_here() -> None:
    if _cuda.available()[0]:
        pytest.skip("a CUDA device is present; tests/runtime/test_tensormap_gpu.py encodes for real")
    with pytest.raises(CudaError, match=r"^cuInit failed: "):
        encode_tiled(0x20000, dtype="bf16", shape=(64, 64), box=(64, 64), swizzle="128B")
