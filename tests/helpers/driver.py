"""Stand-ins for what a load asks of the driver, shared by the runtime tests that run with no GPU."""

from __future__ import annotations

import random
import struct
from types import SimpleNamespace

from cubinstore.internals import cuda

#: Device 0's compute capability, 9.0: the only device facts a load asks for.
SM90_FACTS = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0}


def cubin(i: int, size: int = 6000, sm: int = 90) -> bytes:
    """ELF-headed random bytes (seed ``i``) whose header names ``sm``: what the loader checks; no
    driver parses them."""
    head = bytearray(64)
    head[:9] = b"\x7fELF\x02\x01\x01\x00\x08"  # 64-bit, little-endian, CUDA ELF ABI v8
    struct.pack_into("<H", head, 0x12, 190)  # EM_CUDA
    struct.pack_into("<I", head, 0x30, sm << 8)
    return bytes(head) + random.Random(i).randbytes(size - 64)


def bindings_driver() -> SimpleNamespace:
    """A driver of one sm_90 device whose loads are ``cubinstore._driver.cuda``'s own functions (so
    the loader calls ``cuda.load_functions`` over whatever bindings ``cuda.use_bindings`` set)."""
    own = {name: getattr(cuda, name) for name in dir(cuda) if not name.startswith("_")}
    return SimpleNamespace(**{**own, "device_count": lambda: 1, "current_device": lambda: 0,
                              "device_attribute": lambda ordinal, name: SM90_FACTS[name],
                              "driver_version": lambda: 13000})
