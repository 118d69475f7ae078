"""Writes of a local store made durable together: batches, grouped CAS writes, staging.

A batch defers each directory's fsync (or, without ``sync_each``, each file's) to its end; a
grouped batch (prefetch) writes CAS entries to temp files and renames them into place in groups,
after one filesystem sync per group; staging (unpack) streams blobs into ``v1/staging/<hh>/``,
makes them durable together and renames them once the caller has verified them all.

``Batch`` holds this state for one ``LocalLayer``, which owns it and delegates to it. It walks
directories through the store's ``StoreRoot`` and holds no reference to the store itself; the
store's fill locks (``fill.FillLocks``) ask it to commit before they wait and hand it the lock of
an entry it still has to rename.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore.errors import StoreError
from cubinstore.store.local.record import Recorder
from cubinstore.store.local.root import StoreRoot, fsync_fd, new_temp, sync_filesystem, unlink_quiet, write_temp_at

__all__ = ["GROUP_MAX", "GROUP_SECONDS", "Batch"]

_log = get_logger(__name__)

# A grouped batch commits (one sync, then the renames) every GROUP_MAX entries or when its oldest
# pending entry is GROUP_SECONDS old: each pending entry holds its digest's lock (one descriptor),
# and another process waiting for one waits for the commit.
GROUP_MAX = 128
GROUP_SECONDS = 0.5


class _Pending:
    """A CAS entry of a grouped batch written to a temp file, not yet renamed into place."""

    __slots__ = ("shard", "tmp", "lock_fd")

    def __init__(self, shard: str, tmp: str) -> None:
        self.shard = shard
        self.tmp = tmp
        self.lock_fd: int | None = None  # its fill lock, once handed over: closed after the rename


class Batch:
    """The open batches of one local store and the writes they defer (see the module docstring).

    ``sync_filesystem`` and ``write_temp`` are the file primitives it makes durable and stages
    with (``root.sync_filesystem``, ``root.write_temp_at`` unless the owner passes others).
    """

    def __init__(self, fs: StoreRoot, root: Path, *,
                 sync_filesystem: Callable[[Path], bool] = sync_filesystem,
                 write_temp: Callable[..., str] = write_temp_at) -> None:
        self._fs = fs
        self._root = root
        self._v1 = root / "v1"
        self._cas_dir = self._v1 / "cas"
        self._sync_filesystem = sync_filesystem
        self._write_temp = write_temp
        self._lock = threading.Lock()
        self._depth = 0
        self._lazy = 0  # open batches that sync the filesystem at their end instead of each file
        self._unsynced = False
        self._dirs: set[tuple[str, ...]] = set()
        # Grouped batches (prefetch): hex -> its pending entry, written but not yet renamed; the
        # group being committed; failures for the batch's end.
        self._grouped = 0
        self._group: dict[str, _Pending] = {}
        self._group_since = 0.0
        self._committing: dict[str, _Pending] = {}
        self._commit_lock = threading.Lock()
        self._errors: list[str] = []
        # While a grouped batch is open, a thread commits a group GROUP_SECONDS old even when
        # nothing more is staged and no thread of ours waits: a process waiting for one of its
        # entries' locks must not wait until our batch ends.
        self._timer: tuple[threading.Thread, threading.Event] | None = None

    @property
    def grouped(self) -> bool:
        """Whether a grouped batch is open: CAS writes go to ``stage``."""
        return self._grouped > 0

    # -- batches ------------------------------------------------------------------------------

    @contextmanager
    def open(self, *, sync_each: bool, grouped: bool) -> Iterator[None]:
        """``LocalLayer.batch``: the body's writes made durable together when the last batch ends."""
        with self._lock:
            self._depth += 1
            if not sync_each:
                self._lazy += 1
            if grouped:
                self._grouped += 1
                if self._timer is None:
                    stop = threading.Event()  # one per timer: a later batch's timer never reuses it
                    thread = threading.Thread(target=self._commit_when_due, args=(stop,), daemon=True,
                                              name=f"cubinstore-group-commit {self._root}")
                    self._timer = (thread, stop)
                    thread.start()
        self._fs.begin_session()  # each directory walked and checked once for the whole batch
        try:
            yield
        finally:
            try:
                if grouped:
                    self._stop_timer()
                    self.commit()
            finally:
                self._fs.end_session()
                with self._lock:
                    self._depth -= 1
                    if not sync_each:
                        self._lazy -= 1
                    if grouped:
                        self._grouped -= 1
                    last = self._depth == 0
                    dirs = sorted(self._dirs) if last else []
                    lazy = self._unsynced and last
                    errors = self._errors if grouped and self._grouped == 0 else []
                    if errors:
                        self._errors = []
                    if last:
                        self._dirs.clear()
                        self._unsynced = False
            if lazy and self._sync_filesystem(self._root):
                dirs = []  # syncfs made the directories durable too
            for parts in dirs:
                with self._fs.dir("v1", *parts) as fd:
                    if fd is not None:
                        fsync_fd(fd, self._v1.joinpath(*parts))
            if errors:
                failure = StoreError(f"cannot store {len(errors)} blob{'s' if len(errors) > 1 else ''} in {self._root}: "
                                     + "; ".join(errors[:3]) + ("; ..." if len(errors) > 3 else ""))
                if sys.exc_info()[1] is None:
                    raise failure
                _log.warning("%s", failure)  # the body's own error goes on

    def note_write(self, parts: tuple[str, ...], durable: bool) -> tuple[bool, bool]:
        """A file is about to be written in ``v1/<parts>``: (``deferred``, ``lazy``).

        ``deferred``: an open batch fsyncs the directory at its end, not the writer; ``lazy``:
        one also syncs the filesystem there, so the writer need not fsync the file either.
        """
        with self._lock:
            deferred = durable and self._depth > 0
            lazy = deferred and self._lazy > 0
            if deferred:
                self._dirs.add(parts)
                self._unsynced |= lazy
        return deferred, lazy

    # -- grouped CAS writes -------------------------------------------------------------------

    def stage(self, digest: Digest, data: bytes, record: bytes | None = None) -> None:
        """Write a CAS entry (and its ``record``) to a temp file beside its final path, renamed when its
        group commits."""
        hex_ = digest.hex
        shard = hex_[:2]
        with self._fs.dir("v1", "cas", shard, create=True) as fd:
            assert fd is not None
            tmp = self._write_temp(fd, hex_, self._cas_dir / shard, data, record=record)
        with self._lock:
            now = time.monotonic()
            if not self._group:
                self._group_since = now
            self._group[hex_] = _Pending(shard, tmp)
            self._dirs.add(("cas", shard))
            due = len(self._group) >= GROUP_MAX or now - self._group_since >= GROUP_SECONDS
        if due:
            self.commit()

    def hand_over(self, hex_: str, lock_fd: int) -> bool:
        """Keep the fill lock of a pending entry until its rename (True); False if none is pending."""
        with self._lock:
            pending = self._group.get(hex_) or self._committing.get(hex_)
            if pending is not None and pending.lock_fd is None:
                pending.lock_fd = lock_fd
                return True
        return False

    def _stop_timer(self) -> None:
        """Stop the group timer when the last open grouped batch ends (its own final commit follows)."""
        with self._lock:
            if self._grouped != 1 or self._timer is None:
                return
            thread, stop = self._timer
            self._timer = None
        stop.set()
        thread.join()  # its commit, if one was running, is over: its errors are in _errors

    def _commit_when_due(self, stop: threading.Event) -> None:
        """The group timer: commit the pending group once its oldest entry is GROUP_SECONDS old."""
        while not stop.wait(GROUP_SECONDS / 4):
            with self._lock:
                due = bool(self._group) and time.monotonic() - self._group_since >= GROUP_SECONDS
            if due:
                try:
                    self.commit()
                except Exception as exc:  # noqa: BLE001 - reported when the batch ends, as a commit's own errors are
                    with self._lock:
                        self._errors.append(f"group commit in {self._root} failed: {exc}")

    def commit(self) -> None:
        """Make the pending group durable (one sync), rename its entries into place, release their locks."""
        with self._commit_lock:  # one commit at a time: _committing is one group
            with self._lock:
                group = self._committing = self._group
                self._group = {}
            if not group:
                return
            errors: list[str] = []
            try:
                self.make_durable((("cas", p.shard), p.tmp) for p in group.values())
                for hex_, p in group.items():
                    with self._fs.dir("v1", "cas", p.shard, check=True) as dir_fd:
                        where = self._cas_dir / p.shard
                        if dir_fd is None:
                            errors.append(f"sha256:{hex_}: {where} vanished before its rename")
                            continue
                        try:
                            os.replace(p.tmp, hex_, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                        except OSError as exc:
                            unlink_quiet(dir_fd, p.tmp, where / p.tmp)
                            errors.append(f"sha256:{hex_} at {where / hex_}: {exc.strerror or exc}")
            except (OSError, StoreError) as exc:  # the sync failed: nothing more of the group is renamed
                reason = getattr(exc, "strerror", None) or exc
                errors.extend(f"sha256:{hex_}: not made durable: {reason}" for hex_ in group)
                for p in group.values():
                    with self._fs.dir("v1", "cas", p.shard) as dir_fd:
                        if dir_fd is not None:
                            unlink_quiet(dir_fd, p.tmp, self._cas_dir / p.shard / p.tmp)  # gone already once renamed
            finally:
                with self._lock:  # a lock handed over from here on finds its entry renamed (or given up)
                    self._committing = {}
                    self._errors.extend(errors)
                for p in group.values():
                    if p.lock_fd is not None:
                        os.close(p.lock_fd)

    def make_durable(self, files: Iterable[tuple[tuple[str, ...], str]]) -> None:
        """Make the files ``v1/<parts>/<name>`` durable: one filesystem sync, else an fsync of each
        (a directory that vanished is skipped: its files are gone)."""
        if self._sync_filesystem(self._root):
            return
        for parts, name in files:
            with self._fs.dir("v1", *parts, check=True) as dir_fd:
                if dir_fd is None:
                    continue
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    # -- staging: verify many blobs first, publish them together (unpack) ----------------------
    # Staged blobs live in v1/staging/<hh>/ (the shard of their digest): one flat directory made
    # each create slower as a bundle grew (10,000 files in one directory), and nothing appears
    # under cas/ until the whole bundle has verified.

    def new_staged(self, digest: Digest) -> tuple[BinaryIO, str]:
        """A fresh temp file in ``v1/staging/<hh>`` to stream ``digest``'s bytes into, and its name."""
        shard = digest.hex[:2]
        with self._fs.dir("v1", "staging", shard, create=True) as fd:
            assert fd is not None
            tmp_fd, name = new_temp(fd, "blob", self._v1 / "staging" / shard)
        os.fchmod(tmp_fd, 0o644)  # the final mode of a CAS entry: it is renamed as is
        # Hashes what the caller streams and attaches the entry's record when closed (record.py).
        return Recorder(os.fdopen(tmp_fd, "wb"), digest.hex), name  # type: ignore[return-value]

    def commit_staged(self, name: str, digest: Digest) -> None:
        """Rename a staged temp file (verified by the caller) to its CAS entry."""
        shard = digest.hex[:2]
        with self._fs.dir("v1", "staging", shard, check=True) as src, \
                self._fs.dir("v1", "cas", shard, create=True) as dst:
            if src is None:
                raise StoreError(f"staged file {self._v1 / 'staging' / shard / name} for {digest} vanished")
            try:
                os.replace(name, digest.hex, src_dir_fd=src, dst_dir_fd=dst)
            except OSError as exc:
                raise StoreError(f"cannot store {digest} at {self._cas_dir / shard / digest.hex}: "
                                 f"{exc.strerror or exc}") from exc
            with self._lock:
                deferred = self._depth > 0
                if deferred:
                    self._dirs.add(("cas", shard))
                    self._unsynced |= self._lazy > 0
            if not deferred:
                fsync_fd(dst, self._cas_dir / shard)

    def sync_staged(self, staged: list[tuple[str, Digest]]) -> None:
        """Make staged files durable: one filesystem sync, else an fsync of each."""
        if staged:
            self.make_durable((("staging", digest.hex[:2]), name) for name, digest in staged)
