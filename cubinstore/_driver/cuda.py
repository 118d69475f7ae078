"""Lazy CUDA driver access: initialise once under a lock, wrap every call's result.

Nothing here runs at import: `cuda.bindings` is imported on the first call, so `import
cubinstore` works on a machine without a GPU or driver. Every driver failure becomes a
`CudaError` naming the call and what it was for. Device facts that cannot change are cached
once, in `cubinstore._driver.device`; the queries here ask the driver each time.

The functions below (with `driver` and `check`) are what the layers above ask of a driver: the
loader and launcher reach them through `cubinstore._driver.device.Devices.driver`, which is this
module unless a test substitutes a fake through `cubinstore._driver.device.use`. A first load is
`load_functions`: `on_device`, `load_library` and `library_function` of every entry in one call.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from cubinstore._core import native
from cubinstore._core.abi import MAX_PARAMS
from cubinstore._core.log import get_logger
from cubinstore.errors import CudaError

logger = get_logger(__name__)

_lock = threading.Lock()
_driver: ModuleType | None = None
_init_error: str | None = None
_primary: dict[int, int] = {}  # device ordinal -> retained primary context handle
_success: Any = None  # CUresult.CUDA_SUCCESS once the driver is initialised: the hot paths compare with it
# The compiled helper's load_functions (cubinstore._core.native) and the CUresult it takes for a missing
# entry point: set with the real driver where the helper was built, None under a test's bindings.
_native_load: Any = None
_not_found = 0
# The helper's launch and the bindings' ids of the two launch attributes it packs (launch_config): set
# with the real driver where the helper was built, None under a test's bindings.
_native_launch: Any = None
_attribute_ids = (-1, -1)  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, ..._PROGRAMMATIC_STREAM_SERIALIZATION


@contextmanager
def use_bindings(bindings: Any, *, success: Any, primary: dict[int, int]) -> Iterator[None]:
    """Within the block, this module's functions call `bindings` (initialised, its `success` the
    CUresult of success, `primary` the retained primary contexts by ordinal) instead of
    `cuda.bindings.driver`; the real state again after it. For tests of these wrappers on a host
    without a GPU: a fake of the whole driver goes in through `device.use(Devices(fake))`."""
    global _driver, _success, _primary, _native_load, _native_launch
    with _lock:
        saved = _driver, _success, _primary, _native_load, _native_launch
        _driver, _success, _primary, _native_load, _native_launch = bindings, success, dict(primary), None, None
    try:
        yield
    finally:
        with _lock:
            _driver, _success, _primary, _native_load, _native_launch = saved


def native_load() -> Any:
    """The compiled helper's ``load_functions`` that ``load_functions`` calls (None: its calls are
    made from Python): set with the real driver where the helper was built."""
    driver()
    return _native_load


@contextmanager
def using_native_load(load: Any) -> Iterator[None]:
    """Within the block, ``load_functions`` makes a first load's driver calls through ``load`` (the
    helper's function or a wrapper with its signature), or from Python where None; the process's
    choice again after it. For benchmarks and tests that compare or count the two."""
    global _native_load
    driver()
    with _lock:
        saved = _native_load
        _native_load = load
    try:
        yield
    finally:
        with _lock:
            _native_load = saved


def native_launch() -> Any:
    """The compiled helper's ``launch`` (see ``cubinstore._core._native``) for launches through the real
    driver, or None: then launches call ``cuLaunchKernelEx`` from Python. Its config comes from
    ``launch_config``."""
    driver()
    return _native_launch


@contextmanager
def using_native_launch(launch: Any) -> Iterator[None]:
    """Within the block, launches prepared (and ``Kernel.launch`` calls made) go through ``launch`` (the
    helper's function or a wrapper with its signature), or through the bindings where None; the
    process's choice again after it. For benchmarks and tests that compare or count the two."""
    global _native_launch
    driver()
    with _lock:
        saved = _native_launch
        _native_launch = launch
    try:
        yield
    finally:
        with _lock:
            _native_launch = saved


def launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                  cluster: tuple[int, int, int] | None, pdl: bool) -> bytes:
    """A launch's geometry and attributes packed for the helper's ``launch`` (where ``native_launch``)."""
    cluster_id, pdl_id = _attribute_ids
    return native.built().launch_config(grid, block, shared_mem, cluster, cluster_id, pdl_id if pdl else -1)  # type: ignore[union-attr]


def driver() -> ModuleType:
    """`cuda.bindings.driver`, with `cuInit` done exactly once (thread-safe)."""
    global _driver, _init_error, _success, _native_load, _not_found, _native_launch, _attribute_ids
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is not None:
            return _driver
        if _init_error is not None:
            raise CudaError(_init_error)
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            _init_error = f"cannot import cuda.bindings.driver: {exc}"
            raise CudaError(_init_error) from exc
        try:
            (err,) = drv.cuInit(0)
        except Exception as exc:  # cuda.pathfinder raises its own type when libcuda is absent
            _init_error = f"cuInit failed: no usable NVIDIA driver ({type(exc).__name__}: {exc})"
            raise CudaError(_init_error) from exc
        if err != drv.CUresult.CUDA_SUCCESS:
            _init_error = f"cuInit failed: {_describe(drv, err)}"
            raise CudaError(_init_error)
        _success = drv.CUresult.CUDA_SUCCESS
        helper = native.helper()
        if helper is not None and helper.bind():  # its driver calls find libcuda's entry points
            _native_load, _not_found = helper.load_functions, int(drv.CUresult.CUDA_ERROR_NOT_FOUND)
            ids = drv.CUlaunchAttributeID
            _native_launch = helper.launch
            _attribute_ids = (int(ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
                              int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION))
        _driver = drv
        logger.debug("CUDA driver initialised")
        return drv


def _describe(drv: ModuleType, err: Any) -> str:
    _, name = drv.cuGetErrorName(err)
    _, text = drv.cuGetErrorString(err)
    name_s = name.decode() if isinstance(name, bytes) else str(err)
    text_s = text.decode() if isinstance(text, bytes) else ""
    return f"{name_s} ({text_s})" if text_s else name_s


def check(result: tuple[Any, ...], what: str) -> Any:
    """Unwrap a `cuda.bindings` result tuple; raise `CudaError` naming `what` on failure."""
    drv = driver()
    err, *values = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what}: {_describe(drv, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def available() -> tuple[bool, str]:
    """Whether a CUDA device can be used here, and if not, why (for test skips)."""
    try:
        count = device_count()
    except CudaError as exc:
        return False, str(exc)
    if count == 0:
        return False, "the CUDA driver reports no devices"
    return True, f"{count} CUDA device(s)"


def device_count() -> int:
    drv = driver()
    return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))


def current_device() -> int:
    """Ordinal of the device whose context is current on this thread, else 0.

    One driver call when that context is a primary context this process retained (every load
    and launch retains one): it is known by its handle, and a retained context is never destroyed
    or reused. Otherwise the driver is asked which device the context is on.
    """
    drv = driver()
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    handle = 0 if ctx is None else int(ctx)
    if handle == 0:
        return 0
    for ordinal, primary in list(_primary.items()):
        if primary == handle:
            return ordinal
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def device_attribute(ordinal: int, name: str) -> int:
    drv = driver()
    attr = getattr(drv.CUdevice_attribute, name)
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name}) on device {ordinal}"))


def primary_context(ordinal: int) -> int:
    """Retain (once per process) and return the device's primary context: the one torch and CuPy use."""
    handle = _primary.get(ordinal)
    if handle is not None:
        return handle
    drv = driver()
    with _lock:
        handle = _primary.get(ordinal)
        if handle is None:
            dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain on device {ordinal}")
            handle = int(ctx)
            _primary[ordinal] = handle
    return handle


class on_device:  # noqa: N801 -- used as `with on_device(n):`, as the function it replaced
    """Make the device's primary context current, and restore the caller's afterwards.

    Restoring matters: the runtime (torch, CuPy) reads its current device from
    the thread's current context, so a launch must not move it. A class, not a generator
    context manager: every load and launch enters one, and this makes no generator and
    wrapper object each time (no difference measurable in a whole load on the H200).
    """

    __slots__ = ("_ordinal", "_before")

    def __init__(self, ordinal: int) -> None:
        self._ordinal = ordinal
        self._before: int | None = None  # the caller's context, where it had to be switched

    def __enter__(self) -> None:
        drv = driver()
        want = primary_context(self._ordinal)
        err, before = drv.cuCtxGetCurrent()
        if err != _success:
            check((err,), "cuCtxGetCurrent")
        before_handle = 0 if before is None else int(before)
        if before_handle != want:
            check(drv.cuCtxSetCurrent(drv.CUcontext(want)), f"cuCtxSetCurrent to device {self._ordinal}")
            self._before = before_handle

    def __exit__(self, *exc_info: object) -> None:
        before, self._before = self._before, None
        if before is not None:
            drv = driver()
            check(drv.cuCtxSetCurrent(drv.CUcontext(before)), "cuCtxSetCurrent (restore)")


def pointer_device(address: int) -> int | None:
    """Device ordinal owning a device pointer, or None when the driver doesn't know it."""
    drv = driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, value = drv.cuPointerGetAttribute(attr, address)
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    return int(value)


def load_library(data: bytes, what: object) -> int:
    """Load a CUBIN from memory (`cuLibraryLoadData`); returns the CUlibrary handle. `what` names it
    in errors (its `str()`, taken only for one).

    The driver reads exactly these bytes: the caller verified them, and keeps them
    referenced for as long as the library lives.
    """
    drv = driver()
    err, library = drv.cuLibraryLoadData(data, None, None, 0, None, None, 0)
    if err != _success:
        check((err,), f"cuLibraryLoadData for {what}")
    return int(library)


def library_function(library: int, entry: str, what: object) -> int | None:
    """The CUfunction of `entry` in the current context, or None when the CUBIN has no such kernel;
    `what` names the library (errors add the entry)."""
    drv = driver()
    err, kernel = drv.cuLibraryGetKernel(drv.CUlibrary(library), entry.encode("ascii"))
    if err != _success:
        if err == drv.CUresult.CUDA_ERROR_NOT_FOUND:
            return None
        check((err,), f"cuLibraryGetKernel({entry!r}) for {what}")
    err, func = drv.cuKernelGetFunction(kernel)
    if err != _success:
        check((err,), f"cuKernelGetFunction({entry!r}) for {what}")
    return int(func)


def load_functions(data: bytes, entries: Iterable[str], ordinal: int, what: object) -> tuple[int, list[int | None]]:
    """``with on_device(ordinal)``: ``load_library(data, what)``, then ``library_function`` of each
    entry, in one call: the loader's path for every first load (a load is three to four driver calls,
    and Python calls between them cost more than usual, the CPU's caches cold after each).

    Returns the CUlibrary handle and each entry's CUfunction, in order, the list ending at the
    first entry the CUBIN lacks with a None (the caller names the kernel). Errors are worded as the
    separate calls word them. With the real driver and the compiled helper (``cubinstore._core.native``)
    the same driver calls are one call from Python.
    """
    drv = _driver if _driver is not None else driver()
    want = _primary.get(ordinal)
    if want is None:
        want = primary_context(ordinal)
    load = _native_load
    if load is not None:  # the same calls in C, in one call
        entries = tuple(entries)
        got = load(data, entries, want, _not_found)
        if got.__class__ is tuple:
            return got
        # A driver error (the library unloaded, the context restored), or libcuda not loaded in this
        # process: the calls below make the same calls again, and word what fails.
    err, before = drv.cuCtxGetCurrent()  # on_device, inlined
    if err != _success:
        check((err,), "cuCtxGetCurrent")
    before_handle = 0 if before is None else int(before)
    switch = before_handle != want
    if switch:
        check(drv.cuCtxSetCurrent(drv.CUcontext(want)), f"cuCtxSetCurrent to device {ordinal}")
    try:
        err, library = drv.cuLibraryLoadData(data, None, None, 0, None, None, 0)
        if err != _success:
            check((err,), f"cuLibraryLoadData for {what}")
        functions: list[int | None] = []
        for entry in entries:  # library_function, inlined
            err, kernel = drv.cuLibraryGetKernel(library, entry.encode("ascii"))
            if err != _success:
                if err == drv.CUresult.CUDA_ERROR_NOT_FOUND:
                    functions.append(None)
                    break
                check((err,), f"cuLibraryGetKernel({entry!r}) for {what}")
            err, func = drv.cuKernelGetFunction(kernel)
            if err != _success:
                check((err,), f"cuKernelGetFunction({entry!r}) for {what}")
            functions.append(int(func))
        return int(library), functions
    finally:
        if switch:
            check(drv.cuCtxSetCurrent(drv.CUcontext(before_handle)), "cuCtxSetCurrent (restore)")


def function_attribute(func: int, name: str, what: str) -> int:
    drv = driver()
    attr = getattr(drv.CUfunction_attribute, name)
    return int(check(drv.cuFuncGetAttribute(attr, drv.CUfunction(func)), f"cuFuncGetAttribute({name}) for {what}"))


def param_info(func: int, what: str) -> list[tuple[int, int]]:
    """The function's real (offset, size) per parameter, from `cuFuncGetParamInfo`."""
    drv = driver()
    function = drv.CUfunction(func)
    out: list[tuple[int, int]] = []
    for index in range(MAX_PARAMS):  # no kernel has more: the loop ends at the driver's INVALID_VALUE
        err, offset, size = drv.cuFuncGetParamInfo(function, index)
        if err == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
            break  # index is past the last parameter
        check((err,), f"cuFuncGetParamInfo({index}) for {what}")
        out.append((int(offset), int(size)))
    return out


def driver_version() -> int:
    """The CUDA version the driver supports, as `cuDriverGetVersion` reports it (13000 is CUDA 13.0).

    `cubinstore._driver.device.Devices.driver_version` asks it once per process."""
    drv = driver()
    return int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))


def versions() -> dict[str, str]:
    """Versions of the CUDA Python packages and the driver, for logs and benchmarks."""
    out: dict[str, str] = {}
    for name in ("cuda.bindings", "cuda.core"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            out[name] = f"not importable: {exc}"
            continue
        out[name] = str(getattr(module, "__version__", "unknown"))
    try:
        drv = driver()
        out["driver"] = str(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    except CudaError as exc:
        out["driver"] = f"unavailable: {exc}"
    return out
