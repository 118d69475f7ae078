"""Two concurrency rows of RELIABILITY.md: gc while kernels load (a vanished entry is a miss,
refetched once per eviction; pinned entries stay), and writers racing to publish one JIT key with
different metadata (one writer's whole entry, published by one rename; never a mix)."""

from __future__ import annotations

import os
import pickle
import random
import select
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest
from helpers.blobs import disk_cache_with, random_blob
from helpers.children import read_line

from cubinstore import Digest, Manifest, Store
from cubinstore.internals import gc, pin, verify_store
from cubinstore.store import DiskCacheLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]
SIGNAL_TIMEOUT_S = 60  # only bounds a broken child; the tests never sleep on a timer


class CountingSource(DiskCacheLayer):
    """A real Bazel disk cache that counts the blobs it served: each one is a refetch."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.served: Counter[str] = Counter()
        self._lock = threading.Lock()

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        data = super().read(digest, size)
        if data is not None:
            with self._lock:
                self.served[digest.hex] += 1
        return data


def counting_source(root: Path, blobs: list[tuple[Digest, bytes]]) -> CountingSource:
    disk_cache_with(root, blobs)
    return CountingSource(root)


def temps(home: Path) -> list[Path]:
    return sorted((home / "v1").rglob(".tmp.*"))


def child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


# -- gc while kernels load ------------------------------------------------------------------------

def test_an_entry_gc_evicts_while_its_fill_returns_is_refetched_by_the_next_read(tmp_path: Path) -> None:
    # gc runs inside each read: after the fill stored the entry (under the fill lock), before the
    # read returns. The read still returns its verified bytes; the entry is gone, so the next read
    # of it is a miss that refetches. Every read but the first of each blob follows an eviction.
    blobs = [random_blob(2000 + 97 * i, seed=i) for i in range(12)]
    source = counting_source(tmp_path / "disk_cache", blobs)
    evicted: Counter[str] = Counter()

    class EvictedAfterEachFill(LocalLayer):
        def write_verified(self, digest: Digest, data: bytes) -> None:
            super().write_verified(digest, data)
            result = gc(LocalLayer(self.root), 0)  # another process's gc, evicting all it finds
            evicted.update(e.digest.hex for e in result.evicted)

    local = EvictedAfterEachFill(tmp_path / "home")
    store = Store([local, source])
    rounds = 5
    for r in range(rounds):
        for digest, data in random.Random(r).sample(blobs, len(blobs)):
            assert store.get(digest, len(data)) == data
            assert not local.path_for(digest).exists(), "gc did not evict the entry just filled"
    assert evicted == Counter({digest.hex: rounds for digest, _ in blobs})
    assert source.served == evicted  # each eviction made exactly one refetch, at the blob's next read
    assert store.stats.misses == rounds * len(blobs) and store.stats.hits == 0
    assert store.stats.bytes_fetched == rounds * sum(len(data) for _, data in blobs)
    assert temps(local.root) == []


_GC_LOOP = textwrap.dedent("""
    import sys
    from cubinstore.internals import gc
    from cubinstore.store import LocalLayer
    print("ready", flush=True)
    for _ in sys.stdin:  # one gc to 0 bytes per line; its evictions on one line
        result = gc(LocalLayer(sys.argv[1]), 0)
        print(" ".join(e.digest.hex for e in result.evicted) or "-", flush=True)
""")


def test_gc_in_another_process_while_kernels_load_never_breaks_a_read_and_each_eviction_is_one_refetch(
        make_release, tmp_path: Path) -> None:
    home = tmp_path / "home"
    release = make_release(n=6, size=3000, seed=1)
    pinned_blobs = [(Digest(hex_), data) for hex_, data in release.blobs.items()]
    loose = [random_blob(1500 + 131 * i, seed=100 + i) for i in range(20)]
    blobs = pinned_blobs + loose
    source = counting_source(tmp_path / "disk_cache", blobs)
    local = LocalLayer(home)
    for digest, data in blobs:
        local.write(digest, data)
    pin(local, Manifest.from_path(release.path))
    store = Store([local, source])

    evictions: list[list[str]] = []
    proc = child(_GC_LOOP, str(home))
    try:
        assert read_line(proc, "ready", SIGNAL_TIMEOUT_S) == "ready"
        assert proc.stdin is not None and proc.stdout is not None
        rng = random.Random(5)
        for _ in range(30):
            proc.stdin.write("gc\n")  # released: the child's gc runs while this thread reads
            proc.stdin.flush()
            while True:  # read every blob, pass after pass, until that gc has finished
                for digest, data in rng.sample(blobs, len(blobs)):
                    assert store.get(digest, len(data)) == data
                if select.select([proc.stdout], [], [], 0)[0]:
                    break
            line = read_line(proc, "evicted", SIGNAL_TIMEOUT_S)
            evictions.append([] if line == "-" else line.split())
        proc.stdin.close()
        assert proc.wait(SIGNAL_TIMEOUT_S) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        stop([proc])
    for digest, data in blobs:  # a last read of each, after its last eviction
        assert store.get(digest, len(data)) == data

    evicted = Counter(hex_ for round_ in evictions for hex_ in round_)
    assert set(evictions[0]) == {digest.hex for digest, _ in loose}  # the first gc found every loose entry
    assert not {digest.hex for digest, _ in pinned_blobs} & set(evicted), "gc evicted a pinned entry"
    assert sum(evicted.values()) > len(loose)
    assert source.served == evicted  # per blob: one refetch for each eviction, none without one
    assert store.stats.misses == sum(evicted.values())
    assert store.stats.bytes_fetched == sum(len(data) * evicted[digest.hex] for digest, data in blobs)
    report = verify_store(LocalLayer(home))
    assert report.corrupt == [] and report.ok == len(blobs) + 1  # + the pinned manifest
    assert temps(home) == []


# -- writers racing to publish one JIT key with different metadata --------------------------------

_PUBLISHER = textwrap.dedent("""
    import pickle, sys
    from cubinstore import Digest
    from cubinstore.internals import JitIndex
    from cubinstore.store import LocalLayer
    local = LocalLayer(sys.argv[1])
    index = JitIndex(local)
    with open(sys.argv[2], "rb") as f:
        shared, rounds = pickle.load(f)
    print("ready", flush=True)
    for (cubin, entry), _ in zip(rounds, sys.stdin):  # each round waits for its line
        local.write(Digest.of(shared), shared)  # a blob every writer stores: one digest, one record
        local.write(entry.digest, cubin)  # its own CUBIN first, as a compile does
        for _ in range(2):
            index.put(entry)  # then the entry naming it
        print("done", flush=True)
""")


def test_writers_racing_to_publish_one_jit_key_leave_one_writers_whole_entry(tmp_path: Path) -> None:
    pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")
    from cubinstore.internals import JitIndex, abi, compiler, key

    home = tmp_path / "home"
    writers, rounds, kernels = 4, 20, 1500
    parts = key.KeyParts(
        scheme=key.SCHEME, source="xxh3:" + "1" * 32, source_name="tu.cu", includes=("xxh3:" + "2" * 32,),
        flags=("-DFACTOR=2",), arch="sm_90a", toolkit={"version": "12.8", "files": "xxh3:" + "3" * 32},
        host={"name": "gcc", "identity": "gcc 13"})
    k = key.make_key(parts)
    # Same key, different metadata: each writer's CUBIN (digest, size) and kernels, new each round.
    # The kernel lists make each entry ~40 KB, so a torn or interleaved write would show.
    cubins: dict[tuple[int, int], bytes] = {}
    entries: dict[tuple[int, int], object] = {}
    for w in range(writers):
        for r in range(rounds):
            cubin = b"\x7fELF" + f"writer {w} round {r}".encode() + random.Random(w * 1000 + r).randbytes(3000 + w + r)
            cubins[w, r] = cubin
            entries[w, r] = compiler.IndexEntry(k.hex, Digest.of(cubin), len(cubin), parts.arch,
                                                tuple(f"scale_w{w}_r{r}_{i:04d}" for i in range(kernels)), parts)
    published = {abi.dumps_canonical(e.to_json()): wr for wr, e in entries.items()}  # whole entry -> (writer, round)
    shared = random.Random(7).randbytes(50_000)
    plans = []
    for w in range(writers):
        plans.append(tmp_path / f"writer{w}.pickle")
        plans[-1].write_bytes(pickle.dumps((shared, [(cubins[w, r], entries[w, r]) for r in range(rounds)])))

    index = JitIndex(LocalLayer(home))
    where = (("jit", "index", k.hex[:2]), f"{k.hex}.json")
    seen_mixed: list[bytes] = []
    polls = Counter[str]()
    done = threading.Event()

    def poll() -> None:  # a reader of the entry while the writers publish: absent or one writer's whole entry
        reader = LocalLayer(home)
        while not done.is_set():
            raw = reader.read_file(*where, 1 << 20)
            polls["absent" if raw is None else "entry"] += 1
            if raw is not None and raw not in published:
                seen_mixed.append(raw)

    procs = [child(_PUBLISHER, str(home), str(plan)) for plan in plans]
    poller = threading.Thread(target=poll)
    winners: Counter[int] = Counter()
    try:
        for p in procs:
            assert read_line(p, "ready", SIGNAL_TIMEOUT_S) == "ready"
        poller.start()
        for r in range(rounds):
            for p in procs:  # all waiting on stdin: release them together
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                assert read_line(p, "done", SIGNAL_TIMEOUT_S) == "done"
            raw = LocalLayer(home).read_file(*where, 1 << 20)
            assert raw is not None and published.get(raw, (None, None))[1] == r, "not one writer's whole entry of this round"
            w, _ = published[raw]
            winners[w] += 1
            got = index.get(k.hex)
            assert got == entries[w, r]
            # It verifies: its key and parts make the key, its arch is the key's, and the CUBIN it
            # names is in the store, whole, and is the same writer's.
            assert got.key == k.hex and key.make_key(got.parts) == k and got.arch == parts.arch
            assert Store([LocalLayer(home)]).get(got.digest, got.size) == cubins[w, r]
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            assert p.wait(SIGNAL_TIMEOUT_S) == 0, p.stderr.read() if p.stderr else ""
    finally:
        done.set()
        if poller.is_alive():
            poller.join(SIGNAL_TIMEOUT_S)
        stop(procs)
    assert seen_mixed == []
    assert polls["entry"] > 0
    assert sum(winners.values()) == rounds
    assert temps(home) == []
    local = LocalLayer(home)
    assert Store([local]).get(Digest.of(shared), len(shared)) == shared
    report = verify_store(local)
    # Every entry, the shared one too, verifies; each record (where the filesystem keeps them)
    # came with its entry's rename and matches its bytes: none missing, none stale.
    assert report.corrupt == [] and report.ok == writers * rounds + 1
    assert report.records["recorded"] == 0 and report.records["re-recorded"] == 0
