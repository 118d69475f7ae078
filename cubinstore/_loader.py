"""Fetch, verify and load CUBINs into the driver, once per (digest, device).

The loader half of the runtime (`launch.py` is the launcher): a module is loaded
from the exact in-memory bytes the store verified, after its ELF header is
checked against the manifest's arch, and each entry's parameter layout is
checked against the CUBIN's before it can be launched.

Two branches kept apart from the hot path in helpers: a kernel whose manifest names the oldest
driver that loads it is refused on an older driver before anything is fetched (`_check_driver`);
and PTX (arch `compute_...`, selected only where no CUBIN runs) is checked as PTX text for its
target and handed to the driver NUL-terminated, which JIT-compiles it once per process and
device (`_load_ptx`, counted by `load_stats`).

Every driver call goes through the driver of the `cubinstore._driver.device.Devices` in use,
and the loaded modules are kept per `Devices`: a test's fake driver (`device.use`) loads into
its own cache, and the real driver's is untouched.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NoReturn

from cubinstore._args import ParamSlot, check_layout
from cubinstore._core.abi import Arch
from cubinstore._core.cubin import header_is, header_problem, header_sm
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore._driver import cuda as _cuda
from cubinstore._driver import device as _device
from cubinstore.errors import CubinFormatError, DriverVersionError, IncompatibleArchError, ManifestError
from cubinstore.manifest import KernelSpec
from cubinstore.manifest import ptx as _ptx
from cubinstore.manifest.toolkit import describe_driver

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = ["LoadStats", "is_loaded", "load", "check_function_layout", "load_stats", "loaded_module_count"]

logger = get_logger(__name__)

# Above this a function must opt in through CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
_DEFAULT_DYNAMIC_SMEM: Final = 48 * 1024

# (arch string, compute capability) -> the SM number a CUBIN of that arch must name in its ELF header,
# or -1 for PTX: an arch seen to run on a device is not parsed and checked again (a per-process fact).
_runnable: dict[tuple[str, tuple[int, int]], int] = {}


class _Function:
    """One entry of a loaded module on one device. (A slotted class, not a dataclass: every first
    load makes one per entry, and a dataclass's field factories cost more than the rest of it.)"""

    __slots__ = ("handle", "_what", "cuda", "lock", "dynamic_smem_limit", "non_portable_cluster", "layout_arch",
                 "layouts", "_static_smem")

    def __init__(self, handle: int, what: str | tuple[KernelSpec, str, int], cuda: Any) -> None:
        self.handle = handle  # CUfunction in the device's primary context
        # "kernel <id> (<digest>) entry <symbol> on device <n>", for errors: built when first needed
        # from (the spec, the symbol, the ordinal)
        self._what = what
        self.cuda = cuda  # the driver it was loaded through (`cubinstore._driver.cuda`, or a test's fake)
        self.lock = threading.Lock()
        self.dynamic_smem_limit = _DEFAULT_DYNAMIC_SMEM
        self.non_portable_cluster = False
        # PTX: the device's arch, whose layout rule the driver's JIT followed (the manifest's offsets are its target's).
        self.layout_arch: Arch | None = None
        # (declared types, offsets) -> checked layout; one digest may be named by several manifests.
        self.layouts: dict[tuple[Any, ...], tuple[ParamSlot, ...]] = {}
        self._static_smem: int | None = None

    @property
    def what(self) -> str:
        what = self._what
        if not isinstance(what, str):
            spec, symbol, ordinal = what
            self._what = what = f"{_what(spec)} entry {symbol!r} on device {ordinal}"
        return what

    @property
    def static_smem(self) -> int:
        """Static shared memory in bytes, asked of the driver when first needed (a launch over 48 KiB)."""
        if self._static_smem is None:
            self._static_smem = self.cuda.function_attribute(self.handle, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", self.what)
        return self._static_smem


class _Module:
    """A CUBIN loaded on one device: its CUlibrary and its entries' functions."""

    __slots__ = ("digest", "device", "code", "functions", "load_seconds", "ptx")

    def __init__(self, digest: Digest, device: int, code: tuple[int, bytes], functions: dict[str, _Function],
                 load_seconds: float, ptx: bool = False) -> None:
        self.digest = digest
        self.device = device
        self.code = code  # the CUlibrary handle and the verified bytes it was loaded from; never unloaded
        self.functions = functions
        self.load_seconds = load_seconds
        self.ptx = ptx  # PTX the driver JIT-compiled at load (no CUBIN of the point runs on the device)


class _Loaded:
    """The modules loaded through one `Devices` (one driver), keyed by (hex digest, ordinal): a str
    hashes in C, a Digest through a Python call."""

    def __init__(self) -> None:
        self.modules: dict[tuple[str, int], _Module] = {}
        self.lock = threading.Lock()
        self.key_locks: dict[tuple[str, int], threading.Lock] = {}
        self.ptx: list[tuple[str, float]] = []  # (kernel id, load seconds) of each PTX module, for load_stats


# One per Devices, dropped with it (a test's fake); the last one asked for is found without a lookup.
_loaded: weakref.WeakKeyDictionary[_device.Devices, _Loaded] = weakref.WeakKeyDictionary()
_loaded_lock = threading.Lock()
_last: tuple[_device.Devices, _Loaded] | None = None


def _loaded_for(devices: _device.Devices) -> _Loaded:
    last = _last
    if last is not None and last[0] is devices:
        return last[1]
    return _loaded_slow(devices)


def _loaded_slow(devices: _device.Devices) -> _Loaded:
    global _last
    with _loaded_lock:
        loaded = _loaded.get(devices)
        if loaded is None:
            loaded = _loaded[devices] = _Loaded()
        _last = (devices, loaded)
    return loaded


def loaded_module_count() -> int:
    """How many (digest, device) modules this process has loaded through the driver in use (for tests
    and benchmarks)."""
    loaded = _loaded_for(_device.current())
    with loaded.lock:
        return len(loaded.modules)


def loaded_libraries() -> list[int]:
    """The CUlibrary handles of the modules loaded through the driver in use: for a benchmark that
    unloads them (and then swaps in a fresh ``Devices``) to time first loads again. The loader itself
    never unloads: its kernels hold their functions for the life of the process."""
    loaded = _loaded_for(_device.current())
    with loaded.lock:
        return [int(module.code[0]) for module in loaded.modules.values()]


@dataclass(frozen=True)
class LoadStats:
    """What this process loaded through the driver in use (``load_stats``)."""

    modules: int  # (digest, device) modules loaded
    ptx: tuple[str, ...]  # the ids of those that were PTX, JIT-compiled by the driver at load, in load order
    ptx_seconds: float  # the time their loads took (the driver's JIT compile, mostly)


def load_stats() -> LoadStats:
    """Counts of the modules this process loaded through the driver in use, PTX ones apart."""
    loaded = _loaded_for(_device.current())
    with loaded.lock:
        modules = list(loaded.modules.values())
        ptx = list(loaded.ptx)
    return LoadStats(len(modules), tuple(i for i, _ in ptx), sum(t for _, t in ptx))


def is_loaded(digest: Digest | str, device: int) -> bool:
    """Whether the CUBIN `digest` is loaded on `device` in this process (through the driver in use)."""
    loaded = _loaded_for(_device.current())
    with loaded.lock:
        return (Digest.parse(digest).hex, device) in loaded.modules


def load(spec: KernelSpec, ordinal: int, cc: tuple[int, int], store: Store,
         devices: _device.Devices | None = None) -> _Module:
    """The module of `spec` on `ordinal`, fetched, verified and loaded at most once through the
    driver of `devices` (default: the `Devices` in use).

    Every first load of a process passes here, between driver calls that leave the CPU's caches
    cold: so the common case (a CUBIN whose arch was seen before, the real driver) is one straight
    line of few calls, and anything else takes a helper that words what went wrong.
    """
    if devices is None:
        devices = _device.current()
    last = _last  # _loaded_for, inlined: this is every Library.kernel() call
    loaded = last[1] if last is not None and last[0] is devices else _loaded_slow(devices)
    digest = spec.digest
    key = (digest.hex, ordinal)
    module = loaded.modules.get(key)
    if module is not None:
        return module
    lock = loaded.key_locks.get(key)  # one per (digest, device), made once
    if lock is None:
        with loaded.lock:
            lock = loaded.key_locks.setdefault(key, threading.Lock())
    with lock:
        module = loaded.modules.get(key)
        if module is not None:
            return module
        # The one path to the driver's loader: refuse a CUBIN the device cannot run before
        # it is fetched or any byte reaches the driver, with an error naming both archs.
        sm = _runnable.get((spec.arch, cc))  # the SM its ELF header must name (-1: PTX), once per arch
        if sm is None:
            sm = _check_arch(spec, ordinal, cc)
        need = spec.min_driver
        if need is not None:
            known = devices.known_driver_version  # Devices' one cache, read without a call once asked
            host = known[0] if known is not None else devices.driver_version()
            if host is not None and host < need:
                _refuse_driver(spec, need, host)
        debug = logger.isEnabledFor(logging.DEBUG)
        started = time.perf_counter() if debug else 0.0
        size = spec.size
        data = store.get(digest, size, name=spec.id)
        fetched = time.perf_counter()
        # Every message below names the kernel (_what): built only for an error, not per load.
        if len(data) != size:
            raise ManifestError(f"{_what(spec)}: expected {size} bytes, the store returned {len(data)}")
        if data.__class__ is not bytes:
            data = bytes(data)  # the driver gets an immutable copy of the verified bytes
        if sm < 0:
            module = _load_ptx(devices.driver, spec, data, ordinal, cc)
        else:
            # _check_cubin_header's accepting case in one call; anything else gets the full check,
            # which words the error.
            if not header_is(data, sm):
                _check_cubin_header(spec, data)
            cuda = devices.driver
            if (cuda.on_device is _cuda.on_device and cuda.load_library is _cuda.load_library
                    and cuda.library_function is _cuda.library_function):
                # The real driver's context guard and calls: one call loads the module and gets every
                # entry's function. Any of them swapped (a test's fake): call by call, below.
                library, handles = _cuda.load_functions(data, spec.symbols, ordinal, _Where((spec, ordinal)))
                functions: dict[str, _Function] = {}
                for entry, func in zip(spec.symbols, handles):
                    if func is None:
                        _no_function(spec, entry, ordinal)
                    functions[entry] = _Function(func, (spec, entry, ordinal), cuda)
                module = _Module(digest, ordinal, (library, data), functions, 0.0)  # timed below
            else:
                module = _load_module(cuda, spec, data, ordinal)
        module.load_seconds = time.perf_counter() - fetched
        if debug:
            logger.debug(
                "loaded %s (%s) on device %d: fetch+verify %.3f ms, load %.3f ms",
                spec.id, digest.short, ordinal, (fetched - started) * 1e3, module.load_seconds * 1e3,
            )
        with loaded.lock:
            loaded.modules[key] = module
            if sm < 0:
                loaded.ptx.append((spec.id, module.load_seconds))
        if sm < 0:  # `cubinstore stats` shows it too, across processes
            local = getattr(store, "local", None)
            if local is not None:
                local.add_stats({"ptx_loads": 1})
        return module


def _check_arch(spec: KernelSpec, ordinal: int, cc: tuple[int, int]) -> int:
    """``load``'s arch check where ``spec.arch`` was not seen to run on ``cc`` before: the SM number its
    ELF header must name (-1 for PTX), remembered for the process; else ``IncompatibleArchError``."""
    ptx = spec.arch.startswith(_ptx.PTX_PREFIX)  # cubinstore.manifest.ptx.is_ptx, inlined
    arch = _ptx.PtxArch.parse(spec.arch) if ptx else Arch.parse(spec.arch)  # cached per arch string
    if not arch.runs_on(cc):
        raise IncompatibleArchError(
            f"kernel {spec.id!r} ({spec.digest}) is built for {spec.arch}, "
            f"device {ordinal} has compute capability {cc[0]}.{cc[1]}; it was not loaded"
        )
    sm = -1 if ptx else arch.sm  # type: ignore[union-attr]
    _runnable[(spec.arch, cc)] = sm
    return sm


def _no_function(spec: KernelSpec, entry: str, ordinal: int) -> NoReturn:
    raise ManifestError(f"{_what(spec)} entry {entry!r} on device {ordinal}: the manifest declares it, "
                        "the CUBIN has no such function")


def _what(spec: KernelSpec) -> str:
    """How every load error names the kernel."""
    return f"kernel {spec.id!r} ({spec.digest})"


def _refuse_driver(spec: KernelSpec, need: int, host: int) -> None:
    """Refuse ``spec``: the host's driver (``host``, as ``cuDriverGetVersion`` says) is older than
    ``need``, its manifest's ``min_driver``."""
    kind = "as PTX, which the driver compiles, it" if spec.arch.startswith(_ptx.PTX_PREFIX) else "it"
    raise DriverVersionError(
        f"kernel {spec.id!r} ({spec.digest}) was built by CUDA toolkit {spec.toolkit} and {kind} needs a driver "
        f"of {describe_driver(need)}; this host's driver supports CUDA {host // 1000}.{host % 1000 // 10} "
        f"(cuDriverGetVersion {host}): update the NVIDIA driver. Nothing was fetched or loaded"
    )


def _load_ptx(cuda: Any, spec: KernelSpec, data: bytes, ordinal: int, cc: tuple[int, int]) -> _Module:
    """Load verified PTX: checked as PTX text for its target, NUL-terminated (``cuLibraryLoadData`` reads
    PTX up to its NUL), JIT-compiled by the driver for device ``ordinal``; said in a log line."""
    what = _what(spec)
    _ptx.check_text(data, spec.arch, what)
    logger.warning(
        "%s: no CUBIN of it runs on device %d (compute capability %d.%d); the driver JIT-compiles its PTX %s "
        "once in this process (build the family for sm_%d%d to skip this)",
        what, ordinal, cc[0], cc[1], spec.arch, cc[0], cc[1],
    )
    module = _load_module(cuda, spec, data + b"\0", ordinal)
    device_arch = Arch(cc[0], cc[1], "")
    for fn in module.functions.values():
        fn.layout_arch = device_arch
    module.ptx = True
    return module


def _check_cubin_header(spec: KernelSpec, data: bytes) -> None:
    """The bytes must be a CUDA ELF built for the SM the manifest names."""
    problem = header_problem(data)
    if problem is not None:
        raise CubinFormatError(f"{_what(spec)}: {problem}")
    sm = header_sm(data)
    arch = Arch.parse(spec.arch)  # cached per arch string
    if sm is not None and sm != arch.sm:
        raise ManifestError(f"{_what(spec)}: manifest says {spec.arch}, the CUBIN's ELF header says sm_{sm}")


class _Where(tuple):  # type: ignore[type-arg]
    """"kernel <id> (<digest>) on device <n>" for the driver's error messages, worded only when one
    is (an f-string of the digest costs about a microsecond, and every load passes one). Made as
    ``_Where((spec, ordinal))``: a tuple, so making one runs no Python code."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{_what(self[0])} on device {self[1]}"


def _load_module(cuda: Any, spec: KernelSpec, data: bytes, ordinal: int) -> _Module:
    """Load ``data`` on ``ordinal`` through the driver ``cuda`` and get each entry's function, call by
    call (``on_device``, ``load_library``, ``library_function``): PTX, and a test's fake driver."""
    started = time.perf_counter()
    functions: dict[str, _Function] = {}
    where = _Where((spec, ordinal))  # the driver's messages add the entry
    with cuda.on_device(ordinal):
        library = cuda.load_library(data, where)
        for entry in spec.symbols:
            func = cuda.library_function(library, entry, where)
            if func is None:
                _no_function(spec, entry, ordinal)
            functions[entry] = _Function(func, (spec, entry, ordinal), cuda)
    return _Module(spec.digest, ordinal, (library, data), functions, time.perf_counter() - started)


def check_function_layout(spec: KernelSpec, symbol: str, fn: _Function, ordinal: int) -> tuple[ParamSlot, ...]:
    """The entry's checked layout: the manifest's declared parameters against the CUBIN's real
    ones (`cuFuncGetParamInfo`), once per declaration; `ParamLayoutError` when they differ."""
    entry = spec.entry_specs[symbol]
    key = (entry.types, entry.offsets)
    with fn.lock:
        layout = fn.layouts.get(key)
        if layout is None:
            with fn.cuda.on_device(ordinal):
                actual = fn.cuda.param_info(fn.handle, f"kernel {spec.id!r} entry {symbol!r}")
            if fn.layout_arch is not None:  # PTX: laid out for the device by the driver's JIT, by the same rule
                layout = check_layout(spec.id, entry.name, entry.types, actual, fn.layout_arch)
            else:
                layout = check_layout(spec.id, entry.name, entry.types, actual, spec.arch, entry.offsets)
            fn.layouts[key] = layout
        return layout
