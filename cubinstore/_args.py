"""Pack Python launch arguments into a kernel's parameter buffer.

Pure Python (ctypes and struct only): nothing here touches CUDA, so every
rule is testable on a machine without a GPU. `launch.py` checks the layout
computed here against the driver's (`cuFuncGetParamInfo`) once per function,
then hands `PackedArgs.address` to `cuLaunchKernelEx` as `kernelParams`.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cubinstore._core import abi
from cubinstore.errors import BadArgumentError, ParamLayoutError


PARAM_TYPES: Final[frozenset[str]] = frozenset(abi.SCALAR_TYPES)
TENSORMAP_BYTES: Final = 128

_INT_RANGE: Final[dict[str, tuple[int, int]]] = {
    "i8": (-(2**7), 2**7 - 1),
    "u8": (0, 2**8 - 1),
    "i16": (-(2**15), 2**15 - 1),
    "u16": (0, 2**16 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "u32": (0, 2**32 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}
_STRUCT: Final[dict[str, str]] = {
    "i8": "<b",
    "u8": "<B",
    "i16": "<h",
    "u16": "<H",
    "i32": "<i",
    "u32": "<I",
    "i64": "<q",
    "u64": "<Q",
    "f16": "<e",
    "f32": "<f",
    "f64": "<d",
    "ptr": "<Q",
}

# DLPack device types (dlpack.h, DLDeviceType).
_KDL_CUDA: Final = 2
_KDL_CUDA_HOST: Final = 3
_KDL_CUDA_MANAGED: Final = 13
_KDL_NAMES: Final[dict[int, str]] = {1: "cpu", 2: "cuda", 3: "cuda_host", 13: "cuda_managed"}


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the kernel's parameter space (offset from the bank's start)."""

    offset: int
    size: int


def _types(kernel_id: str, entry: str, types: Sequence[str]) -> list[abi.ParamType]:
    parsed = []
    for index, name in enumerate(types):
        try:
            parsed.append(abi.param_type(name))
        except BadArgumentError as exc:
            raise BadArgumentError(f"kernel {kernel_id!r} entry {entry!r} parameter {index}: {exc}") from None
    return parsed


def expected_layout(
    kernel_id: str, entry: str, types: Sequence[str], arch: str | abi.Arch
) -> tuple[ParamSlot, ...]:
    """The layout the compiler gives the declared types on ``arch`` (``cubinstore._core.abi``'s rule)."""
    parsed = _types(kernel_id, entry, types)
    offsets = abi.param_layout(parsed, arch if isinstance(arch, abi.Arch) else abi.Arch.parse(arch))
    return tuple(ParamSlot(o, t.size) for o, t in zip(offsets, parsed))


def check_layout(
    kernel_id: str,
    entry: str,
    types: Sequence[str],
    actual: Sequence[tuple[int, int]],
    arch: str | abi.Arch,
    offsets: Sequence[int] | None = None,
) -> tuple[ParamSlot, ...]:
    """Compare the declared parameters with the CUBIN's real (offset, size) list (``abi.layout_mismatch``).

    ``actual`` comes from ``cuFuncGetParamInfo`` (the driver reads the CUBIN's .nv.info);
    ``offsets`` are the manifest's, which the build checked against the same CUBIN, else the
    ABI rule's. Returns the declared layout; raises ``ParamLayoutError`` naming the first difference.
    """
    parsed = _types(kernel_id, entry, types)
    if offsets is None:
        offsets = abi.param_layout(parsed, arch if isinstance(arch, abi.Arch) else abi.Arch.parse(arch))
    mismatch = abi.layout_mismatch(parsed, None, actual, offsets=offsets)
    if mismatch is None:
        return tuple(ParamSlot(o, t.size) for o, t in zip(offsets, parsed))
    if mismatch.index is None:
        raise ParamLayoutError(
            f"kernel {kernel_id!r} entry {entry!r}: manifest declares {len(mismatch.expected)} parameters "
            f"({', '.join(types)}), the CUBIN's function takes {len(mismatch.actual)}"
        )
    index = mismatch.index
    (want, size), (offset, got) = mismatch.expected[index], mismatch.actual[index]
    raise ParamLayoutError(
        f"kernel {kernel_id!r} entry {entry!r} parameter {index}: manifest declares {types[index]} "
        f"({size} bytes at offset {want}), the CUBIN's function has {got} bytes at offset {offset}"
    )


@dataclass
class PackedArgs:
    """A parameter buffer and the `void*[]` that `kernelParams` points at.

    Holds the caller's objects (and any DLPack capsules) until it is dropped,
    so the memory behind every pointer outlives the launch call.
    """

    buffer: ctypes.Array[ctypes.c_ubyte]
    pointers: ctypes.Array[ctypes.c_void_p] | None
    keepalive: tuple[Any, ...]
    torch_tensor: Any | None  # first torch tensor among the args: picks the stream
    cupy_array: Any | None  # first CuPy array among the args

    @property
    def address(self) -> int:
        """The `void**` to pass as `kernelParams` (0 for a kernel without parameters)."""
        return 0 if self.pointers is None else ctypes.addressof(self.pointers)


PointerDevice = Callable[[int], "int | None"]


def pack_args(
    kernel_id: str,
    entry: str,
    types: Sequence[str],
    args: Sequence[Any],
    *,
    device: int,
    pointer_device: PointerDevice | None = None,
) -> PackedArgs:
    """Convert `args` to the declared `types` and lay them out for the driver.

    `device` is the ordinal the kernel is loaded on; device memory handed in
    as `ptr` must live there. `pointer_device` answers the device of a raw
    pointer taken from a `__cuda_array_interface__` object that names none.
    The driver copies each value from its `kernelParams` pointer to the offset
    the CUBIN gives it, so this host buffer only needs natural alignment.
    """
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise BadArgumentError(
            f"kernel {kernel_id!r} entry {entry!r}: expected args as a list or tuple, got {_type_name(args)}"
        )
    types = tuple(types)
    offsets, sizes, total = _plan(kernel_id, entry, types)
    if len(args) != len(types):
        raise BadArgumentError(
            f"kernel {kernel_id!r} entry {entry!r}: expected {len(types)} arguments "
            f"({', '.join(types)}), got {len(args)}"
        )
    # Over-allocate so the base can sit on a 128-byte boundary, as a tensormap prefers.
    buffer = (ctypes.c_ubyte * (total + 128))()
    address = ctypes.addressof(buffer)
    shift = -address % 128
    view = memoryview(buffer).cast("B")
    keepalive: list[Any] = []
    torch_tensor: Any | None = None
    cupy_array: Any | None = None
    for index, (name, offset, size, value) in enumerate(zip(types, offsets, sizes, args)):
        where = _Where(kernel_id, entry, index)
        kind, extra = _pack_one(where, name, view, shift + offset, size, value, device, pointer_device)
        if kind is None:
            continue
        keepalive.append(value)
        if extra is not None:
            keepalive.append(extra)
        if kind == "torch" and torch_tensor is None:
            torch_tensor = value
        elif kind == "cupy" and cupy_array is None:
            cupy_array = value
    view.release()
    pointers = None
    if offsets:
        pointers = (ctypes.c_void_p * len(offsets))(*[address + shift + o for o in offsets])
    return PackedArgs(buffer, pointers, tuple(keepalive), torch_tensor, cupy_array)


def _pack_one(
    where: _Where, name: str, view: memoryview, at: int, size: int, value: Any, device: int,
    pointer_device: PointerDevice | None,
) -> tuple[str | None, Any | None]:
    """Check one argument against its declared type and write it at `at`.

    Returns (pointer kind, extra object to keep alive) for a `ptr`, (None, None) otherwise.
    """
    if name == "ptr":
        raw, kind, extra = _pointer(where, value, device, pointer_device)
        struct.pack_into("<Q", view, at, raw)
        return kind, extra
    if name == "tensormap":
        view[at : at + TENSORMAP_BYTES] = _tensormap(where, value)
    elif name in _INT_RANGE:
        struct.pack_into(_STRUCT[name], view, at, _integer(where, name, value))
    elif name.startswith("struct:"):
        view[at : at + size] = _struct_bytes(where, name, size, value)
    else:
        view[at : at + size] = _floating(where, name, value)
    return None, None


@functools.lru_cache(maxsize=4096)
def _plan(kernel_id: str, entry: str, types: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(host offsets, sizes, total bytes) of a parameter list; cached, as launches repeat.

    An unknown type raises here, naming the kernel, entry and parameter (errors are not cached).
    """
    parsed = _types(kernel_id, entry, types)
    offsets, cursor = [], 0
    for t in parsed:
        cursor += -cursor % t.align
        offsets.append(cursor)
        cursor += t.size
    return tuple(offsets), tuple(t.size for t in parsed), cursor


class _Where:
    """`kernel '<id>' entry '<entry>' parameter <i>`, formatted only when an error needs it."""

    __slots__ = ("entry", "index", "kernel_id")

    def __init__(self, kernel_id: str, entry: str, index: int) -> None:
        self.kernel_id, self.entry, self.index = kernel_id, entry, index

    def __str__(self) -> str:
        return f"kernel {self.kernel_id!r} entry {self.entry!r} parameter {self.index}"


def _type_name(value: object) -> str:
    cls = type(value)
    module = cls.__module__.split(".")[0]
    return cls.__name__ if module == "builtins" else f"{module}.{cls.__name__}"


def _integer(where: _Where, name: str, value: Any) -> int:
    if isinstance(value, (bool, float)):
        raise BadArgumentError(f"{where}: expected {name}, got {_type_name(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise BadArgumentError(f"{where}: expected {name}, got {_type_name(value)}") from None
    low, high = _INT_RANGE[name]
    if not low <= number <= high:
        raise BadArgumentError(f"{where}: expected {name} in [{low}, {high}], got {number}")
    return number


def _floating(where: _Where, name: str, value: Any) -> bytes:
    if isinstance(value, bool) or not _is_real(value):
        raise BadArgumentError(f"{where}: expected {name}, got {_type_name(value)}")
    number = float(value)
    if name == "bf16":
        return _bf16_bytes(where, number)
    try:
        return struct.pack(_STRUCT[name], number)
    except OverflowError:
        # struct refuses finite doubles beyond float32's range rather than round to inf.
        raise BadArgumentError(f"{where}: expected {name}, got {number!r}, out of range for {name}") from None


def _bf16_bytes(where: _Where, number: float) -> bytes:
    """The bfloat16 nearest ``number`` (round to nearest even), as the device stores it."""
    try:
        (bits,) = struct.unpack("<I", struct.pack("<f", number))
    except OverflowError:
        raise BadArgumentError(f"{where}: expected bf16, got {number!r}, out of range for bf16") from None
    if number != number:  # NaN: keep it a quiet NaN
        return struct.pack("<H", 0x7FC0)
    bits += 0x7FFF + ((bits >> 16) & 1)
    if (bits >> 16) & 0x7FFF == 0x7F80 and abs(number) != float("inf"):
        raise BadArgumentError(f"{where}: expected bf16, got {number!r}, out of range for bf16")
    return struct.pack("<H", (bits >> 16) & 0xFFFF)


def _struct_bytes(where: _Where, name: str, size: int, value: Any) -> bytes:
    """A struct passed by value: ``size`` bytes, or a ctypes structure of that size."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, (ctypes.Structure, ctypes.Union, ctypes.Array)):
        data = ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value))
    else:
        raise BadArgumentError(f"{where}: expected {name} as bytes or a ctypes structure, got {_type_name(value)}")
    if len(data) != size:
        raise BadArgumentError(f"{where}: expected {name} of {size} bytes, got {_type_name(value)} of {len(data)} bytes")
    return data


def _is_real(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    # numpy scalars and 0-d arrays without importing numpy: they expose __float__
    # and a dtype whose kind is integer or floating.
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return kind in ("i", "u", "f") and getattr(value, "ndim", 0) == 0 and hasattr(value, "__float__")


def _tensormap(where: _Where, value: Any) -> bytes:
    raw = value if isinstance(value, (bytes, bytearray, memoryview)) else getattr(value, "raw", None)
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise BadArgumentError(f"{where}: expected tensormap, got {_type_name(value)}")
    data = bytes(raw)
    if len(data) != TENSORMAP_BYTES:
        raise BadArgumentError(
            f"{where}: expected tensormap of {TENSORMAP_BYTES} bytes, got {_type_name(value)} of {len(data)} bytes"
        )
    return data


def _is_torch_tensor(value: Any) -> bool:
    # torch is optional: recognise its tensors without importing it.
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr") and hasattr(value, "is_cuda")


def _pointer(
    where: _Where, value: Any, device: int, pointer_device: PointerDevice | None
) -> tuple[int, str, Any | None]:
    """Return (address, kind, object to keep alive) for one `ptr` argument."""
    if isinstance(value, bool):
        raise BadArgumentError(f"{where}: expected ptr, got bool")
    if isinstance(value, int):
        if not 0 <= value < 2**64:
            raise BadArgumentError(f"{where}: expected ptr in [0, 2**64), got {value}")
        return value, "int", None
    if _is_torch_tensor(value):
        if not value.is_cuda:
            raise BadArgumentError(
                f"{where}: expected ptr to CUDA memory on device {device}, got torch.Tensor on {value.device}"
            )
        if value.device.index != device:
            raise BadArgumentError(
                f"{where}: expected ptr to CUDA memory on device {device}, got torch.Tensor on {value.device}"
            )
        return int(value.data_ptr()), "torch", None
    iface = getattr(value, "__cuda_array_interface__", None)
    if isinstance(iface, dict):
        raw = int(iface["data"][0])
        owner = getattr(getattr(value, "device", None), "id", None)
        if not isinstance(owner, int) and pointer_device is not None and raw != 0:
            owner = pointer_device(raw)
        if isinstance(owner, int) and owner != device:
            raise BadArgumentError(
                f"{where}: expected ptr to CUDA memory on device {device}, got {_type_name(value)} on device {owner}"
            )
        kind = "cupy" if type(value).__module__.startswith("cupy") else "cai"
        return raw, kind, None
    if hasattr(value, "__dlpack_device__") and hasattr(value, "__dlpack__"):
        dev_type, dev_id = value.__dlpack_device__()
        dev_type, dev_id = int(dev_type), int(dev_id)
        if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED) or (dev_type == _KDL_CUDA and dev_id != device):
            name = _KDL_NAMES.get(dev_type, f"dlpack device type {dev_type}")
            raise BadArgumentError(
                f"{where}: expected ptr to CUDA memory on device {device}, "
                f"got {_type_name(value)} on {name}:{dev_id}"
            )
        capsule = _dlpack_capsule(value)
        return dlpack_data_pointer(capsule), "dlpack", capsule
    raise BadArgumentError(f"{where}: expected ptr, got {_type_name(value)}")


def _dlpack_capsule(value: Any) -> Any:
    # stream=-1 asks the producer not to synchronise (array-API DLPack
    # convention); older producers take no stream argument.
    try:
        return value.__dlpack__(stream=-1)
    except TypeError:
        return value.__dlpack__()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def dlpack_data_pointer(capsule: Any) -> int:
    """Address of the first element of an unconsumed legacy `dltensor` capsule.

    The capsule is only read, never renamed to `used_dltensor`, so its own
    destructor still releases the producer's reference when it is dropped.
    `DLManagedTensor` starts with its `DLTensor`, so the capsule pointer is
    the tensor's address.
    """
    if not _capsule_is_valid(capsule, b"dltensor"):
        raise BadArgumentError("expected an unconsumed DLPack 'dltensor' capsule")
    address = _capsule_get_pointer(capsule, b"dltensor")
    tensor = _DLTensor.from_address(address)
    return int(tensor.data or 0) + int(tensor.byte_offset)



class ArgBuffer:
    """A parameter buffer reused across launches: fixed arguments packed once, the rest per launch.

    `args` holds one value per declared type, or None for a parameter that changes between
    launches (None is no valid value of any type, so it cannot be meant literally). `write`
    packs the changing ones, in parameter order, into the same buffer, checked by the same
    rules as `pack_args`; a raw int pointer or a 128-byte `bytes` tensor map take a short path.
    The layout is `_plan`'s, so the bytes equal those `pack_args` gives the same arguments.
    Not thread-safe: the caller serialises `write` and the launch that reads the buffer.
    """

    def __init__(
        self,
        kernel_id: str,
        entry: str,
        types: Sequence[str],
        args: Sequence[Any],
        *,
        device: int,
        pointer_device: PointerDevice | None = None,
    ) -> None:
        types = tuple(types)
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence) or len(args) != len(types):
            got = f"{len(args)}" if isinstance(args, Sequence) else _type_name(args)
            raise BadArgumentError(
                f"kernel {kernel_id!r} entry {entry!r}: expected {len(types)} arguments or None "
                f"placeholders ({', '.join(types)}), got {got}"
            )
        offsets, sizes, total = _plan(kernel_id, entry, types)
        self._kernel_id, self._entry, self._device, self._pointer_device = kernel_id, entry, device, pointer_device
        self._buffer = (ctypes.c_ubyte * (total + 128))()
        address = ctypes.addressof(self._buffer)
        shift = -address % 128  # a tensormap prefers a 128-byte aligned base
        self._span = (shift, shift + total)
        self._view = memoryview(self._buffer).cast("B")
        self._pointers = (ctypes.c_void_p * max(len(offsets), 1))(*[address + shift + o for o in offsets])
        self.address = ctypes.addressof(self._pointers) if offsets else 0
        fixed = [(i, v) for i, v in enumerate(args) if v is not None]
        #: (index, type, buffer offset, size) of each parameter `write` fills, in order.
        self.varying: tuple[tuple[int, str, int, int], ...] = tuple(
            (i, types[i], shift + offsets[i], sizes[i]) for i, v in enumerate(args) if v is None
        )
        self._keepalive: list[Any] = []  # fixed pointer arguments' objects (and DLPack capsules)
        self._fixed_at = frozenset(shift + offsets[i] for i, _ in fixed)
        for index, value in fixed:
            self._pack(index, types[index], shift + offsets[index], sizes[index], value)

    def raw(self) -> bytes:
        """The packed bytes (parameter 0 at offset 0), for tests and debugging."""
        start, end = self._span
        return bytes(self._view[start:end])

    def plan(self) -> tuple[int, ...]:
        """Where and how the compiled helper's ``launch`` writes each changing argument, as ``write``'s
        short path does: (address, kind) pairs flattened, kind 1 for a ``ptr`` (an int in [0, 2**64),
        8 bytes little-endian), 2 for a ``tensormap`` (128 bytes), 0 for a parameter it leaves to
        ``write`` (then ``write`` packs them all)."""
        base = ctypes.addressof(self._buffer)
        plan: list[int] = []
        for _index, name, at, size in self.varying:
            kind = 1 if name == "ptr" and size == 8 else 2 if name == "tensormap" and size == TENSORMAP_BYTES else 0
            plan += (base + at, kind)
        return tuple(plan)

    def write(self, values: Sequence[Any]) -> None:
        """Pack the changing arguments, one per None of the constructor's `args`, in order."""
        if len(values) != len(self.varying):
            raise BadArgumentError(
                f"kernel {self._kernel_id!r} entry {self._entry!r}: expected {len(self.varying)} changing "
                f"arguments (parameters {[v[0] for v in self.varying]}), got {len(values)}"
            )
        view = self._view
        for (index, name, at, size), value in zip(self.varying, values):
            cls = type(value)
            if name == "tensormap" and cls is bytes and len(value) == TENSORMAP_BYTES:
                view[at : at + TENSORMAP_BYTES] = value
            elif name == "ptr" and cls is int and 0 <= value < 2**64:
                struct.pack_into("<Q", view, at, value)
            else:
                self._pack(index, name, at, size, value)

    def _pack(self, index: int, name: str, at: int, size: int, value: Any) -> None:
        where = _Where(self._kernel_id, self._entry, index)
        kind, extra = _pack_one(where, name, self._view, at, size, value, self._device, self._pointer_device)
        if kind is not None and at in self._fixed_at:
            # A fixed pointer's memory must outlive every launch of this buffer.
            self._keepalive.append((value, extra))
