"""A first ``Library.kernel()`` from an owned local store, and a reload of bytes verified before, do
little Python work (issue 31: on the GPU host each call between driver calls costs 0.3-7 us, the
CPU's caches cold), and every check on the way still holds.

No GPU: ``cuda.bindings.driver`` is a fake (``Bindings``), put where ``cubinstore._driver.cuda``
keeps the initialised bindings (no public hook reaches below its wrappers), so the loader takes the
path it takes on a GPU (``cuda.load_functions``: the context guard, the load and each entry's
function in one call) and the bytes it hands the driver are recorded. The Python calls of one load
are counted with ``sys.setprofile`` (the fake's left out: the real bindings are compiled).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.blobs import disk_cache_with
from helpers.driver import bindings_driver, cubin

from cubinstore import Digest, launch
from cubinstore.errors import CubinFormatError, CudaError, ManifestError
from cubinstore.internals import cuda, device
from cubinstore.manifest import SCHEMA, Manifest, dumps_canonical
from cubinstore.store import LocalLayer, MemoryLayer, Store

pytestmark = pytest.mark.usefixtures("clean_env")

# Measured 2026-12 (Python 3.11): 24 calls for a first load (its shard's first hit), 18 for a reload
# (the memory layer); 55 and 41 before issue 31's work, 27 and 21 before the device check, the
# selection and the driver version each took one call fewer. (Three of the 24 are
# `Logger.isEnabledFor`, one per logger a load may write to: a flag shared by the three would be
# wrong where an application sets one of them to DEBUG. The hit count stays `Counters.add_hit`'s
# two calls: inlining it would reach into the pending batch's lock and table.) The bounds are the
# counts: a call that comes back fails here.
FIRST_LOAD_CALLS = 24
RELOAD_CALLS = 18

PRIMARY = 7  # the device's primary context (retained, as a load retains it)
OTHER = 5  # a context the caller made current (the loader must restore it)
NOT_FOUND = 500
INVALID_IMAGE = 200


class Bindings:
    """What ``cubinstore._driver.cuda`` asks of ``cuda.bindings.driver`` for a load, each call recorded."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_FOUND=NOT_FOUND)
    CUcontext = CUlibrary = int

    def __init__(self) -> None:
        self.current = PRIMARY
        self.loaded: list[bytes] = []
        self.switches: list[int] = []
        self.load_error = 0
        self.symbols = {b"k"}

    def cuCtxGetCurrent(self) -> tuple[int, int]:  # noqa: N802 -- the bindings' names
        return 0, self.current

    def cuCtxSetCurrent(self, context: int) -> tuple[int]:  # noqa: N802
        self.switches.append(context)
        self.current = context
        return (0,)

    def cuLibraryLoadData(self, data: bytes, *options: Any) -> tuple[int, int]:  # noqa: N802
        assert self.current == PRIMARY  # loaded in the device's primary context
        if self.load_error:
            return self.load_error, 0
        self.loaded.append(data)
        return 0, 100 + len(self.loaded)

    def cuLibraryGetKernel(self, library: int, name: bytes) -> tuple[int, int]:  # noqa: N802
        return (0, 200) if name in self.symbols else (NOT_FOUND, 0)

    def cuKernelGetFunction(self, kernel: int) -> tuple[int, int]:  # noqa: N802
        return 0, 300

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return 0, b"CUDA_ERROR_INVALID_IMAGE"

    def cuGetErrorString(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return 0, b"device kernel image is invalid"


@pytest.fixture
def bindings() -> Iterator[Bindings]:
    """The fake bindings under ``cubinstore._driver.cuda`` (initialised, device 0's primary context
    retained), and a driver of one sm_90 device whose loads are that module's own functions."""
    fake = Bindings()
    before = device.current()
    with cuda.use_bindings(fake, success=0, primary={0: PRIMARY}):
        yield fake
    device.use(before)


def fresh() -> None:
    """A fresh load from here on, as in a new process: a new ``Devices`` has loaded nothing. Its
    device facts are known before, as a running process has them."""
    devices = device.Devices(bindings_driver())
    devices.check_ordinal(0)
    devices.compute_capability(0)
    devices.driver_version()
    device.use(devices)
    launch.loaded_module_count()  # its (empty) module cache made


def manifest(blobs: list[bytes], arch: str = "sm_90a") -> Manifest:
    """A release of ``blobs``, ``syn/i<n>/<arch>``, each spec built (the manifest builds a spec when
    first asked for it: not the loader's work, which is what is counted here)."""
    kernels = [{"id": f"syn/i{i}/{arch}", "family": "syn", "params": {"i": i}, "arch": arch,
                "digest": str(Digest.of(data)), "size": len(data), "target": f"//syn:syn_{i}",
                "toolkit": "13.0.88", "min_driver": 13000,
                "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}} for i, data in enumerate(blobs)]
    release = Manifest.from_bytes(dumps_canonical({"schema": SCHEMA, "kernels": kernels}))
    for kernel in kernels:
        release.by_id(kernel["id"])
    return release


def owned(root: Path, blobs: list[bytes]) -> LocalLayer:
    local = LocalLayer(root)
    for data in blobs:
        local.write(Digest.of(data), data)
    return local


def python_calls(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and the Python functions it called (this file's left out: the fake bindings)."""
    here = __file__
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename != here:
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    collecting = gc.isenabled()
    gc.disable()  # a collection's finalizers are no part of a load
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return result, calls


def test_a_first_load_from_an_owned_store_makes_few_python_calls(tmp_path: Path, bindings: Bindings) -> None:
    blobs = [cubin(i) for i in range(3)]
    release = manifest(blobs)
    local = owned(tmp_path / "store", blobs)
    store = Store([local])
    fresh()
    launch.Library(release, store).kernel("syn/i0/sm_90a", device=0)  # the process's first: the store decides
    for i in (1, 2):
        fresh()
        library = launch.Library(release, store)  # its first selection too
        kernel, calls = python_calls(lambda: library.kernel(f"syn/i{i}/sm_90a", device=0))  # noqa: B023
        assert len(calls) <= FIRST_LOAD_CALLS, "\n".join(calls)
        assert kernel.spec.id == f"syn/i{i}/sm_90a"
    assert bindings.loaded == blobs  # the exact verified bytes, each once
    assert kernel.entries == ("k",)  # the spec's symbols
    for i in range(3):  # a load reads none of a spec's lazily filled fields: entry specs wait for a launch
        assert not {"family", "params", "entries", "target", "entry_specs", "_names"} & set(vars(release.by_id(f"syn/i{i}/sm_90a")))
    assert local.checks == {"xxh3": 3, "sha256": 0, "recorded": 0, "stale records": 0}
    assert store.stats.hits == 3 and store.stats.misses == 0
    assert bindings.switches == []  # the primary context was current: nothing switched


def test_a_reload_of_verified_bytes_makes_few_python_calls(tmp_path: Path, bindings: Bindings) -> None:
    blobs = [cubin(i) for i in range(2)]
    release = manifest(blobs)
    local = owned(tmp_path / "store", blobs)
    store = Store([MemoryLayer(), local])  # Store.from_env's layers
    for _ in range(2):
        fresh()
        launch.Library(release, store).kernel("syn/i0/sm_90a", device=0)
    fresh()
    library = launch.Library(release, store)
    _, calls = python_calls(lambda: library.kernel("syn/i1/sm_90a", device=0))  # read, checked, kept in memory
    fresh()
    library = launch.Library(release, store)
    _, calls = python_calls(lambda: library.kernel("syn/i1/sm_90a", device=0))  # from memory
    assert len(calls) <= RELOAD_CALLS, "\n".join(calls)
    assert local.checks["xxh3"] == 2  # each read and checked once in the process
    assert bindings.loaded == [blobs[0], blobs[0], blobs[1], blobs[1]]


def test_a_flipped_bit_is_quarantined_and_refetched_through_the_layered_path(tmp_path: Path,
                                                                            bindings: Bindings) -> None:
    blobs = [cubin(i) for i in range(2)]
    local = owned(tmp_path / "store", blobs)
    store = Store([local, disk_cache_with(tmp_path / "dc", [(Digest.of(b), b) for b in blobs])])
    release = manifest(blobs)
    fresh()
    launch.Library(release, store).kernel("syn/i1/sm_90a", device=0)
    path = local.path_for(Digest.of(blobs[0]))
    damaged = bytearray(blobs[0])
    damaged[3000] ^= 1  # same size, its record kept: only the bytes are wrong
    path.chmod(0o644)
    path.write_bytes(bytes(damaged))
    fresh()
    launch.Library(release, store).kernel("syn/i0/sm_90a", device=0)
    assert bindings.loaded == [blobs[1], blobs[0]]  # the good bytes, refetched; the bad never loaded
    assert store.stats.verification_failures == 1 and store.stats.misses == 1
    assert len(list(local.quarantine_dir.iterdir())) == 1 and path.read_bytes() == blobs[0]


@pytest.mark.parametrize("why", ["group-writable root", "CUBINSTORE_VERIFY=full", "CUBINSTORE_ALLOW_SHARED_STORE=1"])
def test_where_records_are_not_trusted_a_first_load_checks_sha256(tmp_path: Path, bindings: Bindings,
                                                                   monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    blobs = [cubin(i) for i in range(2)]
    root = tmp_path / "store"
    owned(root, blobs)
    if why == "group-writable root":
        root.chmod(0o775)
    else:
        name, value = why.split("=")
        monkeypatch.setenv(name, value)
    local = LocalLayer(root)
    store = Store([local])
    release = manifest(blobs)
    for i in range(2):
        fresh()
        launch.Library(release, store).kernel(f"syn/i{i}/sm_90a", device=0)
    assert local.checks["xxh3"] == 0 and local.checks["sha256"] == 2
    assert bindings.loaded == blobs


@pytest.mark.parametrize(("data", "error", "message"), [
    (cubin(0, sm=80), ManifestError, "manifest says sm_90a, the CUBIN's ELF header says sm_80"),
    (b"\x7fELF\x01" + bytes(5995), CubinFormatError, "expected a 64-bit little-endian ELF, got class 1, data 0"),
    (bytes(6000), CubinFormatError, "not an ELF file"),
])
def test_a_header_that_is_not_the_manifests_is_refused_before_the_driver(
        tmp_path: Path, bindings: Bindings, data: bytes, error: type[Exception], message: str) -> None:
    store = Store([owned(tmp_path / "store", [data])])
    fresh()
    with pytest.raises(error, match=rf"^kernel 'syn/i0/sm_90a' \({Digest.of(data)}\): {message}"):
        launch.Library(manifest([data]), store).kernel("syn/i0/sm_90a", device=0)
    assert bindings.loaded == []


def test_driver_errors_name_the_kernel_and_the_callers_context_is_restored(tmp_path: Path,
                                                                          bindings: Bindings) -> None:
    blobs = [cubin(0)]
    release = manifest(blobs)
    store = Store([owned(tmp_path / "store", blobs)])
    what = rf"kernel 'syn/i0/sm_90a' \({Digest.of(blobs[0])}\)"
    bindings.current = OTHER  # the caller's context: switched to the primary one and back
    bindings.symbols = set()
    fresh()
    with pytest.raises(ManifestError, match=rf"^{what} entry 'k' on device 0: the manifest declares it, the CUBIN has no"):
        launch.Library(release, store).kernel("syn/i0/sm_90a", device=0)
    assert bindings.switches == [PRIMARY, OTHER] and bindings.current == OTHER
    bindings.load_error = INVALID_IMAGE
    fresh()
    with pytest.raises(CudaError, match=rf"^cuLibraryLoadData for {what} on device 0: CUDA_ERROR_INVALID_IMAGE \("):
        launch.Library(release, store).kernel("syn/i0/sm_90a", device=0)
    assert bindings.switches == [PRIMARY, OTHER] * 2 and bindings.current == OTHER


def test_threads_loading_one_kernel_at_once_load_it_once(tmp_path: Path, bindings: Bindings) -> None:
    blobs = [cubin(0)]
    release = manifest(blobs)
    store = Store([owned(tmp_path / "store", blobs)])
    fresh()
    library = launch.Library(release, store)
    start = threading.Barrier(8)
    got: list[Any] = []

    def load() -> None:
        start.wait()
        got.append(library.kernel("syn/i0/sm_90a", device=0))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(bindings.loaded) == 1
    assert len({id(k._functions["k"]) for k in got}) == 1  # one module, one function object
    assert store.stats.hits == 1


def test_a_first_load_logs_its_fetch_and_load_when_debug_is_on(tmp_path: Path, bindings: Bindings,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    blobs = [cubin(0)]
    store = Store([owned(tmp_path / "store", blobs)])
    fresh()
    with caplog.at_level(logging.DEBUG, logger="cubinstore"):
        launch.Library(manifest(blobs), store).kernel("syn/i0/sm_90a", device=0)
    messages = [r.getMessage() for r in caplog.records]
    digest = Digest.of(blobs[0])
    assert any(m.startswith(f"{digest} (syn/i0/sm_90a): hit in local store {tmp_path / 'store'}") for m in messages)
    assert any(m.startswith(f"loaded syn/i0/sm_90a ({digest.short}) on device 0: fetch+verify") for m in messages)
