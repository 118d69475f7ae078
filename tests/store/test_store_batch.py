"""A local store's batches and fill locks on their own (``store/local/batch.py``, ``fill.py``),
with the file primitives injected through their parameters instead of patched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.blobs import random_blob

from cubinstore import LockTimeoutError, StoreError
from cubinstore.store.local.batch import Batch
from cubinstore.store.local.fill import FillLocks
from cubinstore.store.local.root import StoreRoot, sync_filesystem


def _batch(root: Path, events: list[str], *, syncfs: bool = True) -> tuple[StoreRoot, Batch]:
    def sync(path: Path) -> bool:
        events.append("sync")
        return syncfs and sync_filesystem(path)

    fs = StoreRoot(root, allow_shared=False)
    return fs, Batch(fs, root, sync_filesystem=sync)


def test_a_grouped_batch_syncs_once_then_renames_each_entry(tmp_path: Path) -> None:
    events: list[str] = []
    _, batch = _batch(tmp_path, events)
    blobs = [random_blob(1000, seed) for seed in range(3)]
    with batch.open(sync_each=True, grouped=True):
        assert batch.grouped
        for digest, data in blobs:
            batch.stage(digest, data)
        assert not any((tmp_path / "v1" / "cas" / d.hex[:2] / d.hex).exists() for d, _ in blobs)
    assert not batch.grouped and events == ["sync"]
    for digest, data in blobs:
        assert (tmp_path / "v1" / "cas" / digest.hex[:2] / digest.hex).read_bytes() == data
    assert list((tmp_path / "v1" / "cas").rglob(".tmp.*")) == []


def test_a_grouped_batch_whose_fsync_fails_renames_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    events: list[str] = []
    _, batch = _batch(tmp_path, events, syncfs=False)  # no syncfs: an fsync of each temp
    digest, data = random_blob(1000, 1)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreError, match=rf"^cannot store 1 blob in {tmp_path}: {digest}: not made durable: Input/output error$"):
        with batch.open(sync_each=True, grouped=True):
            batch.stage(digest, data)
    assert list((tmp_path / "v1" / "cas").rglob("*")) == [tmp_path / "v1" / "cas" / digest.hex[:2]]


def test_a_fill_lock_handed_to_the_batch_is_held_until_its_entry_is_renamed(tmp_path: Path) -> None:
    fs, batch = _batch(tmp_path, [])
    other = FillLocks(fs, tmp_path / "v1" / "locks", Batch(fs, tmp_path))  # another open of the lock: waits
    locks = FillLocks(fs, tmp_path / "v1" / "locks", batch)
    digest, data = random_blob(1000, 2)
    with batch.open(sync_each=True, grouped=True):
        with locks.lock(digest, 1.0):
            batch.stage(digest, data)
        with pytest.raises(LockTimeoutError):
            with other.lock(digest, 0.05):
                pass
    assert (tmp_path / "v1" / "cas" / digest.hex[:2] / digest.hex).read_bytes() == data
    with other.lock(digest, 1.0):  # released with the rename
        pass
