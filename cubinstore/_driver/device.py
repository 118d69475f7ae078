"""The one per-device cache: facts of a CUDA device that cannot change in a process.

The device count, and per device its compute capability, SM count and shared-memory limit,
each asked of the driver once, on first use (nothing at import: the driver loads with the
first question). Launches read them on every call, so a hit is a dict lookup.

``Devices`` asks a driver object with ``device_count()`` and ``device_attribute(ordinal, name)``,
by default ``cubinstore._driver.cuda``, and hands the same object to the layers above: the loader
and launcher make every driver call through ``current().driver``. So ``use`` is the one way a
test substitutes the driver (see its docstring); nothing patches a module attribute.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["Devices", "check_ordinal", "checked", "compute_capability", "count", "current", "shared_mem_optin",
           "sm_count", "use"]

_CC_MAJOR = "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"
_CC_MINOR = "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"
_SM_COUNT = "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"
_SMEM_OPTIN = "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"


class Driver(Protocol):
    """What ``Devices`` asks of the driver (``cubinstore._driver.cuda`` has both)."""

    def device_count(self) -> int: ...

    def device_attribute(self, ordinal: int, name: str) -> int: ...


class Devices:
    """The facts of every device, each queried once per device from ``driver``, lazily; and the
    driver itself, for the layers above (``driver``)."""

    def __init__(self, driver: Driver | None = None) -> None:
        if driver is None:
            from cubinstore._driver import cuda as driver  # the module: cuda.bindings loads with its first call
        #: The driver these facts come from, and the one the loader and launcher call.
        self.driver: Any = driver
        self._lock = threading.Lock()
        self._count: int | None = None
        self._attributes: dict[tuple[int, str], int] = {}
        self._capabilities: dict[int, tuple[int, int]] = {}
        #: ``driver_version()``'s answer in a 1-tuple once asked, else None: the loader reads it here, a
        #: first load's one call fewer (issue 31).
        self.known_driver_version: tuple[int | None] | None = None

    def count(self) -> int:
        """How many devices the driver reports."""
        value = self._count
        if value is None:
            value = int(self.driver.device_count())
            with self._lock:
                if self._count is None:
                    self._count = value
                value = self._count
        return value

    def check_ordinal(self, ordinal: Any) -> int:
        """``ordinal`` when it names a device here, else ``BadArgumentError`` saying which exist."""
        count = self._count
        if type(ordinal) is int and count is not None and 0 <= ordinal < count:  # every launch: no call
            return ordinal
        if isinstance(ordinal, int) and not isinstance(ordinal, bool) and 0 <= ordinal < self.count():
            return ordinal
        from cubinstore.errors import BadArgumentError

        raise BadArgumentError(f"invalid device {ordinal!r}: expected an ordinal in [0, {self.count()})")

    def attribute(self, ordinal: int, name: str) -> int:
        """``CU_DEVICE_ATTRIBUTE_<...>`` ``name`` of device ``ordinal`` (one that cannot change while the process runs)."""
        key = (ordinal, name)
        value = self._attributes.get(key)
        if value is None:
            value = int(self.driver.device_attribute(ordinal, name))
            with self._lock:
                value = self._attributes.setdefault(key, value)
        return value

    def compute_capability(self, ordinal: int) -> tuple[int, int]:
        cc = self._capabilities.get(ordinal)
        if cc is None:
            cc = (self.attribute(ordinal, _CC_MAJOR), self.attribute(ordinal, _CC_MINOR))
            with self._lock:
                cc = self._capabilities.setdefault(ordinal, cc)
        return cc

    def driver_version(self) -> int | None:
        """The CUDA version the driver supports (``cuDriverGetVersion``: 13000 is CUDA 13.0), asked once.

        None for a driver object without ``driver_version`` (a test's fake that does not model it):
        then no kernel's ``min_driver`` is checked against it."""
        known = self.known_driver_version
        if known is None:
            ask = getattr(self.driver, "driver_version", None)
            known = (None if ask is None else int(ask()),)
            with self._lock:
                if self.known_driver_version is None:
                    self.known_driver_version = known
                known = self.known_driver_version
        return known[0]

    def sm_count(self, ordinal: int) -> int:
        """Multiprocessors of device ``ordinal``."""
        return self.attribute(ordinal, _SM_COUNT)

    def shared_mem_optin(self, ordinal: int) -> int:
        """The most shared memory one block may opt in to on device ``ordinal`` (bytes)."""
        return self.attribute(ordinal, _SMEM_OPTIN)


_devices = Devices()


def use(devices: Devices) -> Devices:
    """THE way a test substitutes the CUDA driver: ``before = use(Devices(fake))``, then ``use(before)``.

    From then on every device fact (here and in ``cubinstore.ops``) is asked of ``fake``, and the
    loader and launcher make every driver call through it (``current().driver``): a ``Library``
    loads and launches through the fake. ``fake`` needs only what the code under test asks, by the
    names of ``cubinstore._driver.cuda``: ``device_count`` and ``device_attribute`` for facts;
    ``current_device`` for a kernel on the current device; ``on_device``, ``load_library`` and
    ``library_function`` for a load (``driver_version`` when it models the driver's version: see
    ``Devices.driver_version``; where ``on_device`` and ``library_function`` are
    ``cubinstore._driver.cuda``'s own, as in a copy of that module with other calls replaced, a
    load is one call of its ``load_functions``, which still calls the fake's ``load_library``);
    ``param_info`` for the layout check of a first launch; then
    ``driver``, ``check``, ``pointer_device``, ``primary_context`` and ``function_attribute`` for
    launches. A fresh ``Devices`` has loaded nothing (the loader keeps its modules per ``Devices``),
    as a new process: ``use(Devices())`` over the real driver gives a fresh load. Returns the
    ``Devices`` it replaces. Kernels already loaded keep the driver they were loaded through.
    """
    global _devices
    before, _devices = _devices, devices
    return before


def current() -> Devices:
    """The ``Devices`` in use: its facts, and (``.driver``) the driver the loader and launcher call."""
    return _devices


def checked(ordinal: Any) -> tuple[Devices, int, tuple[int, int]]:
    """The ``Devices`` in use, ``ordinal`` checked (``check_ordinal``; None: the driver's current device)
    and its compute capability: what every ``Library.kernel`` asks first, in one call where a first
    load made two (issue 31)."""
    devices = _devices
    if ordinal is None:
        ordinal = devices.driver.current_device()
    count = devices._count
    if type(ordinal) is int and count is not None and 0 <= ordinal < count:  # a device seen before: no call
        cc = devices._capabilities.get(ordinal)
        if cc is not None:
            return devices, ordinal, cc
    ordinal = devices.check_ordinal(ordinal)
    return devices, ordinal, devices.compute_capability(ordinal)


def count() -> int:
    return _devices.count()


def check_ordinal(ordinal: Any) -> int:
    return _devices.check_ordinal(ordinal)


def compute_capability(ordinal: int) -> tuple[int, int]:
    return _devices.compute_capability(ordinal)


def sm_count(ordinal: int) -> int:
    return _devices.sm_count(ordinal)


def shared_mem_optin(ordinal: int) -> int:
    return _devices.shared_mem_optin(ordinal)
