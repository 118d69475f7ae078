"""Load verified CUBINs per device and launch their kernels.

    lib = cubinstore.open("bazel-bin/kernels/manifest.json")
    k = lib.kernel("axpy", dtype="f32", vec=4)          # picks sm_90a on an H100/H200
    k.launch("axpy_f32", grid=(blocks,), block=(256,), args=(n, 2.0, x, y))

Nothing touches CUDA until the first `Library.kernel` call. A module is loaded (`_loader.py`)
from the exact in-memory bytes the store verified, once per (digest, device). Device facts come
from the one cache, `cubinstore._driver.device`, and every driver call goes through its driver
(a test substitutes a fake there: `device.use`).
Each entry's parameter layout is checked against the CUBIN's (`cuFuncGetParamInfo`)
at its first launch or prepare, before anything is launched.

The driver is used through `cuda.bindings` alone: the launch needs
`cuLaunchKernelEx` with a packed `kernelParams` array (cuda.core's argument
handler cannot pass a 128-byte `CUtensorMap` by value), and loading goes through
`cuLibraryLoadData` directly because importing cuda.core costs more than a whole
fetch + verify + load (measured on an H200 host: benchmarks/startup.py).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from cubinstore._args import ArgBuffer, pack_args
from cubinstore._core.abi import Arch
from cubinstore._core.digest import Digest
from cubinstore._core.geometry import LaunchGeometry
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore._driver import device as _device
from cubinstore._driver.device import Devices
from cubinstore._loader import LoadStats, _Function, check_function_layout, is_loaded, load, load_stats, loaded_module_count
from cubinstore._release.refs import OCI_PREFIXES, is_path, load_manifest
from cubinstore.errors import (
    BadArgumentError,
    IncompatibleArchError,
    KernelNotFoundError,
)
from cubinstore.manifest import KernelSpec, Manifest

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = ["Kernel", "Library", "LoadStats", "PreparedLaunch", "is_loaded", "load_stats", "loaded_module_count", "open"]

logger = get_logger(__name__)

_PORTABLE_CLUSTER: Final = 8


def open(manifest: str | os.PathLike[str] | Manifest | Digest, store: Store | None = None) -> Library:
    """A `Library` over `manifest`: a path, a `Manifest`, a `sha256:` digest fetched through `store`,
    or `channel:NAME`, the newest release of that channel signed by a key the trust policy allows.

    `store` defaults to `cubinstore.store.default_store()`. Touches no GPU. The reference is
    resolved by `cubinstore._release.refs.load_manifest`, as every CLI command resolves it.
    """
    if store is None and not isinstance(manifest, Manifest) and not is_path(manifest):
        store = _default_store()  # the one the digest is fetched through is the one the kernels are
        if isinstance(manifest, str) and manifest.startswith(OCI_PREFIXES):
            # The registry joins a Store of this Library's own (over the same layers), not the
            # process's default that other callers share.
            store = store.sharing_layers()
    return Library(load_manifest(manifest, store), store)


def _default_store() -> Store:
    from cubinstore.store import default_store  # the store package: on first load, not at import

    return default_store()


class Library:
    """The kernels of one manifest, loaded on demand per device."""

    def __init__(self, manifest: Manifest, store: Store | None = None) -> None:
        self.manifest = manifest
        self._store = store
        self._store_lock = threading.Lock()
        # (id_or_family, compute capability, params) -> the spec select() chose: the manifest never changes.
        self._selected: dict[tuple[Any, ...], KernelSpec] = {}
        self._select = manifest.selector  # Manifest.select less its wrapper's call (every first load selects)

    @property
    def store(self) -> Store:
        with self._store_lock:
            if self._store is None:
                self._store = _default_store()
            return self._store

    def __repr__(self) -> str:
        return f"Library({self.manifest.source!r}, {len(self.manifest)} kernels)"

    def kernel(self, id_or_family: str, *, device: Any = None, jit: bool | None = None, **params: str | int) -> Kernel:
        """The kernel `id_or_family` (exact id, or family narrowed by `params`) loaded on `device`.

        `device` is an ordinal, a `torch.device`, a `cuda.core.Device`, or None for the
        current device. The arch is chosen for that device's compute capability; a CUBIN
        that cannot run there raises `IncompatibleArchError` before the driver sees it. Where
        no CUBIN of the point runs but the family ships PTX that can, the PTX is chosen and the
        driver JIT-compiles it once in the process (a warning says so; `load_stats` counts it).
        A kernel whose manifest names a newer driver than the host's raises `DriverVersionError`.

        A point of a family that the manifest lacks is recorded in the store's warm set and,
        when the family carries a JIT template and run-time compilation is on (`jit`, default
        `CUBINSTORE_JIT`), compiled from the release's own sources under a content key; else
        `KernelNotFoundError` names the nearest points.
        """
        if device is None or device.__class__ is int:  # _device_ordinal's commonest cases, in one call
            devices, ordinal, cc = _device.checked(device)
        else:
            devices = _device.current()
            ordinal = _device_ordinal(devices, device)
            cc = devices.compute_capability(ordinal)
        try:
            key: tuple[Any, ...] | None = (id_or_family, cc, *sorted(params.items())) if params else (id_or_family, cc)
            spec = self._selected.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable value: select() words the error
            key, spec = None, None
        if spec is None:
            try:
                spec = self._select(id_or_family, cc, params)
            except KernelNotFoundError:
                if not params or not self.manifest.find(id_or_family):  # not a point of a known family
                    raise
                spec = self._missing_point(id_or_family, params, cc, jit)
            else:
                if key is not None:
                    self._selected[key] = spec
        module = load(spec, ordinal, cc, self._store if self._store is not None else self.store, devices)
        # Each entry's parameter layout is checked at its first launch or prepare (Kernel._function):
        # a load asks the driver nothing per parameter, and an entry never launched is never checked.
        return Kernel(spec, ordinal, module.functions, module.load_seconds, devices)


    def _missing_point(self, family: str, params: dict[str, str | int], cc: tuple[int, int], jit: bool | None) -> KernelSpec:
        # Imported on the first miss, not with this module (a layer down, so no circle): the JIT
        # family side, its schema and allow-list add about a sixth to `import cubinstore.launch`.
        from cubinstore._jit.family import resolve_miss

        template = self.manifest.jit_templates.get(family)
        return resolve_miss(self.manifest, family, params, _jit_arch(family, template, cc), template=template,
                            store=self.store, jit=jit)


def _jit_arch(family: str, template: Any, cc: tuple[int, int]) -> str:
    """The arch to compile a missing point for: the template's best arch for `cc`, else `sm_<cc>`."""
    if template is None or not template.archs:
        return f"sm_{cc[0]}{cc[1]}"
    runnable = [Arch.parse(a) for a in template.archs if Arch.parse(a).runs_on(cc)]
    if not runnable:
        raise IncompatibleArchError(
            f"family {family!r}: its JIT template compiles for {', '.join(template.archs)}, none of which "
            f"runs on compute capability {cc[0]}.{cc[1]}"
        )
    return str(max(runnable, key=lambda a: (a.minor, a.preference)))


def _device_ordinal(devices: Devices, device: Any) -> int:
    """The checked ordinal of `device` (see `Library.kernel`). Device facts are cached in `devices`:
    a Library.kernel() call on a loaded kernel costs one driver call (the current context), or none."""
    if device is None:
        return devices.check_ordinal(devices.driver.current_device())
    if isinstance(device, bool):
        raise BadArgumentError(f"device: expected an ordinal, a torch.device or a cuda.core.Device, got {device!r}")
    if isinstance(device, int):
        return devices.check_ordinal(device)
    if isinstance(getattr(device, "device_id", None), int):  # cuda.core.Device
        return devices.check_ordinal(device.device_id)
    if getattr(device, "type", None) == "cuda":  # torch.device
        index = device.index
        return devices.check_ordinal(devices.driver.current_device() if index is None else index)
    raise BadArgumentError(f"device: expected an ordinal, a torch.device or a cuda.core.Device, got {show(device)}")


def _dims(kernel: str, name: str, value: Any, *, limit: int = 2**31 - 1) -> tuple[int, int, int]:
    items = (value,) if isinstance(value, int) else value
    if (
        not isinstance(items, Sequence)
        or not 1 <= len(items) <= 3
        or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in items)
    ):
        raise BadArgumentError(
            f"kernel {kernel} {name}: expected 1 to 3 positive ints (at most {limit}), got {show(value)}"
        )
    padded = tuple(items) + (1,) * (3 - len(items))
    return padded[0], padded[1], padded[2]


class Kernel:
    """One CUBIN loaded on one device; launch its entries with `launch`."""

    def __init__(self, spec: KernelSpec, device: int, functions: Mapping[str, _Function], load_seconds: float,
                 devices: Devices | None = None) -> None:
        self._spec = spec
        self._device = device
        # The device facts and the driver it was loaded through (the one in use, unless a test's fake).
        self._devices = _device.current() if devices is None else devices
        self._cuda = self._devices.driver
        self._functions = dict(functions)
        self._checked: set[str] = set()  # entries whose layout matched the CUBIN's (see _function)
        self.load_seconds = load_seconds

    def _function(self, symbol: str) -> _Function:
        """The entry's function, its parameter layout checked against the CUBIN's once before first use.

        Raises `ParamLayoutError` (before anything is launched) when the manifest's declared types
        or offsets are not what the compiler laid out.
        """
        fn = self._functions[symbol]
        if symbol not in self._checked:
            check_function_layout(self._spec, symbol, fn, self._device)
            self._checked.add(symbol)
        return fn

    @property
    def spec(self) -> KernelSpec:
        return self._spec

    @property
    def device(self) -> int:
        return self._device

    @property
    def entries(self) -> tuple[str, ...]:
        return self._spec.symbols  # the entry symbols, in order (no mapping filled for them)

    def __repr__(self) -> str:
        return f"Kernel({self._spec.id!r}, device={self._device})"

    def launch(
        self,
        entry: str,
        *,
        args: Sequence[Any],
        grid: int | Sequence[int] | None = None,
        block: int | Sequence[int] | None = None,
        shared_mem: int | None = None,
        cluster: int | Sequence[int] | None = None,
        stream: Any = None,
        pdl: bool = False,
    ) -> None:
        """Launch `entry` (its symbol or readable name) asynchronously on `stream`.

        Geometry the caller leaves out comes from the manifest's launch geometry for the
        entry (block, dynamic shared memory, cluster, and the grid rule evaluated over the
        integer `args` and the device's SM count). `grid` counts blocks (with a cluster too);
        `shared_mem` is dynamic shared memory in bytes. `stream` is a raw handle, a
        torch/CuPy stream or any `__cuda_stream__` object; None means torch's current stream
        when torch is imported (CuPy's for a CuPy array argument when torch is not), else the
        legacy default stream. `pdl` sets programmatic stream serialization, so the kernel
        may start before the previous one on the stream ends (it must call
        `cudaGridDependencySynchronize` before reading that kernel's output).
        """
        spec = self._spec
        name = f"{spec.id!r} entry {entry!r}"
        info = spec.entry(entry)
        fn = self._function(info.symbol)
        grid3, block3, shared_mem, cluster3 = self._geometry(name, info.launch, args, grid, block, shared_mem, cluster)
        cuda = self._cuda
        drv = cuda.driver()
        with cuda.on_device(self._device):
            packed = pack_args(spec.id, info.name, info.types, args, device=self._device, pointer_device=cuda.pointer_device)
            self._set_function_limits(fn, info.name, shared_mem, cluster3)
            handle = _stream_handle(stream, packed, self._device, name)
            native = _native_launch(cuda)
            if native is not None:  # the context is current (on_device): the helper finds it so
                err = native(fn.handle, cuda.launch_config(grid3, block3, shared_mem, cluster3, pdl), handle,
                             cuda.primary_context(self._device), packed.address, (), ())
                result = (drv.CUresult(err),)
            else:
                config = _launch_config(drv, grid3, block3, shared_mem, cluster3, pdl)
                config.hStream = drv.CUstream(handle)
                result = drv.cuLaunchKernelEx(config, drv.CUfunction(fn.handle), packed.address, 0)
            if result[0] != drv.CUresult.CUDA_SUCCESS:  # the message is built only for a failure
                cuda.check(result, self._launch_what(name, grid3, block3, shared_mem, cluster3, pdl))
        # The driver copied the parameters during the call; `packed` may go now.
        del packed

    def prepare(
        self,
        entry: str,
        *,
        args: Sequence[Any],
        grid: int | Sequence[int] | None = None,
        block: int | Sequence[int] | None = None,
        shared_mem: int | None = None,
        cluster: int | Sequence[int] | None = None,
        pdl: bool = False,
    ) -> PreparedLaunch:
        """A launch of `entry` whose geometry and fixed arguments are checked and packed once.

        `args` has one item per parameter: a value fixed for every launch, or None for one
        given to each call of the result (`prepared(stream, *changing)`). Geometry is as
        in `launch` (a grid rule may read only fixed arguments). The function's shared-memory
        and cluster attributes are set here, once. For a hot path launching one problem
        shape many times: each call packs only the changing arguments and launches.
        """
        spec = self._spec
        name = f"{spec.id!r} entry {entry!r}"
        info = spec.entry(entry)
        fn = self._function(info.symbol)
        grid3, block3, shared_mem, cluster3 = self._geometry(name, info.launch, args, grid, block, shared_mem, cluster)
        cuda = self._cuda
        buffer = ArgBuffer(spec.id, info.name, info.types, args, device=self._device,
                           pointer_device=cuda.pointer_device)
        drv = cuda.driver()
        with cuda.on_device(self._device):
            self._set_function_limits(fn, info.name, shared_mem, cluster3)
        native = _native_launch(cuda)
        config = (_launch_config(drv, grid3, block3, shared_mem, cluster3, pdl) if native is None
                  else cuda.launch_config(grid3, block3, shared_mem, cluster3, pdl))
        what = self._launch_what(name, grid3, block3, shared_mem, cluster3, pdl)
        return PreparedLaunch(drv, fn.handle, cuda.primary_context(self._device), config, buffer, what, cuda.check,
                              native)

    def max_active_clusters(
        self,
        entry: str,
        *,
        grid: int | Sequence[int],
        block: int | Sequence[int] | None = None,
        shared_mem: int | None = None,
        cluster: int | Sequence[int] | None = None,
    ) -> int:
        """How many clusters of `entry` launched so (`grid` a multiple of the cluster) the device holds
        at once (`cuOccupancyMaxActiveClusters`): a persistent grid of more runs the rest as a
        second wave. Leave `cluster` None for a kernel whose cluster shape is compiled in. Sets the
        function's shared-memory and cluster attributes as `prepare` does; 0 means it cannot run.
        """
        spec = self._spec
        name = f"{spec.id!r} entry {entry!r}"
        info = spec.entry(entry)
        fn = self._function(info.symbol)
        grid3, block3, shared_mem, cluster3 = self._geometry(name, info.launch, (), grid, block, shared_mem, cluster)
        cuda = self._cuda
        drv = cuda.driver()
        config = _launch_config(drv, grid3, block3, shared_mem, cluster3, False)
        with cuda.on_device(self._device):
            self._set_function_limits(fn, info.name, shared_mem, cluster3)
            return int(cuda.check(drv.cuOccupancyMaxActiveClusters(drv.CUfunction(fn.handle), config),
                                  f"cuOccupancyMaxActiveClusters for kernel {name} on device {self._device} "
                                  f"(grid {grid3}, block {block3}, shared_mem {shared_mem}, cluster {cluster3})"))

    def _launch_what(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        cluster: tuple[int, int, int] | None,
        pdl: bool,
    ) -> str:
        """What a failed cuLaunchKernelEx of this launch says it was."""
        return (f"cuLaunchKernelEx of kernel {name} on device {self._device} "
                f"(grid {grid}, block {block}, shared_mem {shared_mem}, cluster {cluster}, pdl {pdl})")

    def _geometry(
        self,
        name: str,
        geometry: LaunchGeometry | None,
        args: Sequence[Any],
        grid: int | Sequence[int] | None,
        block: int | Sequence[int] | None,
        shared_mem: int | None,
        cluster: int | Sequence[int] | None,
    ) -> tuple[tuple[int, int, int], tuple[int, int, int], int, tuple[int, int, int] | None]:
        """(grid, block, shared_mem, cluster) of one launch, checked; the manifest's where the caller gave none."""
        if block is None:
            if geometry is None:
                raise BadArgumentError(f"kernel {name}: pass block=, the manifest declares no launch geometry for it")
            block = geometry.block
        if grid is None:
            grid = None if geometry is None else geometry.grid_for(args, self._sm_count_for_rule(geometry))
            if grid is None:
                raise BadArgumentError(f"kernel {name}: pass grid=, the manifest declares no grid rule for it")
        if shared_mem is None:
            shared_mem = 0 if geometry is None else geometry.shared_mem
        if cluster is None and geometry is not None:
            cluster = geometry.cluster
        grid3 = _dims(name, "grid", grid)
        block3 = _dims(name, "block", block, limit=1024)
        cluster3 = None if cluster is None else _dims(name, "cluster", cluster)
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
            raise BadArgumentError(f"kernel {name} shared_mem: expected a non-negative int, got {show(shared_mem)}")
        if cluster3 is not None and any(g % c for g, c in zip(grid3, cluster3)):
            raise BadArgumentError(
                f"kernel {name}: grid {grid3} is not a multiple of cluster {cluster3} in every dimension"
            )
        return grid3, block3, shared_mem, cluster3

    def _set_function_limits(
        self, fn: _Function, entry: str, shared_mem: int, cluster: tuple[int, int, int] | None
    ) -> None:
        """Raise the function's dynamic shared-memory limit and allow its cluster, where needed (once)."""
        if shared_mem > fn.dynamic_smem_limit:
            self._raise_smem_limit(fn, entry, shared_mem)
        if cluster is not None:
            self._allow_cluster(fn, entry, cluster)

    def _sm_count_for_rule(self, geometry: LaunchGeometry) -> int | None:
        if geometry.grid is None or all(isinstance(g, int) for g in geometry.grid):
            return None
        return self._devices.sm_count(self._device)

    def _raise_smem_limit(self, fn: _Function, entry: str, shared_mem: int) -> None:
        cuda = self._cuda
        drv = cuda.driver()
        with fn.lock:
            if shared_mem <= fn.dynamic_smem_limit:
                return
            optin = self._devices.shared_mem_optin(self._device)
            if shared_mem + fn.static_smem > optin:
                raise BadArgumentError(
                    f"kernel {self._spec.id!r} entry {entry!r}: shared_mem {shared_mem} bytes plus "
                    f"{fn.static_smem} static exceeds device {self._device}'s limit of {optin} bytes per block"
                )
            cuda.check(
                drv.cuFuncSetAttribute(
                    drv.CUfunction(fn.handle),
                    drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_mem,
                ),
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_mem}) for kernel "
                f"{self._spec.id!r} entry {entry!r}",
            )
            fn.dynamic_smem_limit = shared_mem

    def _allow_cluster(self, fn: _Function, entry: str, cluster: tuple[int, int, int]) -> None:
        major, _ = self._devices.compute_capability(self._device)
        if major < 9:
            raise BadArgumentError(
                f"kernel {self._spec.id!r} entry {entry!r}: cluster {cluster} needs compute capability 9.0 "
                f"or newer, device {self._device} is {major}.x"
            )
        if cluster[0] * cluster[1] * cluster[2] <= _PORTABLE_CLUSTER or fn.non_portable_cluster:
            return
        cuda = self._cuda
        drv = cuda.driver()
        with fn.lock:
            cuda.check(
                drv.cuFuncSetAttribute(
                    drv.CUfunction(fn.handle),
                    drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                ),
                f"cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED) for kernel {self._spec.id!r} entry {entry!r}",
            )
            fn.non_portable_cluster = True


def _native_launch(cuda: Any) -> Any:
    """The compiled helper's launch where `cuda` is the real driver's module and the helper was built
    (``cubinstore._driver.cuda.native_launch``); None for the bindings' calls, and for a test's fake
    driver, which has no such function."""
    ask = getattr(cuda, "native_launch", None)
    return None if ask is None else ask()


def _launch_config(
    drv: Any,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    cluster: tuple[int, int, int] | None,
    pdl: bool,
) -> Any:
    """A `CUlaunchConfig` of this geometry; the caller sets `hStream`."""
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    attrs = []
    if cluster is not None:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    if pdl:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config


class PreparedLaunch:
    """`Kernel.prepare`'s result: call it as `prepared(stream, *changing_args)` to launch.

    The launch config, the function handle and the parameter buffer are built once; a call
    packs the changing arguments (checked as `Kernel.launch` checks them), makes the device's
    primary context current if it is not, and calls `cuLaunchKernelEx`. `stream` is a raw
    CUstream handle. Calls from several threads are serialised by a lock, since they share
    the buffer; the driver copies the parameters before `cuLaunchKernelEx` returns.

    Where the compiled helper was built (``cubinstore._core.native``), a call is one call of its
    `launch`: it writes the pointers and tensor maps (``ArgBuffer.plan``) and makes the driver calls;
    any other value goes through `ArgBuffer.write`'s checks first. From Python through the bindings,
    the launch alone cost about as much as the rest of a `gemm` call (4.9 us on the H100).
    """

    def __init__(self, drv: Any, function: int, context: int, config: Any, buffer: ArgBuffer, what: str,
                 check: Callable[[tuple[Any, ...], str], Any], native: Any = None) -> None:
        self._drv = drv
        self._check = check  # the driver's, for a failed call
        self._native = native  # the helper's launch, `config` then packed by cuda.launch_config; None: the bindings'
        self._launch = drv.cuLaunchKernelEx
        self._get_context = drv.cuCtxGetCurrent
        self._handle = function
        self._function = drv.CUfunction(function)
        self._context = context
        self._config = config
        self._buffer = buffer
        self._plan = buffer.plan()
        self._what = what
        self._success = drv.CUresult.CUDA_SUCCESS
        self._stream: int | None = None
        self._lock = threading.Lock()
        #: Launches the driver accepted through this object (for tests and benchmarks: repeat calls reuse it).
        self.calls = 0

    def __call__(self, stream: int, *changing: Any) -> None:
        native = self._native
        if native is None:
            return self._call_bindings(stream, changing)
        with self._lock:
            if stream != self._stream:
                self._check_stream(stream)
            err = native(self._handle, self._config, stream, self._context, self._buffer.address, self._plan, changing)
            if err == _NOT_WRITTEN:  # a value the helper does not write: every one packed and checked here
                self._buffer.write(changing)
                err = native(self._handle, self._config, stream, self._context, self._buffer.address, (), ())
            if err == 0:
                self.calls += 1
                return None
        self._check((self._drv.CUresult(err),), self._what)
        return None

    def _check_stream(self, stream: Any) -> None:
        if type(stream) is not int or not 0 <= stream < 2**64:
            raise BadArgumentError(f"{self._what} stream: expected a raw handle in [0, 2**64), got {show(stream)}")
        self._stream = stream

    def _call_bindings(self, stream: int, changing: tuple[Any, ...]) -> None:
        drv = self._drv
        with self._lock:
            self._buffer.write(changing)
            if stream != self._stream:
                self._check_stream(stream)
                self._config.hStream = drv.CUstream(stream)
            err, current = self._get_context()
            if err != self._success:
                self._check((err,), "cuCtxGetCurrent for a prepared launch")
            before = 0 if current is None else int(current)
            if before != self._context:
                self._check(drv.cuCtxSetCurrent(drv.CUcontext(self._context)), "cuCtxSetCurrent for a prepared launch")
            try:
                result = self._launch(self._config, self._function, self._buffer.address, 0)
            finally:
                if before != self._context:
                    self._check(drv.cuCtxSetCurrent(drv.CUcontext(before)), "cuCtxSetCurrent (restore)")
            if result[0] == self._success:
                self.calls += 1
                return
        self._check(result, self._what)


_NOT_WRITTEN = -1  # the helper's launch: a changing value it does not write; nothing was launched


def _stream_handle(stream: Any, packed: Any, device: int, name: str) -> int:
    """A raw CUstream handle for `stream` (see `Kernel.launch`)."""
    if stream is None:
        # torch's current stream whenever torch is in the process, so a launch orders with
        # torch's work (and CUDA-graph capture) even when no argument is a tensor.
        torch = sys.modules.get("torch")
        if torch is not None and (packed.torch_tensor is not None or packed.cupy_array is None):
            return int(torch.cuda.current_stream(device).cuda_stream)
        if packed.cupy_array is not None:
            cupy = sys.modules["cupy"]
            with cupy.cuda.Device(device):
                return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, bool):
        raise BadArgumentError(f"kernel {name} stream: expected a stream or a handle, got bool")
    if isinstance(stream, int):
        if not 0 <= stream < 2**64:
            raise BadArgumentError(f"kernel {name} stream: expected a handle in [0, 2**64), got {stream}")
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        _version, handle = protocol() if callable(protocol) else protocol
        return int(handle)
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    raise BadArgumentError(
        f"kernel {name} stream: expected a handle int, a torch/CuPy stream or an object with "
        f"__cuda_stream__, got {show(stream)}"
    )
