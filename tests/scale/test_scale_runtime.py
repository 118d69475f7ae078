"""Library.kernel() on a loaded kernel: device facts queried once, the selection cached.

No GPU needed: the driver is a fake that counts calls, handed to the runtime through the one
hook (`cubinstore._driver.device.use`); the bytes it "loads" are checked as a real load's are
(the GPU tests cover the driver's side), so what is measured is the per-call work around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cubinstore import launch
from cubinstore.internals import device
from cubinstore.manifest import Manifest, dumps_canonical

pytestmark = pytest.mark.usefixtures("clean_env")


def manifest(n: int = 50) -> Manifest:
    kernels = []
    for i in range(n):
        for arch in ("sm_90a", "sm_80"):
            kernels.append({"id": f"f/p{i}/{arch}", "family": "f", "params": {"p": i}, "arch": arch,
                            "digest": "sha256:" + f"{i:02x}{arch[-2:]}".ljust(64, "0").replace("a", "c")[:64],
                            "size": 100, "target": f"//k:t{i}",
                            "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}})
    return Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels}))


class FakeDriver:
    """What the loader and launcher ask of `cubinstore._driver.cuda`, answered as `devices` sm_90
    GPUs would, each call counted by name; a load records the bytes it was given."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.calls: dict[str, int] = {}
        self.loaded: list[bytes] = []

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def device_count(self) -> int:
        self._count("device_count")
        return self.devices

    def device_attribute(self, ordinal: int, name: str) -> int:
        self._count("device_attribute")
        return {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0}[name]

    def current_device(self) -> int:
        self._count("current_device")
        return 0

    def on_device(self, ordinal: int) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def load_library(self, data: bytes, what: str) -> int:
        self._count("load_library")
        self.loaded.append(data)
        return len(self.loaded)

    def library_function(self, library: int, entry: str, what: str) -> int:
        self._count("library_function")
        return 1


@contextlib.contextmanager
def using(driver: FakeDriver) -> Iterator[FakeDriver]:
    """`driver` in place of the CUDA driver (the one hook: `device.use`), then the real one again."""
    before = device.use(device.Devices(driver))
    try:
        yield driver
    finally:
        device.use(before)


class FakeStore:
    """Returns CUBIN-like bytes of the asked size (the layer below Store.get, without the disk)."""

    def get(self, digest: Any, size: int, *, name: str = "") -> bytes:
        return cubin_like(0, size)


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    with using(FakeDriver()) as driver:
        yield driver


def test_a_loaded_kernel_costs_one_driver_call_per_lookup(fake: FakeDriver) -> None:
    lib = launch.Library(manifest(), store=FakeStore())  # type: ignore[arg-type]
    first = lib.kernel("f", p=3)
    assert first.spec.id == "f/p3/sm_90a"
    lib.kernel("f/p4/sm_90a")
    before = dict(fake.calls)
    for _ in range(100):
        assert lib.kernel("f", p=3).spec is first.spec
        assert lib.kernel("f/p4/sm_90a").spec.id == "f/p4/sm_90a"
    after = {k: v - before.get(k, 0) for k, v in fake.calls.items() if v != before.get(k, 0)}
    assert after == {"current_device": 200}  # no device count, attribute or load again
    assert len(fake.loaded) == 2


def test_an_unhashable_param_is_not_cached_but_still_selected(fake: FakeDriver) -> None:
    real = manifest()
    spec = real.by_id("f/p1/sm_90a")
    asked: list[Any] = []
    stub = SimpleNamespace(selector=lambda id_or_family, cc, params: asked.append(params) or spec)
    lib = launch.Library(stub, store=FakeStore())  # type: ignore[arg-type]
    for _ in range(3):
        assert lib.kernel("f", p=[1]).spec is spec  # type: ignore[arg-type]
    assert asked == [{"p": [1]}] * 3 and lib._selected == {}


@pytest.mark.parametrize("bad", [3, -1, True, 0.0, "0"])
def test_a_bad_device_is_still_refused_naming_the_range(fake: FakeDriver, bad: Any) -> None:
    from cubinstore.errors import BadArgumentError

    lib = launch.Library(manifest(), store=FakeStore())  # type: ignore[arg-type]
    lib.kernel("f", device=0, p=1)  # the device count is known: a bad ordinal still gets the message
    with pytest.raises(BadArgumentError, match=r"^(invalid device|device: expected an ordinal)"):
        lib.kernel("f", device=bad, p=1)
    with pytest.raises(BadArgumentError, match=r"^invalid device 3: expected an ordinal in \[0, 1\)"):
        lib.kernel("f", device=3, p=1)


# -- the host side of a real load (driver stubbed): the store's reads and hashes -----------------

def cubin_like(i: int, size: int = 6000) -> bytes:
    """ELF-headed bytes that pass the loader's header check for sm_90 (no driver sees them here)."""
    import random
    import struct

    head = bytearray(64)
    head[:9] = b"\x7fELF\x02\x01\x01\x00\x08"
    struct.pack_into("<H", head, 0x12, 190)  # EM_CUDA
    struct.pack_into("<I", head, 0x30, 90 << 8)  # sm_90
    return bytes(head) + random.Random(i).randbytes(size - 64)


@pytest.fixture
def stubbed_driver() -> Iterator[list[bytes]]:
    """Device facts of two sm_90 GPUs and a driver whose loads record the bytes they were given."""
    with using(FakeDriver(devices=2)) as driver:
        yield driver.loaded


def test_a_blob_is_read_and_hashed_once_per_process_however_many_devices_load_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stubbed_driver: list[bytes]) -> None:
    import hashlib
    import os

    from cubinstore import Digest
    from cubinstore.store import LocalLayer, MemoryLayer, Store

    data = cubin_like(0)
    digest = Digest.of(data)
    local = LocalLayer(tmp_path / "home")
    local.write(digest, data)
    kernels = [{"id": "f/p0/sm_90a", "family": "f", "params": {"p": 0}, "arch": "sm_90a", "digest": str(digest),
                "size": len(data), "target": "//k:t0", "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}}]
    lib = launch.Library(Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels})),
                         Store([MemoryLayer(), local]))  # the layers of Store.from_env, without remotes
    opened: list[Any] = []
    hashed: list[int] = []
    real_open, real_sha256 = os.open, hashlib.sha256
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    native_read = local._read_native  # the compiled reader opens in C: count what it is asked for
    if native_read is not None:
        monkeypatch.setattr(local, "_read_native", lambda fd, name, *a: opened.append(name) or native_read(fd, name, *a))
    monkeypatch.setattr(hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real_sha256(b))
    lib.kernel("f/p0/sm_90a", device=0)
    # one checked read (the shard opened once): by its record, in a store this user owns, so no sha256
    assert opened.count(digest.hex) == 1 and hashed == [] and local.checks["xxh3"] == 1
    opened.clear()
    lib.kernel("f/p0/sm_90a", device=1)
    lib.kernel("f/p0/sm_90a", device=0)  # loaded already: nothing to do
    assert opened == [] and hashed == [] and local.checks == {"xxh3": 1, "sha256": 0, "recorded": 0,
                                                              "stale records": 0}
    assert len(stubbed_driver) == 2 and stubbed_driver[0] is stubbed_driver[1]  # the one verified bytes object
    assert stubbed_driver[0] == data


def test_a_fake_driver_loads_into_its_own_cache_and_leaves_the_real_one_alone() -> None:
    spec = manifest().by_id("f/p2/sm_90a")
    assert not launch.is_loaded(spec.digest, 0)
    with using(FakeDriver()) as driver:
        launch.Library(manifest(), store=FakeStore()).kernel(spec.id, device=0)  # type: ignore[arg-type]
        assert launch.is_loaded(spec.digest, 0) and launch.loaded_module_count() == 1
    with using(FakeDriver()):  # a fresh Devices has loaded nothing, as a new process
        assert not launch.is_loaded(spec.digest, 0) and launch.loaded_module_count() == 0
    assert not launch.is_loaded(spec.digest, 0)  # the real driver's cache: untouched
    assert driver.calls["load_library"] == 1


# -- launches through a fake driver: each device fact asked once, each function attribute set once -----

class FakeLaunchDriver(FakeDriver):
    """`FakeDriver` that also launches: `driver()` is a stand-in for `cuda.bindings.driver` whose
    calls succeed and are counted; the entry's real layout is a (u32, ptr) pair."""

    def __init__(self) -> None:
        super().__init__()
        ok = (0,)

        def call(name: str, result: tuple[Any, ...] = ok) -> Any:
            return lambda *args: self._count(name) or result

        def attribute() -> SimpleNamespace:
            return SimpleNamespace(value=SimpleNamespace(clusterDim=SimpleNamespace()))

        self.bindings = SimpleNamespace(
            CUresult=SimpleNamespace(CUDA_SUCCESS=0), CUfunction=int, CUstream=int, CUcontext=int,
            CUlaunchConfig=SimpleNamespace, CUlaunchAttribute=attribute,
            CUlaunchAttributeID=SimpleNamespace(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION=4,
                                                CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6),
            CUfunction_attribute=SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
                                                 CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED=16),
            cuLaunchKernelEx=call("cuLaunchKernelEx"), cuFuncSetAttribute=call("cuFuncSetAttribute"),
            cuCtxGetCurrent=call("cuCtxGetCurrent", (0, 1234)), cuCtxSetCurrent=call("cuCtxSetCurrent"),
            cuOccupancyMaxActiveClusters=call("cuOccupancyMaxActiveClusters", (0, 7)),
        )

    def device_attribute(self, ordinal: int, name: str) -> int:
        self._count(name)
        return {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
                "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 132,
                "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448}[name]

    def driver(self) -> SimpleNamespace:
        return self.bindings

    def check(self, result: tuple[Any, ...], what: str) -> Any:
        assert result[0] == 0, what
        return result[1] if len(result) == 2 else None

    def param_info(self, func: int, what: str) -> list[tuple[int, int]]:
        self._count("param_info")
        return [(0, 4), (8, 8)]

    def function_attribute(self, func: int, name: str, what: str) -> int:
        self._count(name)
        return 1024

    def primary_context(self, ordinal: int) -> int:
        return 1234

    def pointer_device(self, address: int) -> int | None:
        return 0


def launch_manifest() -> Manifest:
    entry = {"name": "k", "params": ["u32", "ptr"], "offsets": [0, 8],
             "launch": {"block": [256, 1, 1], "shared_mem": 100_000, "cluster": [2, 1, 1],
                        "grid": ["2 * min(sm_count, cdiv(args[0], 256))"]}}
    kernels = [{"id": "f/p0/sm_90a", "family": "f", "params": {"p": 0}, "arch": "sm_90a",
                "digest": "sha256:" + "ab" * 32, "size": 100, "target": "//k:t0", "entries": {"k": entry}}]
    return Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels}))


def test_launches_through_the_fake_driver_ask_each_fact_and_set_each_attribute_once() -> None:
    with using(FakeLaunchDriver()) as driver:
        kernel = launch.Library(launch_manifest(), store=FakeStore()).kernel("f/p0/sm_90a", device=0)  # type: ignore[arg-type]
        for n in (1 << 20, 1 << 10, 1 << 20):
            kernel.launch("k", args=(n, 0x7F00_0000_0000), stream=0)
        prepared = kernel.prepare("k", args=(1 << 20, None))
        for _ in range(3):
            prepared(0, 0x7F00_0000_0100)
        assert kernel.max_active_clusters("k", grid=2) == 7
        assert driver.calls == {
            "device_count": 1, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 1,
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 1, "load_library": 1, "library_function": 1,
            "param_info": 1,  # the layout, checked at the first launch
            "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 1,  # the grid rule's sm_count, asked once
            "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES": 1, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 1,
            "cuFuncSetAttribute": 1,  # the dynamic shared-memory limit raised once; a pair is a portable cluster
            "cuLaunchKernelEx": 6, "cuCtxGetCurrent": 3, "cuOccupancyMaxActiveClusters": 1,
        }
        assert prepared.calls == 3


def test_too_much_shared_memory_is_refused_naming_the_device_limit() -> None:
    from cubinstore.errors import BadArgumentError

    with using(FakeLaunchDriver()):
        kernel = launch.Library(launch_manifest(), store=FakeStore()).kernel("f/p0/sm_90a", device=0)  # type: ignore[arg-type]
        with pytest.raises(BadArgumentError, match=r"^kernel 'f/p0/sm_90a' entry 'k': shared_mem 232000 bytes plus "
                                                   r"1024 static exceeds device 0's limit of 232448 bytes per block$"):
            kernel.launch("k", args=(1, 0x7F00_0000_0000), shared_mem=232_000, stream=0)
