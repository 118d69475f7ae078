"""Commands at scale: linear work in the number of blobs, kept-alive connections, parallel
downloads that still fetch each blob once, one sync per group of blobs and one fsync per shard
directory per batch."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers.scale import assert_linear, count_work

from cubinstore import Digest, Manifest, Store
from cubinstore.internals import fetch_blobs, gc, pack, unpack, verify_store
from cubinstore.manifest import dumps_canonical
from cubinstore.store import DiskCacheLayer, HttpLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def release(root: Path, n: int, size: int = 300, shared: int = 1) -> tuple[Manifest, dict[str, bytes]]:
    """n kernels over n // shared blobs (kernels of several archs may share a CUBIN), in a disk cache at root."""
    rng = random.Random(n)
    blobs: dict[str, bytes] = {}
    kernels = []
    for i in range(n):
        data = rng.randbytes(size) + (i // shared).to_bytes(4, "little")
        hex_ = hashlib.sha256(data).hexdigest()
        blobs[hex_] = data
        kernels.append({"id": f"f/p{i}/sm_90a", "family": "f", "params": {"p": i}, "arch": "sm_90a",
                        "digest": f"sha256:{hex_}", "size": len(data), "target": f"//k:t{i}",
                        "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}})
    for hex_, data in blobs.items():
        path = root / "cas" / hex_[:2] / hex_
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels})), blobs


# -- linear in N ----------------------------------------------------------------------------------

def test_prefetch_is_linear_in_the_closure(tmp_path: Path) -> None:
    def work(n: int) -> int:
        manifest, _ = release(tmp_path / f"src{n}", n, shared=2)
        store = Store([LocalLayer(tmp_path / f"home{n}"), DiskCacheLayer(tmp_path / f"src{n}")], strict=True)
        names = lambda d: ", ".join(manifest.ids_of(d))  # noqa: E731 - what the CLI passes
        return count_work(lambda: fetch_blobs(store, list(manifest.blobs), names=names, jobs=1))
    assert_linear(work, 300)


def test_pack_and_unpack_are_linear_in_the_closure(tmp_path: Path) -> None:
    def work(n: int) -> int:
        manifest, _ = release(tmp_path / f"src{n}", n)
        store = Store([DiskCacheLayer(tmp_path / f"src{n}")])
        bundle = tmp_path / f"b{n}.tar"
        target = LocalLayer(tmp_path / f"home{n}")
        return count_work(lambda: (pack(manifest, store, bundle), unpack(bundle, target, expect=manifest.digest)))
    assert_linear(work, 300)


def test_pack_from_the_local_store_is_linear_in_the_closure(tmp_path: Path) -> None:
    # The fast path (LocalLayer.read_verified_entries): no per-blob lookup of anything that grows.
    def work(n: int) -> int:
        manifest, blobs = release(tmp_path / f"src{n}", n)
        local = LocalLayer(tmp_path / f"home{n}")
        with local.batch():
            for hex_, data in blobs.items():
                local.write_verified(Digest(hex_), data)
        bundle = tmp_path / f"b{n}.tar"
        return count_work(lambda: pack(manifest, Store([local]), bundle))
    assert_linear(work, 300)


def test_verify_ls_and_gc_are_linear_in_the_store(tmp_path: Path) -> None:
    def work(n: int) -> int:
        manifest, blobs = release(tmp_path / f"src{n}", n)
        local = LocalLayer(tmp_path / f"home{n}")
        for hex_, data in blobs.items():
            local.write(Digest(hex_), data)
        return count_work(lambda: (verify_store(local), verify_store(local, list(manifest.blobs)),
                                   [local.status(k.digest, k.size) for k in manifest.kernels], gc(local, 0)))
    assert_linear(work, 300)


# -- HTTP: kept-alive connections -----------------------------------------------------------------

class _CountingServer:
    """HTTP/1.1 CAS on loopback that counts TCP connections; ``drop_after`` closes each
    connection silently after that many responses (what an idle timeout does)."""

    def __init__(self, blobs: dict[str, bytes], drop_after: int | None = None) -> None:
        self.connections = 0
        self.gets: dict[str, int] = {}
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.served = 0
                with lock:
                    outer.connections += 1

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hex_ = self.path.rsplit("/", 1)[-1]
                with lock:
                    outer.gets[hex_] = outer.gets.get(hex_, 0) + 1
                data = blobs.get(hex_)
                self.send_response(200 if data is not None else 404)
                self.send_header("Content-Length", str(len(data or b"")))
                self.end_headers()
                self.wfile.write(data or b"")
                self.served += 1
                if drop_after is not None and self.served >= drop_after:
                    self.close_connection = True  # no Connection: close header: the client learns on reuse

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def blobs() -> dict[str, bytes]:
    rng = random.Random(5)
    out = {}
    for i in range(40):
        data = rng.randbytes(2000 + i)
        out[hashlib.sha256(data).hexdigest()] = data
    return out


@pytest.fixture
def server(request: pytest.FixtureRequest, blobs: dict[str, bytes]) -> Iterator[_CountingServer]:
    srv = _CountingServer(blobs, drop_after=getattr(request, "param", None))
    yield srv
    srv.stop()


def test_sequential_gets_share_one_connection(server: _CountingServer, blobs: dict[str, bytes]) -> None:
    remote = HttpLayer(server.url)
    for hex_, data in blobs.items():
        assert remote.read(Digest(hex_), len(data)) == data
    assert remote.read(Digest("0" * 64), 10) is None  # a 404 keeps the connection too
    assert server.connections == 1


@pytest.mark.parametrize("server", [1, 3], indirect=True)
def test_a_connection_the_server_closed_is_replaced_without_using_a_retry(server: _CountingServer,
                                                                          blobs: dict[str, bytes]) -> None:
    remote = HttpLayer(server.url, retries=0)
    for hex_, data in blobs.items():
        assert remote.read(Digest(hex_), len(data)) == data
    assert all(count == 1 for count in server.gets.values())


def test_parallel_prefetch_downloads_each_blob_once_over_few_connections(server: _CountingServer, blobs: dict[str, bytes],
                                                                         tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    store = Store([local, HttpLayer(server.url)], strict=True)
    wanted = [(Digest(h), len(d)) for h, d in sorted(blobs.items())]
    failures = fetch_blobs(store, wanted, names=str, jobs=8)
    assert failures == []
    assert server.gets == dict.fromkeys(blobs, 1)
    assert server.connections <= 8
    assert all(local.path_for(Digest(h)).read_bytes() == d for h, d in blobs.items())
    assert list(local.root.rglob(".tmp.*")) == []


def test_prefetch_failures_come_back_in_blob_order(server: _CountingServer, blobs: dict[str, bytes], tmp_path: Path) -> None:
    store = Store([LocalLayer(tmp_path / "home"), HttpLayer(server.url, retries=0)], strict=True)
    missing = [Digest(hashlib.sha256(bytes([i])).hexdigest()) for i in range(5)]
    wanted = sorted([*((d, 1) for d in missing), *((Digest(h), len(d)) for h, d in blobs.items())], key=lambda b: b[0].hex)
    failures = fetch_blobs(store, wanted, names=lambda d: f"kernel-{d.short}", jobs=4)
    order = [d for d, _ in wanted if d in missing]
    assert [f.split(" ", 1)[0] for f in failures] == [str(d) for d in order]
    assert all(f"kernel-{d.short}" in f for d, f in zip(order, failures))


# -- fsync: each file, each directory once per batch ----------------------------------------------

def _count_syncs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[Path], dict[str, Any]]:
    """fsyncs (patched in os) and filesystem syncs (through the returned ``LocalLayer`` keywords)."""
    from cubinstore.store.local.root import sync_filesystem as real_fs

    synced: list[str] = []
    filesystems: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real(fd)

    def sync_filesystem(path: Path) -> bool:
        filesystems.append(path)
        return real_fs(path)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced, filesystems, {"sync_filesystem": sync_filesystem}


def _record_commits(monkeypatch: pytest.MonkeyPatch, *,
                    syncfs: bool = True) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Events of a grouped batch in order: ("temp", entry), ("sync", ""), ("fsync", ""), ("rename", entry),
    and the ``LocalLayer`` keywords that record the temp writes and syncs."""
    from cubinstore.store.local.root import sync_filesystem as real_fs, write_temp_at as real_temp

    events: list[tuple[str, str]] = []
    real_replace, real_fsync = os.replace, os.fsync

    def write_temp_at(dir_fd: int, name: str, *args: object, **kwargs: object) -> str:
        tmp = real_temp(dir_fd, name, *args, **kwargs)
        events.append(("temp", name))
        return tmp

    def replace(src: str, dst: str, **kwargs: object) -> None:
        real_replace(src, dst, **kwargs)
        events.append(("rename", os.path.basename(dst)))

    def fsync(fd: int) -> None:
        events.append(("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync", ""))
        real_fsync(fd)

    def sync_filesystem(path: Path) -> bool:
        events.append(("sync", ""))
        return syncfs and real_fs(path)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    return events, {"sync_filesystem": sync_filesystem, "write_temp": write_temp_at}


def _durable_before_visible(events: list[tuple[str, str]], kind: str) -> None:
    """Each entry's rename comes after a flush (``kind``) that followed its temp file's write."""
    written: dict[str, int] = {}
    last_flush = -1
    for i, (what, name) in enumerate(events):
        if what == "temp":
            written[name] = i
        elif what == kind:
            last_flush = i
        elif what == "rename" and name in written:
            assert written[name] < last_flush, f"{name} renamed before a {kind} after its write"


def test_prefetch_makes_each_blob_durable_before_visible_with_one_sync_per_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A power loss mid-prefetch never leaves a short entry at a final path; one sync per group.
    from cubinstore.store.local.cas import GROUP_MAX

    manifest, blobs = release(tmp_path / "src", 600)
    events, primitives = _record_commits(monkeypatch)
    local = LocalLayer(tmp_path / "home", **primitives)
    store = Store([local, DiskCacheLayer(tmp_path / "src")], strict=True)
    assert fetch_blobs(store, list(manifest.blobs), names=str, jobs=4) == []
    _durable_before_visible(events, "sync")
    renamed = [name for what, name in events if what == "rename"]
    assert sorted(renamed) == sorted(blobs)  # each entry renamed once, from its own temp file
    syncs = sum(1 for what, _ in events if what == "sync")
    # ceil(600 / GROUP_MAX) full groups, and more only when a group grew old (a slow host).
    assert -(-600 // GROUP_MAX) <= syncs < 600 // 4
    assert sum(1 for what, _ in events if what == "fsync") == 0
    assert sum(1 for what, _ in events if what == "dir") == len({h[:2] for h in blobs})
    assert verify_store(local).ok == 600
    assert list(local.cas_dir.rglob(".tmp.*")) == []


def test_prefetch_without_syncfs_fsyncs_each_blob_before_its_rename(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, blobs = release(tmp_path / "src", 300)
    events, primitives = _record_commits(monkeypatch, syncfs=False)
    local = LocalLayer(tmp_path / "home", **primitives)
    store = Store([local, DiskCacheLayer(tmp_path / "src")], strict=True)
    assert fetch_blobs(store, list(manifest.blobs), names=str, jobs=4) == []
    assert sum(1 for what, _ in events if what == "fsync") == 300
    # Each rename after the fsync of its own temp: the fsyncs of a group all come before its renames.
    _durable_before_visible(events, "fsync")
    assert verify_store(local).ok == 300


def test_a_waiter_in_another_process_gets_a_blob_held_in_a_pending_group(tmp_path: Path) -> None:
    # The entry's lock is held until its group is renamed into place: the waiter finds it, no second fetch.
    manifest, blobs = release(tmp_path / "src", 3)
    first = sorted(blobs)[0]
    local = LocalLayer(tmp_path / "home", lock_timeout=30.0)
    store = Store([local, DiskCacheLayer(tmp_path / "src")], strict=True)
    waiter = textwrap.dedent(f"""
        import sys
        from cubinstore import Digest, Store
        from cubinstore.store import LocalLayer, MemoryLayer
        from cubinstore.store.layer import Layer

        class Never(Layer):  # a second fetch would come here and fail
            name = "a source that must not be asked"
            def read(self, digest, size):
                raise SystemExit("fetched twice")

        import time
        real_sleep = time.sleep
        def sleep(seconds):  # the lock's poll: tell the parent once that we wait for its group
            global real_sleep
            if real_sleep is not None:
                print("waiting", flush=True)
                time.sleep, real_sleep = real_sleep, None
            return time.sleep(seconds)
        time.sleep = sleep
        store = Store([LocalLayer({str(local.root)!r}, lock_timeout=30.0), Never()])
        assert len(store.get(Digest({first!r}), {len(blobs[first])})) == {len(blobs[first])}
        print("got it", flush=True)
    """)
    with local.batch(grouped=True):
        store.get(Digest(first), len(blobs[first]))
        assert not local.path_for(Digest(first)).exists()  # pending: written, not yet visible
        proc = subprocess.Popen([sys.executable, "-c", waiter], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"  # blocked on the pending entry's lock
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "got it\n", err
    assert verify_store(local).ok == 1


def test_a_batch_that_syncs_each_blob_fsyncs_each_shard_directory_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, blobs = release(tmp_path / "src", 600)
    synced, filesystems, primitives = _count_syncs(monkeypatch)
    local = LocalLayer(tmp_path / "home", **primitives)
    with local.batch():
        for hex_, data in blobs.items():
            local.write(Digest(hex_), data)
    shards = {h[:2] for h in blobs}
    assert filesystems == []
    assert synced.count("file") == 600 and synced.count("dir") == len(shards) < 600


def test_unpack_makes_staged_blobs_durable_with_one_sync_before_any_rename(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    manifest, _ = release(tmp_path / "src", 400)
    bundle = tmp_path / "r.tar"
    pack(manifest, Store([DiskCacheLayer(tmp_path / "src")]), bundle)
    synced, filesystems, primitives = _count_syncs(monkeypatch)
    renamed_after_sync: list[bool] = []

    class Target(LocalLayer):  # a store that notes, at each staged blob's rename, whether a sync came first
        def commit_staged(self, name: str, digest: Digest) -> None:
            renamed_after_sync.append(bool(filesystems))
            super().commit_staged(name, digest)

    target = Target(tmp_path / "home", **primitives)
    unpack(bundle, target, expect=manifest.digest)
    assert filesystems == [target.root, target.root]  # staged bytes, then the renames
    assert all(renamed_after_sync) and len(renamed_after_sync) == 400
    assert synced == []
    assert verify_store(target).ok == 401


# -- pack: tarfile's bytes, written directly ------------------------------------------------------

def test_pack_writes_the_bytes_tarfile_would(tmp_path: Path) -> None:
    import io
    import tarfile

    from cubinstore.internals import bundle as _bundle

    for name, size in [("manifest.json", 1), ("cas/" + "ab" * 32, 4096), ("cas/" + "0f" * 32, 511), ("x", 8**11 - 1)]:
        assert _bundle._ustar_header(name, size) == _bundle._member(name, size).tobuf(
            tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    manifest, blobs = release(tmp_path / "src", 37)
    bundle = tmp_path / "r.tar"
    pack(manifest, Store([DiskCacheLayer(tmp_path / "src")]), bundle)
    expected = io.BytesIO()
    with tarfile.open(fileobj=expected, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_bundle._member(_bundle.MANIFEST_NAME, len(manifest.raw)), io.BytesIO(manifest.raw))
        for digest, _ in manifest.blobs:
            tar.addfile(_bundle._member(f"cas/{digest.hex}", len(blobs[digest.hex])), io.BytesIO(blobs[digest.hex]))
    assert bundle.read_bytes() == expected.getvalue()


def test_the_closure_pack_bundles_is_each_distinct_blob_once_sorted_by_digest() -> None:
    rng = random.Random(5)
    kernels = []
    for i in range(300):  # three kernels (archs) per CUBIN, in no order
        data = (i // 3).to_bytes(4, "little") * 100
        kernels.append({"id": f"f/p{i}/sm_90a", "family": "f", "params": {"p": i}, "arch": "sm_90a",
                        "digest": f"sha256:{hashlib.sha256(data).hexdigest()}", "size": len(data), "target": f"//k:t{i}",
                        "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}})
    rng.shuffle(kernels)
    m = Manifest.from_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels}))
    assert m._index._objs is not None, "expected the fast path"
    expected = sorted({(k["digest"], k["size"]) for k in kernels})
    assert [(str(d), s) for d, s in m.blobs] == expected and len(m.blobs) == 100
    for (digest, _), (text, _) in zip(m.blobs, expected):  # real Digests: equal, hashable, immutable
        assert type(digest) is Digest and digest == Digest.parse(text) and hash(digest) == hash(Digest.parse(text))
    with pytest.raises(AttributeError):
        m.blobs[0][0].hex = "0" * 64  # type: ignore[misc]


def test_pack_writes_the_bundle_in_small_pieces_even_a_large_manifest_or_blob(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import tarfile

    from cubinstore.internals import bundle as _bundle

    manifest, blobs = release(tmp_path / "src", 200, size=3 * _bundle._WRITE_CHUNK)
    assert len(manifest.raw) > 2 * _bundle._WRITE_CHUNK  # the manifest member is bigger than one piece too
    sizes: list[int] = []
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        sizes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)  # the standard library's: pack writes with os.write
    bundle = tmp_path / "r.tar"
    total = pack(manifest, Store([DiskCacheLayer(tmp_path / "src")]), bundle)
    monkeypatch.undo()
    assert max(sizes) == _bundle._WRITE_CHUNK and sum(sizes) == total == bundle.stat().st_size
    expected = io.BytesIO()
    with tarfile.open(fileobj=expected, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_bundle._member(_bundle.MANIFEST_NAME, len(manifest.raw)), io.BytesIO(manifest.raw))
        for digest, _ in manifest.blobs:
            tar.addfile(_bundle._member(f"cas/{digest.hex}", len(blobs[digest.hex])), io.BytesIO(blobs[digest.hex]))
    assert bundle.read_bytes() == expected.getvalue()


def test_a_prefetch_killed_mid_batch_leaves_only_whole_entries(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import textwrap

    manifest, _ = release(tmp_path / "src", 400, size=20_000)
    (tmp_path / "m.json").write_bytes(manifest.raw)
    home = tmp_path / "home"
    child = textwrap.dedent(f"""
        import sys
        from cubinstore import Manifest, Store
        from cubinstore.internals import fetch_blobs
        from cubinstore.store import DiskCacheLayer, LocalLayer
        m = Manifest.from_path({str(tmp_path / "m.json")!r})
        store = Store([LocalLayer({str(home)!r}), DiskCacheLayer({str(tmp_path / "src")!r})], strict=True)
        seen = []
        def names(d):
            seen.append(d)
            if len(seen) == 150:
                print("halfway", flush=True)
                sys.stdin.readline()  # blocks (the parent writes nothing) until the kill: mid-batch, deterministically
            return str(d)
        fetch_blobs(store, list(m.blobs), names=names, jobs=4)
        print("finished", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "halfway"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    local = LocalLayer(home)
    report = verify_store(local)
    # What reached a final path is whole; the blobs of the group not yet committed are temp files.
    assert report.corrupt == [] and report.ok < 400
    store = Store([local, DiskCacheLayer(tmp_path / "src")], strict=True)
    assert fetch_blobs(store, list(manifest.blobs), names=str, jobs=4) == []  # the rest is fetched again
    assert verify_store(local).ok == 400
