"""Many processes and threads needing the same blobs: one download per blob, every file valid."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest, Store
from cubinstore.internals import verify_store
from cubinstore.store import HttpLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def upload(url: str, blobs: dict[str, bytes]) -> None:
    remote = HttpLayer(url)
    for hex_, data in blobs.items():
        remote.put(Digest(hex_), data)


def test_16_processes_prefetching_one_manifest_download_each_blob_once(nginx, make_release, cli_env, clean_env: Path) -> None:
    release = make_release(n=6, size=200_000)
    url = nginx.base(slow=True)  # 1 MB/s: downloads overlap, so the per-digest lock is exercised
    upload(url, release.blobs)
    procs = [
        subprocess.Popen([sys.executable, "-m", "cubinstore", "prefetch", str(release.path), "--remote", url],
                         env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(16)
    ]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    for code, _out, err in results:
        assert code == 0, err
    for hex_ in release.blobs:
        assert nginx.requests("GET", hex_) == 1, f"sha256:{hex_} downloaded {nginx.requests('GET', hex_)} times"
    local = LocalLayer(clean_env)
    report = verify_store(local)
    manifest = Manifest.from_path(release.path)
    assert report.corrupt == [] and report.ok == len(release.blobs) + 1  # + the manifest itself
    for digest, _size in manifest.blobs:
        assert local.path_for(digest).read_bytes() == release.blobs[digest.hex]
    assert list(clean_env.rglob(".tmp.*")) == []
    stats = local.read_stats()
    assert stats["bytes_fetched"] == sum(map(len, release.blobs.values()))
    assert stats["misses"] == len(release.blobs) and stats["hits"] == 15 * len(release.blobs)


def test_threads_of_one_process_share_one_download(nginx, make_release, tmp_path: Path) -> None:
    release = make_release(n=1, size=300_000)
    url = nginx.base(slow=True)
    upload(url, release.blobs)
    (hex_, data), = release.blobs.items()
    results: list[bytes] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            results.append(Store([LocalLayer(tmp_path), HttpLayer(url)]).get(Digest(hex_), len(data)))
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [data] * 8
    assert nginx.requests("GET", hex_) == 1


def test_an_entry_pending_in_an_idle_grouped_batch_is_committed_for_a_process_that_waits_for_it(
        tmp_path: Path) -> None:
    # A prefetch staged an entry (its lock held until the rename) and then stages nothing more
    # and waits for nothing: another process waiting for that lock must get the entry from the
    # group timer's commit, not wait until the prefetch ends (nor download it again).
    from helpers.blobs import random_blob

    from cubinstore.store.layer import Layer
    from cubinstore.store.local.batch import GROUP_SECONDS

    digest, data = random_blob(3000, 7)

    class Source(Layer):
        name = "source"

        def __init__(self) -> None:
            self.reads = 0

        def read(self, d: Digest, size: int | None) -> bytes | None:
            self.reads += 1
            return data

    first, second = Source(), Source()
    s1, s2 = LocalLayer(tmp_path, lock_timeout=30.0), LocalLayer(tmp_path, lock_timeout=30.0)
    with s1.batch(grouped=True):
        assert Store([s1, first], strict=True).get(digest, len(data)) == data  # staged, pending
        started = time.monotonic()
        assert Store([s2, second]).get(digest, len(data)) == data  # waits for s1's lock, then hits
        waited = time.monotonic() - started
    assert first.reads == 1 and second.reads == 0
    assert waited < GROUP_SECONDS + 10  # the timer's commit, far inside the 30 s lock timeout


def test_two_grouped_batches_waiting_for_each_others_pending_entries_both_finish(tmp_path: Path) -> None:
    # Two prefetches (two LocalLayers of one root: their range locks exclude each other like two
    # processes'). Each stages one entry whose fetching thread then ends, and each has a thread
    # already waiting for the other's entry: only a waiter that commits its own group on every
    # poll (not only on its first) lets both go on.
    import types

    from helpers.blobs import random_blob

    from cubinstore.store.layer import Layer

    (a, data_a), (b, data_b) = random_blob(3000, 1), random_blob(3000, 2)
    blobs = {a: data_a, b: data_b}
    gates = {a: threading.Event(), b: threading.Event()}
    started = {a: threading.Event(), b: threading.Event()}

    class Gated(Layer):
        name = "gated source"

        def read(self, digest: Digest, size: int | None) -> bytes | None:
            started[digest].set()
            assert gates[digest].wait(30)
            return blobs[digest]

    waiting: dict[str, threading.Event] = {"t1b": threading.Event(), "t2b": threading.Event()}

    def sleep(seconds: float) -> None:  # the lock's poll: record who waits
        event = waiting.get(threading.current_thread().name)
        if event is not None:
            event.set()
        time.sleep(seconds)

    clock = types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep)
    s1, s2 = LocalLayer(tmp_path, lock_timeout=20.0, clock=clock), LocalLayer(tmp_path, lock_timeout=20.0, clock=clock)
    st1, st2 = Store([s1, Gated()], strict=True), Store([s2, Gated()], strict=True)
    errors: list[BaseException] = []

    def run(store: Store, digest: Digest) -> None:
        try:
            assert store.get(digest, len(blobs[digest])) == blobs[digest]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with s1.batch(grouped=True), s2.batch(grouped=True):
        t1a = threading.Thread(target=run, args=(st1, a), name="t1a")  # s1 fetches a
        t2a = threading.Thread(target=run, args=(st2, b), name="t2a")  # s2 fetches b
        t1a.start(), t2a.start()
        assert started[a].wait(30) and started[b].wait(30)  # both hold their locks, fetching
        t1b = threading.Thread(target=run, args=(st1, b), name="t1b")  # s1 wants b
        t2b = threading.Thread(target=run, args=(st2, a), name="t2b")  # s2 wants a
        t1b.start(), t2b.start()
        assert waiting["t1b"].wait(30) and waiting["t2b"].wait(30)  # both wait; each group is empty
        gates[a].set(), gates[b].set()  # a and b are staged, pending, their fetching threads end
        for t in (t1a, t2a, t1b, t2b):
            t.join(60)
        assert errors == []
    assert verify_store(LocalLayer(tmp_path)).ok == 2


# One Store.get of one digest. The only imports are what that needs (the store, its HTTP layer):
# about 0.15 s of CPU each, so all 32 are ready within about 5 s on a 2-core host. The times are
# CLOCK_MONOTONIC, one clock for every process of the host.
_GET_CHILD = """
import os, sys, time
from cubinstore import Digest
from cubinstore.store import HttpLayer, LocalLayer, Store
store = Store([LocalLayer(sys.argv[1]), HttpLayer(sys.argv[2])])
digest, size = Digest(sys.argv[3]), int(sys.argv[4])
out = sys.stdout.buffer
out.write(b"ready\\n")
out.flush()
os.read(0, 1)  # the barrier: every child reads one pipe, which the parent closes once all are ready
began = time.monotonic()
data = store.get(digest, size)
ended = time.monotonic()
stats = store.stats
out.write(f"{stats.misses} {stats.hits} {began} {ended}\\n".encode())
out.write(data)
out.flush()
"""


def test_32_processes_getting_one_digest_into_an_empty_store_download_it_once(nginx, cli_env, tmp_path: Path) -> None:
    from helpers.blobs import random_blob

    processes = 32
    digest, data = random_blob(512 * 1024, 32)  # half a second at /slow/'s 1 MB/s: the others wait on its lock
    url = nginx.base(slow=True)
    upload(url, {digest.hex: data})
    home = tmp_path / "home"
    gate, release = os.pipe()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            procs.append(subprocess.Popen([sys.executable, "-c", _GET_CHILD, str(home), url, digest.hex, str(len(data))],
                                          env=cli_env, stdin=gate, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        os.close(gate)
        gate = -1
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline() != b"ready\n":
                pytest.fail(f"a child never got ready: {p.communicate(timeout=60)[1].decode()}")
        assert not home.exists()  # all imported, none has touched the store yet
        os.close(release)  # end of file for all 32 at once
        release = -1
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for fd in (gate, release):
            if fd != -1:
                os.close(fd)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    counts, spans = [], []
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err.decode()
        header, body = out.split(b"\n", 1)
        misses, hits, began, ended = header.split()
        assert body == data and hashlib.sha256(body).hexdigest() == digest.hex
        counts.append((int(misses), int(hits)))
        spans.append((float(began), float(ended)))
    # The barrier worked: every get began before the first one returned, so all 32 overlapped.
    assert max(b for b, _ in spans) < min(e for _, e in spans)
    assert nginx.requests("GET", digest.hex) == 1
    assert sorted(counts) == [(0, 1)] * (processes - 1) + [(1, 0)]  # one fetched it, 31 found it stored
    local = LocalLayer(home)
    entries, strays = local.scan()
    assert [e.digest for e in entries] == [digest] and strays == []  # one final file, no temp beside it
    assert local.path_for(digest).read_bytes() == data
    assert list(home.rglob(".tmp.*")) == []
    report = verify_store(local)
    assert report.corrupt == [] and report.ok == 1
