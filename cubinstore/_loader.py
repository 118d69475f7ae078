"""Fetch, verify and load CUBINs into the driver, once per (digest, device).

The loader half of the runtime (`launch.py` is the launcher): a module is loaded
from the exact in-memory bytes the store verified, after its ELF header is
checked against the manifest's arch, and each entry's parameter layout is
checked against the CUBIN's before it can be launched.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from cubinstore._core import abi as _abi
from cubinstore._driver import cuda as _cuda
from cubinstore._core.abi import Arch
from cubinstore._args import ParamSlot, check_layout
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore.errors import IncompatibleArchError, ManifestError
from cubinstore.manifest import KernelSpec

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = ["is_loaded", "load", "check_function_layout", "loaded_module_count"]

logger = get_logger(__name__)

# Above this a function must opt in through CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
_DEFAULT_DYNAMIC_SMEM: Final = 48 * 1024
_MAX_PARAMS: Final = 8192  # 32 KiB of parameter space holds at most 8191 4-byte parameters


@dataclass
class _Function:
    """One entry of a loaded module on one device."""

    handle: int  # CUfunction in the device's primary context
    what: str  # "kernel <id> (<digest>) entry <symbol> on device <n>", for errors
    lock: threading.Lock = field(default_factory=threading.Lock)
    dynamic_smem_limit: int = _DEFAULT_DYNAMIC_SMEM
    non_portable_cluster: bool = False
    # (declared types, offsets) -> checked layout; one digest may be named by several manifests.
    layouts: dict[tuple[Any, ...], tuple[ParamSlot, ...]] = field(default_factory=dict)
    _static_smem: int | None = None

    @property
    def static_smem(self) -> int:
        """Static shared memory in bytes, asked of the driver when first needed (a launch over 48 KiB)."""
        if self._static_smem is None:
            self._static_smem = _cuda.function_attribute(self.handle, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", self.what)
        return self._static_smem


@dataclass
class _Module:
    """A CUBIN loaded on one device: its CUlibrary and its entries' functions."""

    digest: Digest
    device: int
    code: tuple[int, bytes]  # the CUlibrary handle and the verified bytes it was loaded from; never unloaded
    functions: dict[str, _Function]
    load_seconds: float


# Keyed by (hex digest, ordinal): a str hashes in C, a Digest through a Python call.
_modules: dict[tuple[str, int], _Module] = {}
_modules_lock = threading.Lock()
_key_locks: dict[tuple[str, int], threading.Lock] = {}


def _key_lock(key: tuple[str, int]) -> threading.Lock:
    lock = _key_locks.get(key)  # one per (digest, device), made once
    if lock is None:
        with _modules_lock:
            lock = _key_locks.setdefault(key, threading.Lock())
    return lock


def loaded_module_count() -> int:
    """How many (digest, device) modules this process has loaded (for tests and benchmarks)."""
    with _modules_lock:
        return len(_modules)


def is_loaded(digest: Digest | str, device: int) -> bool:
    """Whether the CUBIN `digest` is loaded on `device` in this process."""
    with _modules_lock:
        return (Digest.parse(digest).hex, device) in _modules


def load(spec: KernelSpec, ordinal: int, cc: tuple[int, int], store: Store) -> _Module:
    """The module of `spec` on `ordinal`, fetched, verified and loaded at most once."""
    key = (spec.digest.hex, ordinal)
    module = _modules.get(key)
    if module is not None:
        return module
    with _key_lock(key):
        module = _modules.get(key)
        if module is not None:
            return module
        # The one path to the driver's loader: refuse a CUBIN the device cannot run before
        # it is fetched or any byte reaches the driver, with an error naming both archs.
        arch = Arch.parse(spec.arch)  # cached per arch string
        if not arch.runs_on(cc):
            raise IncompatibleArchError(
                f"kernel {spec.id!r} ({spec.digest}) is built for {spec.arch}, "
                f"device {ordinal} has compute capability {cc[0]}.{cc[1]}; it was not loaded"
            )
        started = time.perf_counter()
        data = store.get(spec.digest, spec.size, name=spec.id)
        fetched = time.perf_counter()
        what = f"kernel {spec.id!r} ({spec.digest})"  # every message below names the kernel so
        if len(data) != spec.size:
            raise ManifestError(f"{what}: expected {spec.size} bytes, the store returned {len(data)}")
        _check_cubin_header(spec, data, what)
        module = _load_module(spec, bytes(data), ordinal, what)
        module.load_seconds = time.perf_counter() - fetched
        if logger.isEnabledFor(logging.DEBUG):  # its arguments cost more than the check
            logger.debug(
                "loaded %s (%s) on device %d: fetch+verify %.3f ms, load %.3f ms",
                spec.id, spec.digest.short, ordinal, (fetched - started) * 1e3, module.load_seconds * 1e3,
            )
        with _modules_lock:
            _modules[key] = module
        return module


def _check_cubin_header(spec: KernelSpec, data: bytes, what: str | None = None) -> None:
    """The bytes must be a CUDA ELF built for the SM the manifest names; ``what`` names the kernel."""
    what = what or f"kernel {spec.id!r} ({spec.digest})"
    sm = _abi.CubinImage(data, what).sm
    arch = Arch.parse(spec.arch)  # cached per arch string
    if sm is not None and sm != arch.major * 10 + arch.minor:
        raise ManifestError(f"{what}: manifest says {spec.arch}, the CUBIN's ELF header says sm_{sm}")


def _load_module(spec: KernelSpec, data: bytes, ordinal: int, what: str) -> _Module:
    """Load ``data`` on ``ordinal`` and get each entry's function; ``what`` names the kernel in errors."""
    started = time.perf_counter()
    functions: dict[str, _Function] = {}
    on = f" on device {ordinal}"
    with _cuda.on_device(ordinal):
        library = _cuda.load_library(data, what + on)
        for entry in spec.entries:
            where = f"{what} entry {entry!r}{on}"
            func = _cuda.library_function(library, entry, where)
            if func is None:
                raise ManifestError(f"{where}: the manifest declares it, the CUBIN has no such function")
            functions[entry] = _Function(handle=func, what=where)
    return _Module(spec.digest, ordinal, (library, data), functions, time.perf_counter() - started)


def _param_info(fn: _Function, spec: KernelSpec, entry: str) -> list[tuple[int, int]]:
    """The CUBIN's real (offset, size) per parameter, from `cuFuncGetParamInfo`."""
    drv = _cuda.driver()
    func = drv.CUfunction(fn.handle)
    out: list[tuple[int, int]] = []
    for index in range(_MAX_PARAMS):
        err, offset, size = drv.cuFuncGetParamInfo(func, index)
        if err == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
            break  # index is past the last parameter
        _cuda.check((err,), f"cuFuncGetParamInfo({index}) for kernel {spec.id!r} entry {entry!r}")
        out.append((int(offset), int(size)))
    return out


def check_function_layout(spec: KernelSpec, symbol: str, fn: _Function, ordinal: int) -> tuple[ParamSlot, ...]:
    entry = spec.entry_specs[symbol]
    key = (entry.types, entry.offsets)
    with fn.lock:
        layout = fn.layouts.get(key)
        if layout is None:
            with _cuda.on_device(ordinal):
                actual = _param_info(fn, spec, symbol)
            layout = check_layout(spec.id, entry.name, entry.types, actual, spec.arch, entry.offsets)
            fn.layouts[key] = layout
        return layout
