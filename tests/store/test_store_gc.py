"""gc against concurrent pins and unpacks, and the lock files it leaves behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cubinstore import Digest, LockTimeoutError, Manifest, Store
from cubinstore.internals import gc, pack, pin, unpack
from cubinstore.store import LocalLayer
from cubinstore.store.local.lock import RANGE_LOCKS, file_lock

from helpers.blobs import disk_cache_with

pytestmark = pytest.mark.usefixtures("clean_env")


def fill(local: LocalLayer, blobs: dict[str, bytes]) -> None:
    for hex_, data in blobs.items():
        local.write(Digest(hex_), data)


def present(local: LocalLayer) -> set[str]:
    return {e.digest.hex for e in local.scan()[0]}


def test_gc_never_evicts_a_release_pinned_while_it_scans(make_release, tmp_path: Path) -> None:
    release = make_release(n=8, size=5000)
    fill(LocalLayer(tmp_path / "home"), release.blobs)
    manifest = Manifest.from_path(release.path)
    in_scan, resume = threading.Event(), threading.Event()
    calls = []

    class SlowScan(LocalLayer):
        def scan(self):  # the first scan of gc waits here: a slow scan of a big store
            calls.append(1)
            if len(calls) == 1:
                in_scan.set()
                assert resume.wait(30)
            return super().scan()

    local = SlowScan(tmp_path / "home")
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(gc(local, 0)))
    worker.start()
    assert in_scan.wait(30)
    pin(LocalLayer(local.root), manifest)  # another process pins while gc is scanning
    resume.set()
    worker.join(30)
    assert result, "gc did not finish"
    assert set(release.blobs) <= present(local), "gc evicted entries of a release pinned before it evicted"


def test_unpack_with_pin_is_atomic_against_a_concurrent_gc(make_release, tmp_path: Path) -> None:
    release = make_release(n=6, size=5000)
    source = LocalLayer(tmp_path / "source")
    fill(source, release.blobs)
    manifest = Manifest.from_path(release.path)
    bundle = tmp_path / "release.tar"
    pack(manifest, Store([source]), bundle)
    written: list[object] = []
    gc_outcomes: list[str] = []

    def then_gc(args: tuple[object, ...]) -> None:
        written.append(args)
        if len(written) == len(manifest.blobs) + 1:  # every blob and the manifest are in, not yet pinned
            try:
                gc(LocalLayer(target.root, lock_timeout=0.2), 0)  # another process's gc
                gc_outcomes.append("ran")
            except LockTimeoutError:
                gc_outcomes.append("waited")

    class Target(LocalLayer):  # each way an entry enters the CAS (a write, or a staged file's rename)
        def write(self, digest: Digest, data: bytes) -> None:
            super().write(digest, data)
            then_gc((digest, data))

        def commit_staged(self, name: str, digest: Digest) -> None:
            super().commit_staged(name, digest)
            then_gc((name, digest))

    target = Target(tmp_path / "offline")
    unpack(bundle, target, expect=manifest.digest, pin=True)
    assert gc_outcomes, "the hook never ran"
    assert set(release.blobs) | {manifest.digest.hex} <= present(target)
    gc(LocalLayer(target.root), 0)
    assert set(release.blobs) <= present(target)  # pinned: a later gc keeps them too


@pytest.mark.skipif(not RANGE_LOCKS, reason="byte-range (OFD) locks are Linux only")
def test_fills_create_no_lock_file_per_blob(make_release, tmp_path: Path) -> None:
    release = make_release(n=40, size=3000)
    cache = disk_cache_with(tmp_path / "disk_cache", [(Digest(h), d) for h, d in release.blobs.items()])
    local = LocalLayer(tmp_path / "home")
    store = Store([local, cache])
    for hex_, data in release.blobs.items():
        store.get(Digest(hex_), len(data))  # each fill takes its digest's lock
    shards = {hex_[:2] for hex_ in release.blobs}
    # One permanent lock file per shard used (a byte-range lock per digest), none per blob.
    assert sorted(p.name for p in local.lock_dir.iterdir()) == sorted(f"{s}.lock" for s in shards)
    gc(LocalLayer(local.root), 10**9)
    assert sorted(p.name for p in local.lock_dir.iterdir()) == sorted(f"{s}.lock" for s in shards)


@pytest.mark.skipif(not RANGE_LOCKS, reason="byte-range (OFD) locks are Linux only")
def test_gc_removes_per_digest_lock_files_older_versions_left_but_not_held_ones(make_release, tmp_path: Path) -> None:
    release = make_release(n=5, size=3000)
    local = LocalLayer(tmp_path / "home")
    fill(local, release.blobs)
    legacy = []
    for hex_ in release.blobs:  # as an older version's fill left them
        path = local.lock_dir / hex_[:2] / f"{hex_}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        legacy.append(path)
    held = sorted(legacy)[0]
    with file_lock(held, 5.0):  # an older version's process still holds this one
        assert gc(LocalLayer(local.root), 10**9).locks_removed == len(legacy) - 1
        assert sorted(local.lock_dir.rglob("*.lock")) == [held]
    gc(LocalLayer(local.root), 10**9)
    assert sorted(local.lock_dir.rglob("*.lock")) == []
    assert present(local) == set(release.blobs)  # only lock files went
