"""A CUBIN's file swapped after the store checked it, before or while the driver reads it: the driver
gets the bytes the store verified, the kernel loads, and the next first load finds the swap
(RELIABILITY.md, "file swapped between verify and load"; Nix CVE-2024-27297).

The swap writes other bytes of the same size over the entry's inode, in place: its record (the
xattr) stays, and its mode is put back. A path, an mmap or a buffer read from the file again
is read when the driver reads it, after the swap, so a loader that handed the driver any of
those would hand it the swapped bytes. The stand-in drivers read what they are given only at
that moment: the file where given a path, else the buffer's bytes.

No GPU. Each case runs on both read paths of ``LocalLayer.read_verified`` (``helpers.native``) and
through each route to the driver's load: ``cuda.load_functions`` calling fake ``cuda.bindings``
from Python, the same with its compiled helper's call made through a stand-in of the helper
(``cuda.using_native_load``: a GPU host's path), and a fake driver through ``device.use`` (the
loader's ``_load_module``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import native as native_paths
from helpers.blobs import disk_cache_with
from helpers.driver import SM90_FACTS, bindings_driver, cubin

from cubinstore import Digest, IntegrityError, launch
from cubinstore.internals import cuda, device
from cubinstore.manifest import SCHEMA, Manifest, dumps_canonical
from cubinstore.store import LocalLayer, Store

pytestmark = pytest.mark.usefixtures("clean_env")

KERNEL = "syn/i0/sm_90a"
SIZE = 6000
PRIMARY = 7  # the device's primary context: current already, so nothing is switched
NOT_FOUND = 500
LIBRARY, FUNCTION = 101, 300

# When the file is swapped: as the store's read and check returns the bytes (before any loader
# code runs on them); at the stand-in's call just before the load (the context check: none on
# the helper's route, whose one call is the load); inside the load, before the buffer is read.
AFTER_CHECK, AT_CONTEXT, IN_LOAD = "after the store's check", "at the context check", "in the driver's load"
# How the driver is reached (see the module docstring).
BINDINGS, HELPER, FAKE_DRIVER = "bindings", "helper", "fake driver"
CASES = [(route, moment) for route in (BINDINGS, HELPER, FAKE_DRIVER)
         for moment in (AFTER_CHECK, AT_CONTEXT, IN_LOAD) if (route, moment) != (HELPER, AT_CONTEXT)]


GOOD = cubin(0, SIZE)
FLIPPED = bytes(GOOD[:3000]) + bytes([GOOD[3000] ^ 1]) + GOOD[3001:]  # a flipped bit in code: loads, then misbehaves
OTHER = cubin(1, SIZE)  # another valid sm_90 CUBIN of the same size: passes every check but the digest
SWAPS = {"one flipped bit": FLIPPED, "another CUBIN": OTHER}


def manifest() -> Manifest:
    kernel = {"id": KERNEL, "family": "syn", "params": {"i": 0}, "arch": "sm_90a", "digest": str(Digest.of(GOOD)),
              "size": SIZE, "target": "//syn:syn_0", "toolkit": "13.0.88", "min_driver": 13000,
              "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}}
    return Manifest.from_bytes(dumps_canonical({"schema": SCHEMA, "kernels": [kernel]}))


class Swap:
    """Overwrites the entry at ``path`` with ``data`` in place, once, when ``note`` is told ``moment``;
    ``events`` is what was noted, ``"swapped"`` where the swap was made. ``received`` is what each
    driver load read (its route, the type it was given, the bytes)."""

    def __init__(self, path: Path, data: bytes, moment: str) -> None:
        self.path, self.data, self.moment = path, data, moment
        self.events: list[str] = []
        self.received: list[tuple[str, type, bytes]] = []

    def note(self, event: str) -> None:
        self.events.append(event)
        if event == self.moment and "swapped" not in self.events:
            overwrite(self.path, self.data)
            self.events.append("swapped")

    def load(self, route: str, data: Any) -> None:
        """A driver's load of ``data``: the swap where due, then a read of it, as the driver reads it."""
        self.note(IN_LOAD)
        if isinstance(data, (str, os.PathLike)):  # a path: the driver opens the file now
            read = Path(data).read_bytes()
        else:  # bytes, or a buffer over a file (an mmap, a view): read now
            read = bytes(memoryview(data))
        self.received.append((route, type(data), read))


def overwrite(path: Path, data: bytes) -> None:
    """Write ``data`` over the file at ``path`` (same inode and size, its mode and xattrs kept)."""
    before = path.stat()
    assert len(data) == before.st_size
    path.chmod(stat.S_IMODE(before.st_mode) | stat.S_IWUSR)  # entries are read-only
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, 0) == len(data)
    finally:
        os.close(fd)
    path.chmod(stat.S_IMODE(before.st_mode))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mode) == (before.st_ino, before.st_size, before.st_mode)
    assert path.read_bytes() == data


class CheckedLayer(LocalLayer):
    """A local layer that tells ``swap`` when ``read_verified`` has read and checked an entry."""

    def __init__(self, root: Path, swap: Swap) -> None:
        super().__init__(root)
        self.swap = swap

    def read_verified(self, digest: Digest, size: int) -> bytes | None:
        data = super().read_verified(digest, size)
        if data is not None:
            self.swap.note(AFTER_CHECK)
        return data


class Bindings:
    """What ``cubinstore._driver.cuda.load_functions`` asks of ``cuda.bindings.driver``, its load a ``Swap``'s."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_FOUND=NOT_FOUND)
    CUcontext = CUlibrary = int

    def __init__(self, swap: Swap) -> None:
        self.swap = swap

    def cuCtxGetCurrent(self) -> tuple[int, int]:  # noqa: N802 -- the bindings' names
        self.swap.note(AT_CONTEXT)
        return 0, PRIMARY

    def cuCtxSetCurrent(self, context: int) -> tuple[int]:  # noqa: N802
        raise AssertionError(f"the primary context is current: no switch to {context}")

    def cuLibraryLoadData(self, data: Any, *options: Any) -> tuple[int, int]:  # noqa: N802
        self.swap.load(BINDINGS, data)
        return 0, LIBRARY

    def cuLibraryGetKernel(self, library: int, name: bytes) -> tuple[int, int]:  # noqa: N802
        return (0, 200) if name == b"k" else (NOT_FOUND, 0)

    def cuKernelGetFunction(self, kernel: int) -> tuple[int, int]:  # noqa: N802
        return 0, FUNCTION


class FakeDriver:
    """One sm_90 device, as ``cubinstore._driver.cuda`` answers for it; its load a ``Swap``'s."""

    def __init__(self, swap: Swap) -> None:
        self.swap = swap

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def device_attribute(self, ordinal: int, name: str) -> int:
        return SM90_FACTS[name]

    def driver_version(self) -> int:
        return 13000

    def on_device(self, ordinal: int) -> contextlib.nullcontext[None]:
        self.swap.note(AT_CONTEXT)
        return contextlib.nullcontext()

    def load_library(self, data: Any, what: object) -> int:
        self.swap.load(FAKE_DRIVER, data)
        return LIBRARY

    def library_function(self, library: int, entry: str, what: object) -> int:
        return FUNCTION


@contextlib.contextmanager
def driven(route: str, swap: Swap) -> Iterator[Any]:
    """The driver reached by ``route`` for the block; yields ``renew()``, which starts a fresh
    ``Devices`` (nothing loaded through it, as in a new process) and is called once here."""
    before = device.current()
    with contextlib.ExitStack() as stack:
        stack.callback(device.use, before)
        if route == FAKE_DRIVER:
            fake: Any = FakeDriver(swap)
        else:
            stack.enter_context(cuda.use_bindings(Bindings(swap), success=0, primary={0: PRIMARY}))
            if route == HELPER:
                def helper_load(data: Any, entries: tuple[str, ...], context: int, not_found: int) -> Any:
                    assert context == PRIMARY
                    swap.load(HELPER, data)
                    return LIBRARY, [FUNCTION if entry == "k" else None for entry in entries]
                stack.enter_context(cuda.using_native_load(helper_load))
            fake = bindings_driver()  # the module's own functions: the loader calls cuda.load_functions

        def renew() -> None:
            devices = device.Devices(fake)
            devices.check_ordinal(0)
            device.use(devices)

        renew()
        yield renew


@pytest.mark.parametrize("swapped", list(SWAPS.values()), ids=list(SWAPS))
@pytest.mark.parametrize(("route", "moment"), CASES, ids=[f"{r}, {m}" for r, m in CASES])
@pytest.mark.parametrize("read_path", native_paths.PATHS)
def test_a_file_swapped_after_its_check_loads_the_verified_bytes_and_is_caught_on_the_next_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_path: str, route: str, moment: str,
        swapped: bytes) -> None:
    native_paths.use(monkeypatch, read_path)
    release = manifest()
    spec = release.by_id(KERNEL)
    root = tmp_path / "store"
    LocalLayer(root).write(spec.digest, GOOD)  # an earlier process's fill
    path = LocalLayer(root).path_for(spec.digest)
    swap = Swap(path, swapped, moment)
    with driven(route, swap) as renew:
        kernel = launch.Library(release, Store([CheckedLayer(root, swap)])).kernel(KERNEL, device=0)

        # The swap came after the store's check and before the driver read what it was given.
        steps = [AFTER_CHECK, *([] if route == HELPER else [AT_CONTEXT]), IN_LOAD]
        steps.insert(steps.index(moment) + 1, "swapped")
        assert swap.events == steps
        assert path.read_bytes() == swapped  # the swap is still on disk: this load did not check the file again
        # The driver read exactly the bytes the manifest names, given as an immutable bytes object.
        ((via, given, read),) = swap.received
        assert hashlib.sha256(read).hexdigest() == spec.digest.hex and read == GOOD
        assert (via, given) == (route, bytes)
        assert kernel.spec.id == KERNEL and kernel.entries == ("k",) and launch.is_loaded(spec.digest, 0)

        # The next first load (a new process's store): the record, then sha256, fail; the entry is
        # quarantined; with nowhere to fetch from, an error naming the digest, and nothing loaded.
        renew()
        store = Store([LocalLayer(root)])
        with pytest.raises(IntegrityError, match=rf"^{spec.digest} \({KERNEL}\) \({SIZE} bytes\) not available: "
                                                 rf"local store {root}: digest mismatch for {spec.digest} \({KERNEL}\) "
                                                 rf"from local store {root}: expected {spec.digest}, got sha256:"
                                                 rf"{hashlib.sha256(swapped).hexdigest()}"):
            launch.Library(release, store).kernel(KERNEL, device=0)
        assert store.stats.verification_failures == 1 and len(swap.received) == 1
        assert not path.exists()
        assert [q.read_bytes() for q in (root / "v1" / "quarantine").iterdir()] == [swapped]

        # With a copy elsewhere: refetched, stored again and loaded.
        renew()
        store = Store([LocalLayer(root), disk_cache_with(tmp_path / "disk-cache", [(spec.digest, GOOD)])])
        launch.Library(release, store).kernel(KERNEL, device=0)
        assert [read for _, _, read in swap.received] == [GOOD, GOOD]
        assert path.read_bytes() == GOOD and store.stats.misses == 1
