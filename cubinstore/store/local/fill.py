"""The per-digest fill locks of a local store (``LocalLayer.lock``): one process, one thread
downloads a blob at a time, the others wait and then find it in the CAS.

A lock is byte ``int(hex[2:17], 16)`` of ``v1/locks/<hh>.lock`` where the host has range locks
(``lock.RANGE_LOCKS``), else a file per digest, ``v1/locks/<hh>/<hex>.lock``. In a grouped batch
(``batch.Batch``) the lock of an entry written under it goes to the batch, which releases it once
the entry is renamed into place, and the batch commits what it holds before this process waits
for a lock held elsewhere.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cubinstore._core.digest import Digest
from cubinstore.store.local.lock import RANGE_LOCKS, Clock, acquire
from cubinstore.store.local.root import StoreRoot

if TYPE_CHECKING:
    from cubinstore.store.local.batch import Batch

__all__ = ["FillLock", "FillLocks"]


class FillLocks:
    """The fill locks below one store root, and the batch that may hold them past their ``with``;
    ``clock`` times and sleeps their polls (``lock.acquire``)."""

    __slots__ = ("_fs", "_lock_dir", "_batch", "_clock")

    def __init__(self, fs: StoreRoot, lock_dir: Path, batch: Batch, *, clock: Clock = time) -> None:
        self._fs = fs
        self._lock_dir = lock_dir
        self._batch = batch
        self._clock = clock

    def lock(self, digest: Digest, timeout: float) -> FillLock:
        """The lock a fill of ``digest`` holds, waiting at most ``timeout`` seconds for it."""
        return FillLock(self, digest, timeout)

    def acquire(self, digest: Digest, timeout: float) -> int:
        """A descriptor holding ``digest``'s lock (``lock.acquire``); closing it releases the lock."""
        hex_ = digest.hex
        batch = self._batch
        on_wait = batch.commit if batch.grouped else None
        if RANGE_LOCKS:
            name = f"{hex_[:2]}.lock"
            with self._fs.dir("v1", "locks", create=True) as fd:
                return acquire(self._lock_dir / name, name, fd, timeout, offset=int(hex_[2:17], 16),
                               what=str(digest), on_wait=on_wait, clock=self._clock)
        name = f"{hex_}.lock"
        with self._fs.dir("v1", "locks", hex_[:2], create=True) as fd:
            return acquire(self._lock_dir / hex_[:2] / name, name, fd, timeout, what=str(digest),
                           on_wait=on_wait, clock=self._clock)

    def release(self, hex_: str, fd: int, wrote: bool) -> None:
        """Release a fill lock, or hand it to the pending group that holds its entry."""
        if not (wrote and self._batch.hand_over(hex_, fd)):
            os.close(fd)


class FillLock:
    """``LocalLayer.lock``: held for the ``with`` body, or, in a grouped batch, until the entry
    written under it is renamed into place (its waiters then find it)."""

    __slots__ = ("_locks", "_digest", "_timeout", "_fd")

    def __init__(self, locks: FillLocks, digest: Digest, timeout: float) -> None:
        self._locks = locks
        self._digest = digest
        self._timeout = timeout
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = self._locks.acquire(self._digest, self._timeout)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        fd, self._fd = self._fd, -1
        self._locks.release(self._digest.hex, fd, exc_type is None)
