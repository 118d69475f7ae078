"""The local directory store: layout, atomic writes, corruption, hostile files, kills, disk full."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers.blobs import disk_cache_with, random_blob

from cubinstore import BadArgumentError, Digest, IntegrityError, LockTimeoutError, MissingBlobError, Store, StoreError
from cubinstore.internals import verify_store
from cubinstore.store import LocalLayer, MemoryLayer
from cubinstore.store.local.lock import RANGE_LOCKS

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]


def blob(n: int = 5000, seed: int | None = 0) -> tuple[Digest, bytes]:
    return random_blob(n, seed)


def temps(local: LocalLayer) -> list[Path]:
    return [p for p in local.cas_dir.rglob(".tmp.*")]


def test_layout_is_v1_cas_sharded_by_first_two_hex(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "root")
    digest, data = blob()
    local.write(digest, data)
    path = tmp_path / "root" / "v1" / "cas" / digest.hex[:2] / digest.hex
    assert path.read_bytes() == data
    assert local.path_for(digest) == path
    assert Store([local]).get(digest, len(data)) == data
    assert temps(local) == []


def test_write_refuses_bytes_that_do_not_match_the_digest(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    digest, data = blob()
    with pytest.raises(IntegrityError, match=r"^digest mismatch for sha256:"):
        local.write(digest, data + b"x")
    assert not local.path_for(digest).exists() and temps(local) == []


def test_miss_is_a_missing_blob_error_naming_digest_kernel_and_layers(tmp_path: Path) -> None:
    store = Store([MemoryLayer(), LocalLayer(tmp_path)])
    digest, data = blob()
    with pytest.raises(MissingBlobError) as info:
        store.get(digest, len(data), name="axpy/f32/vec4/sm_90a")
    message = str(info.value)
    assert message.startswith(f"{digest} (axpy/f32/vec4/sm_90a) ({len(data)} bytes) not available: memory: miss; local store {tmp_path}: miss")
    assert "CUBINSTORE_REMOTE" in message
    assert store.stats.misses == 1


@pytest.mark.parametrize("bad", ["sha256:../../etc/passwd", "sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha256:" + "a" * 63 + "\0", "../x"])
def test_malformed_digest_is_rejected_before_any_io(tmp_path: Path, bad: str) -> None:
    root = tmp_path / "root"
    with pytest.raises(BadArgumentError, match=r"^invalid digest"):
        Store([LocalLayer(root)]).get(bad)
    assert not root.exists()


@pytest.mark.parametrize("size", [0, -1, True, 1.5, 2**40])
def test_bad_size_is_rejected_before_any_io(tmp_path: Path, size: object) -> None:
    digest, _ = blob()
    with pytest.raises(BadArgumentError, match=r"^invalid size"):
        Store([LocalLayer(tmp_path / "root")]).get(digest, size)  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()


def test_empty_blob_digest_is_not_a_cubin(tmp_path: Path) -> None:
    with pytest.raises(BadArgumentError, match=r"^sha256:e3b0.* is the digest of zero bytes"):
        Store([LocalLayer(tmp_path)]).get(Digest.of(b""))


@pytest.mark.parametrize("damage", ["flip", "zero-length", "truncated", "appended"])
def test_corrupted_blob_is_refetched_not_loaded(tmp_path: Path, damage: str) -> None:
    digest, data = blob(8192)
    local = LocalLayer(tmp_path / "local")
    source = disk_cache_with(tmp_path / "disk_cache", [(digest, data)])  # any later layer works
    local.write(digest, data)
    path = local.path_for(digest)
    bad = {"flip": data[:100] + bytes([data[100] ^ 1]) + data[101:], "zero-length": b"",
           "truncated": data[:-1], "appended": data + b"\0"}[damage]
    path.write_bytes(bad)
    store = Store([local, source])
    got = store.get(digest, len(data), name="k")
    assert got == data
    assert store.stats.verification_failures == 1 and store.stats.misses == 1
    assert path.read_bytes() == data  # refetched and rewritten
    quarantined = list(local.quarantine_dir.iterdir())
    assert len(quarantined) == 1 and quarantined[0].read_bytes() == bad


def test_corrupt_entry_offline_is_an_integrity_error_and_quarantined(tmp_path: Path) -> None:
    digest, data = blob()
    local = LocalLayer(tmp_path)
    local.write(digest, data)
    local.path_for(digest).write_bytes(b"\0" * len(data))
    with pytest.raises(IntegrityError) as info:
        Store([local]).get(digest, len(data), name="axpy/f32/vec1/sm_80")
    assert str(info.value).startswith(f"{digest} (axpy/f32/vec1/sm_80) ({len(data)} bytes) not available: local store {tmp_path}: digest mismatch")
    assert not local.path_for(digest).exists()
    assert len(list(local.quarantine_dir.iterdir())) == 1


def test_size_is_checked_and_a_wrong_requested_size_keeps_the_good_entry(tmp_path: Path) -> None:
    digest, data = blob()
    local = LocalLayer(tmp_path)
    local.write(digest, data)
    with pytest.raises(IntegrityError, match=r".*: size mismatch for sha256:\w+ from local store .*: expected 4999 bytes, got more"):
        Store([local]).get(digest, len(data) - 1)
    with pytest.raises(IntegrityError, match=r".*: size mismatch for sha256:\w+ from local store .*: expected 5001 bytes, got 5000"):
        Store([local]).get(digest, len(data) + 1)
    # The entry hashes right: the request was wrong, so nothing was quarantined.
    assert Store([local]).get(digest, len(data)) == data
    assert not local.quarantine_dir.exists()


def test_symlink_at_entry_path_is_not_followed(tmp_path: Path) -> None:
    digest, data = blob()
    outside = tmp_path / "outside"
    outside.write_bytes(data)  # even the right bytes: a link could be swapped later
    local = LocalLayer(tmp_path / "local")
    path = local.path_for(digest)
    path.parent.mkdir(parents=True)
    path.symlink_to(outside)
    store = Store([local, disk_cache_with(tmp_path / "disk_cache", [(digest, data)])])
    assert store.get(digest, len(data)) == data
    assert store.stats.misses == 1  # the link was a miss, the bytes came from the next layer
    assert path.is_file() and not path.is_symlink()
    assert outside.read_bytes() == data


def test_fifo_at_entry_path_does_not_hang(tmp_path: Path) -> None:
    digest, data = blob()
    local = LocalLayer(tmp_path)
    path = local.path_for(digest)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    start = time.monotonic()
    with pytest.raises(MissingBlobError):
        Store([local]).get(digest, len(data))
    assert time.monotonic() - start < 5


def test_stray_files_are_reported_not_loaded(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    digest, data = blob()
    local.write(digest, data)
    (local.cas_dir / "zz").mkdir()
    (local.cas_dir / digest.hex[:2] / "README").write_text("hi")
    (local.cas_dir / digest.hex[:2] / ("0" * 64)).write_text("wrong shard")
    entries, strays = local.scan()
    assert [e.digest for e in entries] == [digest]
    assert {p.name for p in strays} == {"zz", "README", "0" * 64}


def test_rename_failure_removes_temp_and_keeps_old_entries(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    d1, b1 = blob(seed=1)
    d2, b2 = blob(seed=2)
    local.write(d1, b1)
    local.path_for(d2).mkdir(parents=True)  # rename onto a directory fails (EISDIR)
    with pytest.raises(StoreError, match=rf"^cannot write {local.path_for(d2)}: Is a directory"):
        local.write(d2, b2)
    assert temps(local) == []
    assert Store([local]).get(d1, len(b1)) == b1


def test_a_failed_rename_in_a_grouped_batch_is_an_error_when_it_ends_and_leaves_no_temp(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    (d1, b1), (d2, b2) = blob(seed=1), blob(seed=2)
    local.path_for(d2).mkdir(parents=True)  # rename onto a directory fails (EISDIR)
    with pytest.raises(StoreError, match=rf"^cannot store 1 blob in {tmp_path}: {d2} at {local.path_for(d2)}: Is a directory"):
        with local.batch(grouped=True):
            local.write(d1, b1)
            local.write(d2, b2)
            assert not local.path_for(d1).exists()  # pending until the group commits
    assert temps(local) == []
    assert Store([local]).get(d1, len(b1)) == b1  # the rest of the group is in place


def test_a_grouped_batch_whose_sync_fails_renames_nothing_and_leaves_no_temp(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    local = LocalLayer(tmp_path, sync_filesystem=lambda path: False)  # no syncfs: an fsync of each temp
    (d1, b1), (d2, b2) = blob(seed=1), blob(seed=2)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreError, match=rf"^cannot store 2 blobs in {tmp_path}: sha256:[0-9a-f]{{64}}: not made durable: Input/output error; "):
        with local.batch(grouped=True):
            local.write(d1, b1)
            local.write(d2, b2)
    assert temps(local) == [] and not local.path_for(d1).exists() and not local.path_for(d2).exists()


def test_an_error_in_a_grouped_batch_body_is_not_replaced_by_a_failed_rename(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    d2, b2 = blob(seed=2)
    local.path_for(d2).mkdir(parents=True)
    with pytest.raises(KeyboardInterrupt):
        with local.batch(grouped=True):
            local.write(d2, b2)
            raise KeyboardInterrupt
    assert temps(local) == []


def test_cache_write_failure_serves_verified_bytes_unless_strict(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path)
    digest, data = blob()
    local.path_for(digest).mkdir(parents=True)
    source = MemoryLayer()
    source.write(digest, data)
    assert Store([local, source]).get(digest, len(data)) == data
    with pytest.raises(StoreError, match=rf"^cannot store {digest} \(k\) in local store"):
        Store([local, source], strict=True).get(digest, len(data), name="k")


_FULL_DISK_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from cubinstore import Digest, StoreError
    from cubinstore.store import LocalLayer
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    local = LocalLayer(sys.argv[1])
    small = b"small entry" * 10
    local.write(Digest.of(small), small)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    big = bytes(range(256)) * 100
    try:
        local.write(Digest.of(big), big)
    except StoreError as exc:
        print("StoreError:", exc)
        sys.exit(3)
    sys.exit(0)
""")


def test_disk_full_mid_write_is_a_typed_error_and_leaves_no_partial_entry(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(root)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout.startswith("StoreError: cannot write ") and "File too large" in out.stdout
    local = LocalLayer(root)
    big = bytes(range(256)) * 100
    assert not local.path_for(Digest.of(big)).exists()
    assert temps(local) == []
    small = b"small entry" * 10
    assert Store([local]).get(Digest.of(small), len(small)) == small


# The writer under test: one complete entry, then one more that is killed part way. A number kills
# it at that byte of the entry's temp file: RLIMIT_FSIZE stops the store's own write there and
# SIGXFSZ (which Python ignores; restored to the default here) ends the process at once, in the
# write, with no handler or cleanup run: a kill -9 at a chosen byte. "rename" kills it (SIGKILL,
# from the parent) with the whole entry written and synced, at its rename: a grouped batch (what
# prefetch writes with) calls its ``sync_filesystem`` just before renaming, and this one says so
# on stdout and then waits to be killed.
_KILLED_WRITER = textwrap.dedent("""
    import random, resource, signal, sys
    from cubinstore import Digest
    from cubinstore.store import LocalLayer
    from cubinstore.store.local.root import sync_filesystem

    root, seed, size, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    def synced_then_held(path):
        done = sync_filesystem(path)
        sys.stdout.write("synced\\n")
        sys.stdout.flush()
        sys.stdin.read()  # held here until the parent kills us
        return done

    local = LocalLayer(root, sync_filesystem=synced_then_held)
    good = random.Random(seed).randbytes(size)
    local.write(Digest.of(good), good)
    doomed = random.Random(seed + 1).randbytes(size)
    if at == "rename":
        with local.batch(grouped=True):
            local.write(Digest.of(doomed), doomed)
    else:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(at), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        local.write(Digest.of(doomed), doomed)
    sys.exit("the write of the second entry was not killed")
""")


def test_writer_killed_at_random_points_never_leaves_a_bad_final_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    size = 256 * 1024
    rng = random.Random(7)
    # The first byte, one byte in, one write buffer, the middle, two random bytes, the last byte,
    # and all of it written and synced, just before the rename.
    kills: list[int | str] = [0, 1, 8192, size // 2, rng.randrange(2, size - 1), rng.randrange(2, size - 1),
                              size - 1, "rename"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc written under the limit
    local = LocalLayer(root)
    good: list[tuple[Digest, bytes]] = []
    left: list[Path] = []
    for i, at in enumerate(kills):
        before = set(temps(local))
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root), str(2 * i), str(size), str(at)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if at == "rename":
                assert proc.stdout is not None and proc.stdout.readline() == b"synced\n", proc.communicate()[1]
                proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == (-signal.SIGKILL if at == "rename" else -signal.SIGXFSZ), err
        good.append(blob(size, 2 * i))
        doomed_digest, doomed = blob(size, 2 * i + 1)
        # The kill landed inside the write: the entry's temp file holds exactly the bytes written
        # before it, and nothing is at its final path.
        new = set(temps(local)) - before
        assert len(new) == 1, f"kill at {at}: expected one new temp file, got {sorted(new)}"
        tmp = new.pop()
        assert tmp.name.startswith(f".tmp.{doomed_digest.hex}.") and tmp.parent == local.path_for(doomed_digest).parent
        assert tmp.read_bytes() == doomed[:size if at == "rename" else int(at)], f"kill at {at}"
        assert not local.path_for(doomed_digest).exists()
        left.append(tmp)
    entries, strays = local.scan()
    assert sorted(e.digest.hex for e in entries) == sorted(d.hex for d, _ in good)
    assert sorted(strays) == sorted(left)
    # The store's cleanup keeps fresh temps (a live writer may own one) and removes stale ones.
    assert local.clean_temps() == []
    report = verify_store(local)
    assert report.corrupt == [] and report.ok == len(good)
    an_hour_ago = time.time() - 3700
    for tmp in left:
        os.utime(tmp, (an_hour_ago, an_hour_ago))
    assert sorted(local.clean_temps()) == sorted(left)
    assert temps(local) == [] and local.scan()[1] == []
    store = Store([local])
    for digest, data in good:  # every entry written before a kill still loads
        assert store.get(digest, size) == data


def test_reader_polling_during_writes_sees_absent_or_complete(tmp_path: Path) -> None:
    import threading

    local = LocalLayer(tmp_path)
    blobs = [blob(200_000, seed=i) for i in range(20)]
    seen_partial: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for digest, data in blobs:
                path = local.path_for(digest)
                try:
                    content = path.read_bytes()
                except FileNotFoundError:
                    continue
                if content != data:
                    seen_partial.append(digest.hex)

    reader = threading.Thread(target=poll)
    reader.start()
    for digest, data in blobs:
        local.write(digest, data)
    done.set()
    reader.join()
    assert seen_partial == []


def test_stats_are_counted_and_persisted(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "local")
    digest, data = blob()
    source = disk_cache_with(tmp_path / "disk_cache", [(digest, data)])
    store = Store([MemoryLayer(), local, source])
    store.get(digest, len(data))   # fetched from source
    store.get(digest, len(data))   # memory hit
    store2 = Store([local])
    store2.get(digest, len(data))  # local hit in a "new process"
    assert store.stats.hits == 1 and store.stats.misses == 1 and store.stats.bytes_fetched == len(data)
    persisted = local.read_stats()
    assert persisted == {"hits": 1, "misses": 1, "bytes_fetched": len(data), "verification_failures": 0, "ptx_loads": 0}


# -- the per-digest fill lock: a byte of one lock file per shard --------------------------------

def same_shard_digests(n: int) -> list[Digest]:
    """``n`` digests that share a shard (and so a lock file), at distinct lock offsets."""
    by_shard: dict[str, list[Digest]] = {}
    for i in range(100_000):
        d = Digest.of(i.to_bytes(4, "little"))
        group = by_shard.setdefault(d.hex[:2], [])
        group.append(d)
        if len(group) == n:
            return group
    raise AssertionError("unreachable")


@pytest.mark.skipif(not RANGE_LOCKS, reason="byte-range (OFD) locks are Linux only")
def test_the_lock_of_a_digest_excludes_threads_but_not_other_digests_of_its_shard(tmp_path: Path) -> None:
    a, b = same_shard_digests(2)
    local = LocalLayer(tmp_path / "home", lock_timeout=0.2)
    outcome: list[object] = []

    def take(digest: Digest) -> None:
        try:
            with local.lock(digest):
                outcome.append("locked")
        except LockTimeoutError as exc:
            outcome.append(exc)

    with local.lock(a):
        for digest in (a, b):
            t = threading.Thread(target=take, args=(digest,))
            t.start()
            t.join(30)
    assert isinstance(outcome[0], LockTimeoutError) and str(outcome[0]).startswith("timed out after 0.2s waiting for lock")
    assert outcome[1] == "locked"  # same file, another byte
    take(a)  # released with the `with`
    assert outcome[2] == "locked"
    assert [p.name for p in local.lock_dir.iterdir()] == [f"{a.hex[:2]}.lock"]


_LOCK_HOLDER = textwrap.dedent("""
    import sys, time
    from cubinstore import Digest
    from cubinstore.store import LocalLayer
    with LocalLayer(sys.argv[1]).lock(Digest(sys.argv[2])):
        print("locked", flush=True)
        time.sleep(600)
""")


@pytest.mark.skipif(not RANGE_LOCKS, reason="byte-range (OFD) locks are Linux only")
def test_the_lock_held_by_a_killed_process_is_released(tmp_path: Path) -> None:
    digest, _ = blob()
    root = tmp_path / "home"
    child = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(root), digest.hex], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "locked\n"  # the child holds it now
        with pytest.raises(LockTimeoutError):
            with LocalLayer(root, lock_timeout=0.2).lock(digest):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    with LocalLayer(root, lock_timeout=5.0).lock(digest):  # the kernel dropped the dead process's lock
        pass


@pytest.mark.skipif(not RANGE_LOCKS, reason="byte-range (OFD) locks are Linux only")
def test_a_symlinked_lock_file_is_not_followed(tmp_path: Path) -> None:
    digest, data = blob()
    local = LocalLayer(tmp_path / "home")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    local.lock_dir.mkdir(parents=True)
    (local.lock_dir / f"{digest.hex[:2]}.lock").symlink_to(target)
    with pytest.raises(StoreError, match=rf"^cannot open lock file {local.lock_dir / digest.hex[:2]}\.lock: "):
        with local.lock(digest):
            pass
    source = disk_cache_with(tmp_path / "disk_cache", [(digest, data)])
    assert Store([local, source]).get(digest, len(data)) == data  # fetched, unlocked, as for a read-only store


# -- the hit path: one open, one read, one sha256 -------------------------------------------------

def same_shard_blobs(n: int) -> list[tuple[Digest, bytes]]:
    found: list[tuple[Digest, bytes]] = []
    seed = 0
    while len(found) < n:
        digest, data = blob(seed=seed)
        seed += 1
        if not found or digest.hex[:2] == found[0][0].hex[:2]:
            found.append((digest, data))
    return found


def record_opens(monkeypatch: pytest.MonkeyPatch, local: LocalLayer) -> list[object]:
    """What ``local``'s reads open from now on: each ``os.open``'s name and each entry its compiled
    reader (``cubinstore._core.native``, which opens in C) is asked for."""
    opened: list[object] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    native_read = local._read_native
    if native_read is not None:
        monkeypatch.setattr(local, "_read_native", lambda fd, name, *a: opened.append(name) or native_read(fd, name, *a))
    return opened


def test_a_local_hit_opens_only_its_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalLayer(tmp_path / "home")
    blobs = same_shard_blobs(3)
    for digest, data in blobs:
        local.write(digest, data)
    store = Store([local])
    assert store.get(*blobs[0][:1], len(blobs[0][1])) == blobs[0][1]  # opens the shard, and closes it
    assert store.get(*blobs[0][:1], len(blobs[0][1])) == blobs[0][1]  # opens and holds it
    opened = record_opens(monkeypatch, local)
    for digest, data in blobs:
        assert store.get(digest, len(data)) == data
    assert opened == [digest.hex for digest, _ in blobs]  # no directory walked or reopened
    assert store.stats.hits == 5


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_shard_hit_once_holds_no_descriptor(tmp_path: Path) -> None:
    # Each held descriptor raises the process's highest fd; growing the fd table of a threaded
    # process (CUDA's) waits for an RCU grace period, milliseconds. A shard is held from its second hit.
    local = LocalLayer(tmp_path / "home")
    blobs = same_shard_blobs(2)
    for digest, data in blobs:
        local.write(digest, data)
    store = Store([local])
    assert store.get(blobs[0][0], len(blobs[0][1])) == blobs[0][1]
    before = open_descriptors()
    assert store.get(blobs[0][0], len(blobs[0][1])) == blobs[0][1]  # its second hit: held from now on
    assert open_descriptors() == before + 1
    other_digest, other_data = next(b for b in (blob(seed=s) for s in range(1000, 2000))
                                    if b[0].hex[:2] != blobs[0][0].hex[:2])
    local.write(other_digest, other_data)
    held = open_descriptors()
    assert store.get(other_digest, len(other_data)) == other_data  # another shard's first hit
    assert store.get(blobs[1][0], len(blobs[1][1])) == blobs[1][1]  # the held shard
    assert open_descriptors() == held


def test_a_shard_directory_replaced_after_a_hit_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalLayer(tmp_path / "home")
    (digest, data), (other, other_data) = same_shard_blobs(2)
    local.write(digest, data)
    store = Store([local])
    for _ in range(2):  # a shard is held from its second hit
        assert store.get(digest, len(data)) == data
    shard = local.cas_dir / digest.hex[:2]
    shard.rename(tmp_path / "old-shard")  # the held descriptor now names a directory elsewhere
    local.write(other, other_data)
    assert store.get(other, len(other_data)) == other_data  # through the layered path, which re-holds the shard
    opened = record_opens(monkeypatch, local)
    assert store.get(other, len(other_data)) == other_data
    assert opened == [other.hex]  # the one-open path again, through the new directory
    assert store.stats.misses == 0


def test_the_held_shard_descriptors_close_with_their_store(tmp_path: Path) -> None:
    import gc

    local = LocalLayer(tmp_path / "home")
    digest, data = blob()
    local.write(digest, data)
    store = Store([local])
    for _ in range(2):  # a shard is held from its second hit
        assert store.get(digest, len(data)) == data
    del store
    fd = local._shards[digest.hex[:2]]
    held = os.fstat(fd)
    assert os.path.samestat(held, os.stat(local.cas_dir / digest.hex[:2]))
    local.flush_stats()  # pending counts hold their store until flushed
    del local
    gc.collect()
    try:
        now = os.fstat(fd)
    except OSError:
        return  # closed
    assert not os.path.samestat(now, held)  # closed, and the number reused since


def test_a_bad_entry_found_by_the_hit_path_is_still_quarantined_and_refetched(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    digest, data = blob()
    local.write(digest, data)
    store = Store([local, disk_cache_with(tmp_path / "dc", [(digest, data)])])
    assert store.get(digest, len(data)) == data  # the shard is held from here on
    path = local.path_for(digest)
    path.chmod(0o644)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit, same size
    assert store.get(digest, len(data)) == data
    assert store.stats.verification_failures == 1 and store.stats.misses == 1
    assert len(list(local.quarantine_dir.iterdir())) == 1 and path.read_bytes() == data
