"""Library.kernel() on a loaded kernel: device facts queried once, the selection cached.

No GPU needed: the driver is a fake that counts calls; the load itself is stubbed (the GPU
tests cover it), so what is measured is the per-call work around it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cubinstore import launch
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
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(launch, "_device_count", [])
    monkeypatch.setattr(launch, "_capabilities", {})

    def counted(name: str, value: Any) -> Any:
        def call(*args: Any) -> Any:
            drv.count(name)
            return value
        return call

    driver_module = SimpleNamespace(cuCtxGetCurrent=counted("cuCtxGetCurrent", (0, 1234)))
    monkeypatch.setattr(launch._cuda, "driver", lambda: driver_module)
    monkeypatch.setattr(launch._cuda, "check", lambda result, what: result[1])
    monkeypatch.setattr(launch._cuda, "_primary", {0: 1234})
    monkeypatch.setattr(launch._cuda, "device_count", counted("cuDeviceGetCount", 1))
    monkeypatch.setattr(launch._cuda, "compute_capability", counted("cuDeviceGetAttribute", (9, 0)))
    monkeypatch.setattr(launch._cuda, "current_device", counted("cuCtxGetDevice", 0))
    module = SimpleNamespace(functions={"k": object()}, load_seconds=0.0)
    monkeypatch.setattr(launch, "load", lambda spec, ordinal, cc, store: module)
    monkeypatch.setattr(launch, "check_function_layout", lambda spec, symbol, fn, ordinal: ())
    return drv


def test_a_loaded_kernel_costs_one_driver_call_per_lookup(fake: FakeDriver) -> None:
    lib = launch.Library(manifest(), store=object())  # type: ignore[arg-type]
    first = lib.kernel("f", p=3)
    assert first.spec.id == "f/p3/sm_90a"
    before = dict(fake.calls)
    for _ in range(100):
        assert lib.kernel("f", p=3).spec is first.spec
        assert lib.kernel("f/p4/sm_90a").spec.id == "f/p4/sm_90a"
    after = {k: v - before.get(k, 0) for k, v in fake.calls.items() if v != before.get(k, 0)}
    assert after == {"cuCtxGetCurrent": 200}  # no device count, attribute or device query again


def test_an_unhashable_param_is_not_cached_but_still_selected(fake: FakeDriver) -> None:
    real = manifest()
    spec = real.by_id("f/p1/sm_90a")
    asked: list[Any] = []
    stub = SimpleNamespace(select=lambda *a, **k: asked.append(k) or spec)
    lib = launch.Library(stub, store=object())  # type: ignore[arg-type]
    for _ in range(3):
        assert lib.kernel("f", p=[1]).spec is spec  # type: ignore[arg-type]
    assert asked == [{"p": [1]}] * 3 and lib._selected == {}


def test_a_bad_device_is_still_refused_naming_the_range(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    from cubinstore.errors import BadArgumentError

    def check_ordinal(ordinal: Any) -> int:
        raise BadArgumentError(f"invalid device {ordinal!r}: expected an ordinal in [0, 1)")

    monkeypatch.setattr(launch._cuda, "check_ordinal", check_ordinal)
    lib = launch.Library(manifest(), store=object())  # type: ignore[arg-type]
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
def stubbed_driver(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Device facts of two sm_90 GPUs and a driver whose loads record the bytes they were given."""
    import contextlib

    from cubinstore import _loader

    loaded: list[bytes] = []
    monkeypatch.setattr(launch, "_device_count", [2])
    monkeypatch.setattr(launch, "_capabilities", {0: (9, 0), 1: (9, 0)})
    monkeypatch.setattr(launch._cuda, "on_device", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(launch._cuda, "load_library", lambda data, what: loaded.append(data) or len(loaded))
    monkeypatch.setattr(launch._cuda, "library_function", lambda library, entry, what: 1)
    monkeypatch.setattr(_loader, "_modules", {})
    return loaded


def test_a_blob_is_read_and_hashed_once_per_process_however_many_devices_load_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stubbed_driver: list[bytes]) -> None:
    import hashlib
    import os

    from cubinstore._core.digest import Digest
    from cubinstore.store import LocalStore, MemoryStore, Store

    data = cubin_like(0)
    digest = Digest.of(data)
    local = LocalStore(tmp_path / "home")
    local.write(digest, data)
    kernels = [{"id": "f/p0/sm_90a", "family": "f", "params": {"p": 0}, "arch": "sm_90a", "digest": str(digest),
                "size": len(data), "target": "//k:t0", "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}}]
    lib = launch.Library(Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels})),
                         Store([MemoryStore(), local]))  # the layers of Store.from_env, without remotes
    opened: list[Any] = []
    hashed: list[int] = []
    real_open, real_sha256 = os.open, hashlib.sha256
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    monkeypatch.setattr(hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real_sha256(b))
    lib.kernel("f/p0/sm_90a", device=0)
    assert hashed == [len(data)] and opened[-1] == digest.hex  # one verified read (and the shard opened once)
    opened.clear()
    hashed.clear()
    lib.kernel("f/p0/sm_90a", device=1)
    lib.kernel("f/p0/sm_90a", device=0)  # loaded already: nothing to do
    assert opened == [] and hashed == []
    assert len(stubbed_driver) == 2 and stubbed_driver[0] is stubbed_driver[1]  # the one verified bytes object
    assert stubbed_driver[0] == data
