"""Argument packing and layout checks (cubinstore._args): pure Python, no GPU needed."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cubinstore.errors import BadArgumentError, CubinstoreError, ManifestError, ParamLayoutError
from cubinstore.internals import ParamSlot, check_layout, dlpack_data_pointer, expected_layout, pack_args
from cubinstore.manifest import PARAM_TYPES

KID = "axpy/f32/vec4/sm_90a"
ENTRY = "axpy_f32"
AXPY = ("i32", "f32", "ptr", "ptr")


def slot_bytes(packed: Any, index: int, size: int) -> bytes:
    """What the driver will copy for parameter `index`: `size` bytes at kernelParams[index]."""
    assert packed.pointers is not None
    return ctypes.string_at(packed.pointers[index], size)


class CudaArray:
    """A minimal `__cuda_array_interface__` producer: a third-party array type, as the protocol allows."""

    def __init__(self, address: int, device_id: int | None = None) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (address, False), "version": 3}
        if device_id is not None:
            self.device = type("Dev", (), {"id": device_id})()


class DLPackOnCuda:
    """A DLPack producer that reports a CUDA device and hands out a real capsule (numpy's)."""

    def __init__(self, array: np.ndarray, device_type: int = 2, device_id: int = 0) -> None:
        self.array = array
        self.device_type = device_type
        self.device_id = device_id
        self.stream_seen: object = "unset"

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device_type, self.device_id

    def __dlpack__(self, stream: object = None) -> object:
        self.stream_seen = stream
        return self.array.__dlpack__()


class TensorMapLike:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw


# -- layout --------------------------------------------------------------------------------------


def test_param_types_match_the_manifest_schema() -> None:
    from cubinstore.internals import args as _args

    assert _args.PARAM_TYPES == PARAM_TYPES


def test_axpy_f32_layout_packs_naturally_aligned() -> None:
    assert expected_layout(KID, ENTRY, AXPY, "sm_90a") == (ParamSlot(0, 4), ParamSlot(4, 4), ParamSlot(8, 8), ParamSlot(16, 8))


def test_axpy_f64_layout_pads_the_scalar_to_eight() -> None:
    layout = expected_layout("axpy/f64/vec4/sm_90a", "axpy_f64", ("i32", "f64", "ptr", "ptr"), "sm_90a")
    assert layout == (ParamSlot(0, 4), ParamSlot(8, 8), ParamSlot(16, 8), ParamSlot(24, 8))


def test_tensormap_is_aligned_in_the_parameter_bank_not_the_block() -> None:
    # sm_90 parameters start at bank offset 0x210: a 128-byte aligned map lands at 112, 240, ...
    layout = expected_layout("gemm/x/sm_90a", "gemm", ("tensormap", "i32", "tensormap", "ptr"), "sm_90a")
    assert layout == (ParamSlot(112, 128), ParamSlot(240, 4), ParamSlot(368, 128), ParamSlot(496, 8))
    # sm_80's bank starts at 0x160.
    assert expected_layout("k", "e", ("i32", "tensormap"), "sm_80") == (ParamSlot(0, 4), ParamSlot(32, 128))


def test_unknown_type_is_a_typed_error_naming_the_parameter() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 1: invalid parameter type 'f17'"):
        expected_layout(KID, ENTRY, ("i32", "f17"), "sm_90a")


def test_matching_layout_passes_and_returns_the_slots() -> None:
    # The (offset, size) list cuFuncGetParamInfo reports for axpy_f32.
    assert check_layout(KID, ENTRY, AXPY, [(0, 4), (4, 4), (8, 8), (16, 8)], "sm_90a")[3] == ParamSlot(16, 8)


def test_gemm_layout_as_the_h200_reported_it_passes() -> None:
    # cuFuncGetParamInfo for the sm_90a GEMM (two CUtensorMaps first), as an H200 reported it.
    gemm = ("tensormap", "tensormap", "ptr", "i32", "i32", "i32", "ptr", "ptr", "i32")
    real = [(112, 128), (240, 128), (368, 8), (376, 4), (380, 4), (384, 4), (392, 8), (400, 8), (408, 4)]
    assert check_layout("gemm/x/sm_90a", "gemm_bf16_tn", gemm, real, "sm_90a")[6] == ParamSlot(392, 8)
    shifted_wrong = [(112, 128), (240, 128), (368, 8), (376, 4), (380, 4), (384, 4), (388, 8), (396, 8), (404, 4)]
    with pytest.raises(ParamLayoutError, match=r"^kernel 'gemm/x/sm_90a' entry 'gemm_bf16_tn' parameter 6: manifest declares ptr \(8 bytes at offset 392\), the CUBIN's function has 8 bytes at offset 388$"):
        check_layout("gemm/x/sm_90a", "gemm_bf16_tn", gemm, shifted_wrong, "sm_90a")


def test_scalars_before_a_tensormap_match_the_compiler() -> None:
    # The case the old rule got wrong: k(int*, u32, u32, u32, CUtensorMap x3) on sm_90.
    types = ("ptr", "u32", "u32", "u32", "tensormap", "tensormap", "tensormap")
    real = [(0, 8), (8, 4), (12, 4), (16, 4), (112, 128), (240, 128), (368, 128)]
    assert [s.offset for s in check_layout("k", "e", types, real, "sm_90a")] == [0, 8, 12, 16, 112, 240, 368]


def test_manifest_offsets_are_what_is_compared() -> None:
    with pytest.raises(ParamLayoutError, match=r"^kernel 'k' entry 'e' parameter 1: manifest declares i32 \(4 bytes at offset 8\)"):
        check_layout("k", "e", ("i32", "i32"), [(0, 4), (4, 4)], "sm_90a", offsets=(0, 8))


def test_declared_f32_where_cubin_takes_f64_is_caught() -> None:
    real_f64 = [(0, 4), (8, 8), (16, 8), (24, 8)]
    with pytest.raises(ParamLayoutError, match=(
        r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 1: manifest declares f32 "
        r"\(4 bytes at offset 4\), the CUBIN's function has 8 bytes at offset 8$"
    )):
        check_layout(KID, ENTRY, AXPY, real_f64, "sm_90a")


def test_wrong_parameter_count_is_caught() -> None:
    with pytest.raises(ParamLayoutError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32': manifest declares 4 parameters \(i32, f32, ptr, ptr\), the CUBIN's function takes 3$"):
        check_layout(KID, ENTRY, AXPY, [(0, 4), (4, 4), (8, 8)], "sm_90a")


def test_tensormap_declared_where_cubin_has_a_pointer_is_caught() -> None:
    with pytest.raises(ParamLayoutError, match=r"^kernel 'g' entry 'e' parameter 1: manifest declares tensormap \(128 bytes at offset 112\)"):
        check_layout("g", "e", ("ptr", "tensormap"), [(0, 8), (8, 8)], "sm_90a")


def test_struct_by_value_from_bytes_and_ctypes() -> None:
    class Params(ctypes.Structure):
        _fields_ = [("m", ctypes.c_uint32), ("n", ctypes.c_uint32), ("alpha", ctypes.c_float)]

    value = Params(7, 9, 1.5)
    packed = pack_args("k", "e", ("i32", "struct:12:4"), [1, value], device=0)
    assert slot_bytes(packed, 1, 12) == struct.pack("<IIf", 7, 9, 1.5)
    packed = pack_args("k", "e", ("struct:12:4",), [b"x" * 12], device=0)
    assert slot_bytes(packed, 0, 12) == b"x" * 12
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected struct:12:4 of 12 bytes, got bytes of 8 bytes"):
        pack_args("k", "e", ("struct:12:4",), [b"x" * 8], device=0)
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected struct:12:4 as bytes or a ctypes structure, got int"):
        pack_args("k", "e", ("struct:12:4",), [3], device=0)


@pytest.mark.parametrize("spelling, message", [
    ("struct:12:8", "a struct's size must be a multiple of its alignment"),
    ("struct:0:4", "expected one of"),
    ("struct:12:3", "expected one of"),
    ("struct:99999:1", "at most 4096 bytes"),
])
def test_bad_struct_types_are_refused(spelling: str, message: str) -> None:
    with pytest.raises(BadArgumentError, match=rf"^kernel 'k' entry 'e' parameter 0: invalid parameter type '{spelling}'.*{message}"):
        pack_args("k", "e", (spelling,), [b""], device=0)


@pytest.mark.parametrize("type_, value, raw", [
    ("i8", -3, struct.pack("<b", -3)), ("u8", 250, b"\xfa"), ("i16", -300, struct.pack("<h", -300)),
    ("u16", 65535, b"\xff\xff"), ("f16", 1.5, struct.pack("<e", 1.5)), ("bf16", 1.0, b"\x80\x3f"),
    ("bf16", -2.5, b"\x20\xc0"), ("bf16", 1.00390625, b"\x80\x3f"),  # ties round to even
])
def test_small_scalars_pack_as_the_device_reads_them(type_: str, value: Any, raw: bytes) -> None:
    packed = pack_args("k", "e", (type_,), [value], device=0)
    assert slot_bytes(packed, 0, len(raw)) == raw


def test_bf16_out_of_range_is_refused() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected bf16, got 3.4e\+38, out of range for bf16"):
        pack_args("k", "e", ("bf16",), [3.4e38], device=0)


def test_layout_error_is_a_manifest_error() -> None:
    assert issubclass(ParamLayoutError, ManifestError)
    assert issubclass(ParamLayoutError, CubinstoreError)


# -- scalars -------------------------------------------------------------------------------------


def test_axpy_arguments_land_at_their_offsets() -> None:
    packed = pack_args(KID, ENTRY, AXPY, [1000, 2.5, 0x7F0000001000, 0x7F0000002000], device=0)
    assert slot_bytes(packed, 0, 4) == struct.pack("<i", 1000)
    assert slot_bytes(packed, 1, 4) == struct.pack("<f", 2.5)
    assert slot_bytes(packed, 2, 8) == struct.pack("<Q", 0x7F0000001000)
    assert slot_bytes(packed, 3, 8) == struct.pack("<Q", 0x7F0000002000)
    base = packed.pointers[0]
    assert [p - base for p in packed.pointers] == [0, 4, 8, 16]
    assert packed.address == ctypes.addressof(packed.pointers)


@pytest.mark.parametrize(
    ("type_", "value", "fmt"),
    [
        ("i32", -(2**31), "<i"),
        ("i32", 2**31 - 1, "<i"),
        ("u32", 2**32 - 1, "<I"),
        ("i64", -(2**63), "<q"),
        ("u64", 2**64 - 1, "<Q"),
        ("i64", np.int64(-5), "<q"),
        ("u32", np.uint8(200), "<I"),
    ],
)
def test_integer_bounds_are_accepted(type_: str, value: Any, fmt: str) -> None:
    packed = pack_args("k", "e", (type_,), [value], device=0)
    assert slot_bytes(packed, 0, struct.calcsize(fmt)) == struct.pack(fmt, int(value))


@pytest.mark.parametrize(
    ("type_", "value", "message"),
    [
        ("i32", 2**31, r"expected i32 in \[-2147483648, 2147483647\], got 2147483648$"),
        ("i32", -(2**31) - 1, r"expected i32 in \[-2147483648, 2147483647\], got -2147483649$"),
        ("u32", -1, r"expected u32 in \[0, 4294967295\], got -1$"),
        ("u64", 2**64, r"expected u64 in \[0, 18446744073709551615\], got 18446744073709551616$"),
        ("i64", 2**63, r"expected i64 in \[-9223372036854775808, 9223372036854775807\], got 9223372036854775808$"),
        ("i32", 3.0, r"expected i32, got float$"),
        ("i32", True, r"expected i32, got bool$"),
        ("u64", "7", r"expected u64, got str$"),
        ("i32", np.float32(1), r"expected i32, got numpy.float32$"),
    ],
)
def test_bad_integers_name_kernel_entry_and_parameter(type_: str, value: Any, message: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 1: " + message):
        pack_args("k", "e", ("i32", type_), [0, value], device=0)


def test_floats_accept_ints_and_numpy_scalars() -> None:
    packed = pack_args("k", "e", ("f32", "f64", "f64", "f32"), [3, np.float32(0.5), np.float64(-1e300), float("nan")], device=0)
    assert struct.unpack("<f", slot_bytes(packed, 0, 4))[0] == 3.0
    assert struct.unpack("<d", slot_bytes(packed, 1, 8))[0] == 0.5
    assert struct.unpack("<d", slot_bytes(packed, 2, 8))[0] == -1e300
    assert np.isnan(struct.unpack("<f", slot_bytes(packed, 3, 4))[0])


def test_f32_out_of_range_is_refused_not_rounded_to_inf() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected f32, got 1e\+39, out of range for f32$"):
        pack_args("k", "e", ("f32",), [1e39], device=0)


@pytest.mark.parametrize("value", [True, "1.0", None, [1.0], np.zeros(2)])
def test_non_numbers_are_refused_for_floats(value: Any) -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected f64, got "):
        pack_args("k", "e", ("f64",), [value], device=0)


# -- pointers ------------------------------------------------------------------------------------


def test_float_for_a_pointer_gives_the_documented_message() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr, got float$"):
        pack_args(KID, ENTRY, AXPY, [16, 1.0, 1.5, 0], device=0)


@pytest.mark.parametrize(("value", "message"), [(-1, r"expected ptr in \[0, 2\*\*64\), got -1$"), (True, r"expected ptr, got bool$")])
def test_bad_raw_pointers_are_refused(value: Any, message: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: " + message):
        pack_args("k", "e", ("ptr",), [value], device=0)


def test_host_numpy_array_is_refused_as_a_pointer() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected ptr to CUDA memory on device 0, got numpy.ndarray on cpu:0$"):
        pack_args("k", "e", ("ptr",), [np.zeros(4, np.float32)], device=0)


def test_cuda_array_interface_pointer_is_passed_through() -> None:
    packed = pack_args("k", "e", ("ptr",), [CudaArray(0xDEAD0000, device_id=1)], device=1)
    assert slot_bytes(packed, 0, 8) == struct.pack("<Q", 0xDEAD0000)


def test_cuda_array_interface_on_another_device_is_refused() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected ptr to CUDA memory on device 0, got .*CudaArray on device 1$"):
        pack_args("k", "e", ("ptr",), [CudaArray(0xDEAD0000, device_id=1)], device=0)


def test_pointer_device_answers_for_arrays_that_name_no_device() -> None:
    asked: list[int] = []

    def owner(address: int) -> int:
        asked.append(address)
        return 3

    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected ptr to CUDA memory on device 0, got .*CudaArray on device 3$"):
        pack_args("k", "e", ("ptr",), [CudaArray(0xBEEF000)], device=0, pointer_device=owner)
    assert asked == [0xBEEF000]
    packed = pack_args("k", "e", ("ptr",), [CudaArray(0xBEEF000)], device=3, pointer_device=owner)
    assert slot_bytes(packed, 0, 8) == struct.pack("<Q", 0xBEEF000)


def test_dlpack_capsule_pointer_is_the_first_element() -> None:
    array = np.arange(16, dtype=np.float32)[3:]
    assert dlpack_data_pointer(array.__dlpack__()) == array.ctypes.data


def test_dlpack_producer_on_cuda_packs_its_data_pointer_and_keeps_the_capsule() -> None:
    array = np.arange(8, dtype=np.float64)
    producer = DLPackOnCuda(array)
    packed = pack_args("k", "e", ("ptr",), [producer], device=0)
    assert slot_bytes(packed, 0, 8) == struct.pack("<Q", array.ctypes.data)
    assert producer.stream_seen == -1  # asked not to synchronise
    capsules = [o for o in packed.keepalive if type(o).__name__ == "PyCapsule"]
    assert len(capsules) == 1
    # Read, not consumed: the capsule can still be imported once, and freeing it is safe.
    assert np.from_dlpack(_Capsule(capsules[0])).ctypes.data == array.ctypes.data


class _Capsule:
    """Hands an existing capsule to np.from_dlpack (which wants a producer object)."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **_: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return 1, 0


def test_dlpack_producer_on_another_gpu_is_refused() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e' parameter 0: expected ptr to CUDA memory on device 0, got .*DLPackOnCuda on cuda:1$"):
        pack_args("k", "e", ("ptr",), [DLPackOnCuda(np.zeros(2), device_id=1)], device=0)


def test_dlpack_managed_memory_is_accepted_on_any_device() -> None:
    array = np.zeros(2)
    packed = pack_args("k", "e", ("ptr",), [DLPackOnCuda(array, device_type=13, device_id=0)], device=1)
    assert slot_bytes(packed, 0, 8) == struct.pack("<Q", array.ctypes.data)


# -- tensor maps ---------------------------------------------------------------------------------


def test_tensormap_bytes_are_copied_to_an_aligned_slot() -> None:
    raw = bytes(range(128))
    packed = pack_args("g", "e", ("i32", "tensormap", "ptr"), [7, TensorMapLike(raw), 0x1000], device=0)
    assert packed.pointers[1] % 128 == 0
    assert packed.pointers[1] - packed.pointers[0] == 128
    assert slot_bytes(packed, 1, 128) == raw
    assert slot_bytes(packed, 2, 8) == struct.pack("<Q", 0x1000)


def test_plain_bytes_are_a_tensormap_too() -> None:
    packed = pack_args("g", "e", ("tensormap",), [bytearray(b"\x01" * 128)], device=0)
    assert slot_bytes(packed, 0, 128) == b"\x01" * 128


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"\x00" * 64, r"expected tensormap of 128 bytes, got bytes of 64 bytes$"),
        (TensorMapLike(b"\x00" * 129), r"expected tensormap of 128 bytes, got .*TensorMapLike of 129 bytes$"),
        (0x1000, r"expected tensormap, got int$"),
    ],
)
def test_bad_tensormaps_are_refused(value: Any, message: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'g' entry 'e' parameter 0: " + message):
        pack_args("g", "e", ("tensormap",), [value], device=0)


# -- the argument list ---------------------------------------------------------------------------


def test_wrong_argument_count_lists_the_declared_types() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32': expected 4 arguments \(i32, f32, ptr, ptr\), got 3$"):
        pack_args(KID, ENTRY, AXPY, [1, 2.0, 0], device=0)


@pytest.mark.parametrize("args", [None, "abc", {1, 2}, 5])
def test_args_must_be_a_sequence(args: Any) -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'k' entry 'e': expected args as a list or tuple, got "):
        pack_args("k", "e", ("i32",), args, device=0)


def test_kernel_without_parameters_passes_a_null_param_array() -> None:
    assert pack_args("k", "e", (), [], device=0).address == 0


def test_importing_cubinstore_launch_touches_no_cuda() -> None:
    code = (
        "import sys, cubinstore.launch, cubinstore._args, cubinstore._driver.cuda;"
        "bad = [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.') or m in ('torch', 'cupy')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
