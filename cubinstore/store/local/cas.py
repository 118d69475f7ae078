"""The local directory store: ``<root>/v1/cas/<first two hex>/<hex>``, one immutable file per blob.

Every path below the root is reached through directory descriptors without following a link
(``root.py``), and nothing is written where another user could write (see the README's
"permission rules"). ``LocalLayer`` owns its batches, grouped writes and staging (``batch.py``),
its fill locks (``fill.py``) and its counters (``stats.py``), and delegates to them.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cubinstore._core import knobs as _env
from cubinstore._core import native
from cubinstore._core.abi import MAX_BLOB_SIZE
from cubinstore._core.digest import Digest, verify
from cubinstore.store.layer import Layer, limit_for
from cubinstore.store.local.batch import GROUP_MAX, GROUP_SECONDS, Batch
from cubinstore.store.local.fill import FillLocks
from cubinstore.store.local.lock import RANGE_LOCKS, Clock, file_lock, remove_if_unheld
from cubinstore.store.local.stats import FLUSH_EVENTS, STAT_KEYS, Counters
from cubinstore._core.log import get_logger
from cubinstore.store.local import record as _record
from cubinstore.store.local.root import (
    _DIR_FLAGS,
    READ_FLAGS,
    TEMP_PREFIX,
    TOUCH_AFTER,
    NotRegularFile,
    StoreRoot,
    atomic_file_at,
    atomic_write_at,
    entry_rule,
    owned_entry,
    read_at,
    read_below,
    read_entry_at,
    sync_filesystem,
    unsafe_reasons,
    write_temp_at,
)
from cubinstore.errors import CubinstoreError, StoreError

# GROUP_MAX and GROUP_SECONDS are batch.py's, named here too (tests/scale read them here).
__all__ = ["GROUP_MAX", "GROUP_SECONDS", "STAT_KEYS", "Entry", "LocalLayer"]

_log = get_logger(__name__)

# What read_verified checked, per process: by record, by sha256, records written for entries
# that had none, and stale records replaced (tests and the runtime benchmark count them).
CHECK_KEYS = ("xxh3", "sha256", "recorded", "stale records")

_HEX_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_SHARD_RE = re.compile(r"[0-9a-f]{2}", re.ASCII)
_LOCK_RE = re.compile(r"([0-9a-f]{64})\.lock", re.ASCII)
_TEMP_PREFIX = TEMP_PREFIX


@dataclass(frozen=True)
class Entry:
    """A file at a final CAS path (not yet verified)."""

    digest: Digest
    path: Path
    size: int
    mtime: float


class LocalLayer(Counters, Layer):
    """The embedded default store: a directory, no server.

    Entries are written atomically and re-verified on every read; a corrupt entry is
    moved to ``v1/quarantine`` so the next read refetches it. ``allow_shared`` (default
    ``CUBINSTORE_ALLOW_SHARED_STORE``) permits writing where other users can write.
    ``sync_filesystem`` and ``write_temp`` replace ``root.sync_filesystem`` and ``root.write_temp_at``
    for its batches (``batch.Batch``), ``clock`` the ``time`` module for its lock polls and counter
    flushes, and ``flush_events`` the counts that make a flush due: tests count, fail or time through them.
    """

    cache = True
    writable = True
    lockable = True

    def __init__(self, root: str | Path, *, lock_timeout: float | None = None,
                 allow_shared: bool | None = None,
                 sync_filesystem: Callable[[Path], bool] = sync_filesystem,
                 write_temp: Callable[..., str] = write_temp_at,
                 clock: Clock = time, flush_events: int = FLUSH_EVENTS) -> None:
        self.root = Path(root).expanduser()
        self._stats_key = str(self.root)  # its pending counts' key (stats.py)
        self.v1 = self.root / "v1"
        self.cas_dir = self.v1 / "cas"
        self.quarantine_dir = self.v1 / "quarantine"
        self.lock_dir = self.v1 / "locks"
        self.pins_dir = self.v1 / "pins"
        self.stats_path = self.v1 / "stats.json"
        self.lock_timeout = _env.lock_timeout() if lock_timeout is None else lock_timeout
        self._clock = clock
        self._flush_events = flush_events
        self._fs = StoreRoot(self.root, allow_shared=_env.allow_shared_store() if allow_shared is None else allow_shared)
        # The hit path's shard directories (``read_verified``), held from their second hit: at most
        # 256 descriptors, closed when this store is collected (no thread can be using one then).
        # Not from the first: each held descriptor raises the process's highest fd, and where the
        # kernel's fd table then grows in a threaded process (CUDA's, at 64, 128, 256 ...) that
        # open waits for an RCU grace period: 4-17 ms on the H200 host in a load phase of 40
        # kernels, where holding saves about 5 us a hit.
        self._shards: dict[str, int] = {}
        self._shards_read: set[str] = set()  # shards hit once, through an open and close of the directory
        self._shards_lock = threading.Lock()
        self._cas_text = str(self.cas_dir)  # names entries in messages: no Path joins per hit
        # Whether first loads may check records (trusts_records; None: not decided yet), each shard
        # directory's ownership (as it was opened), and what this process's first loads checked.
        self._trusts: bool | None = None
        self._vouch: tuple[object, ...] = ()  # the native reader's (xxh3-128, *entry_rule()): set with _trusts
        self._shard_owned: dict[str, bool] = {}
        self.checks = dict.fromkeys(CHECK_KEYS, 0)
        helper = native.helper()  # read_verified's one-call read and check, where it was built
        self._read_native = None if helper is None else helper.read_entry
        weakref.finalize(self, _close_all, self._shards)
        # Batches, grouped writes and staging (batch.py), and the fill locks (fill.py), which may
        # hand a lock to the batch.
        self._batch = Batch(self._fs, self.root, sync_filesystem=sync_filesystem, write_temp=write_temp)
        self._fills = FillLocks(self._fs, self.lock_dir, self._batch, clock=clock)

    @property
    def name(self) -> str:
        return f"local store {self.root}"

    def path_for(self, digest: Digest) -> Path:
        return self.cas_dir / digest.hex[:2] / digest.hex

    # -- files below v1/, by directory descriptor ----------------------------------------------

    def read_file(self, parts: tuple[str, ...], name: str, limit: int, *, touch: bool = False,
                  strict: bool = False) -> bytes | None:
        """At most ``limit + 1`` bytes of ``v1/<parts>/<name>``; None if absent. Links: ``NotRegularFile``
        (a linked directory on the way too, with ``strict``; else it reads as absent)."""
        with self._fs.dir("v1", *parts, strict=strict) as fd:
            if fd is None:
                return None
            return read_at(fd, name, limit, path=self.v1.joinpath(*parts, name), touch=touch)

    def write_file(self, parts: tuple[str, ...], name: str, data: bytes, *, durable: bool = True,
                   record: bytes | None = None) -> None:
        """Atomically replace ``v1/<parts>/<name>`` with ``data`` (and a CAS entry's ``record``)."""
        deferred, lazy = self._batch.note_write(parts, durable)
        with self._fs.dir("v1", *parts, create=True) as fd:
            assert fd is not None  # create=True never yields None
            atomic_write_at(fd, name, self.v1.joinpath(*parts), data, durable=durable and not lazy,
                            sync_dir=not deferred, record=record)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Directories walked and checked once for the body (``StoreRoot.begin_session``)."""
        self._fs.begin_session()
        try:
            yield
        finally:
            self._fs.end_session()

    def batch(self, *, sync_each: bool = True, grouped: bool = False) -> AbstractContextManager[None]:
        """Many writes, made durable together: each directory is fsynced once when the body ends.

        ``sync_each`` fsyncs each file before its rename (a power loss can lose a rename, never
        leave a partial entry). ``sync_each=False`` skips those and syncs the store's filesystem
        once at the end (``syncfs``): a write costs no disk flush, every entry is durable when
        the body returns, and a power loss inside the body can leave an entry short at its final
        path, which every read detects (size, then sha256) and refetches. A killed process
        loses nothing either way: renames are atomic and the page cache survives it.

        ``grouped`` (prefetch): a CAS entry (``write_verified``) is written to a temp file and
        renamed later, in groups (``GROUP_MAX``, ``GROUP_SECONDS``, and when the body ends): one
        ``syncfs`` (else an fsync of each temp) makes a group's bytes durable, then its entries
        are renamed into place. So an entry is durable before it is visible, as with
        ``sync_each``, for one flush per group instead of one per file. The digest's lock
        (``lock``) is held until its entry is renamed, so other processes still download it
        once; before this process waits for a lock held elsewhere it commits its group, so two
        processes never wait for each other's groups, and a timer thread commits a group
        ``GROUP_SECONDS`` old, so a process waiting for one of its entries waits about that long
        even while this one stages nothing more. A failed rename is a ``StoreError`` when
        the body ends; a kill leaves the uncommitted group as temp files (``gc`` removes them).
        """
        return self._batch.open(sync_each=sync_each, grouped=grouped)

    @contextmanager
    def stream_file(self, parts: tuple[str, ...], name: str) -> Iterator[BinaryIO]:
        """Stream into a temp file renamed to ``v1/<parts>/<name>`` on a clean exit."""
        with self._fs.dir("v1", *parts, create=True) as fd:
            assert fd is not None
            with atomic_file_at(fd, name, self.v1.joinpath(*parts)) as f:
                yield f

    def remove_file(self, parts: tuple[str, ...], name: str) -> bool:
        """Remove ``v1/<parts>/<name>``; False if it was not there."""
        with self._fs.dir("v1", *parts, check=True) as fd:
            if fd is None:
                return False
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise StoreError(f"cannot remove {self.v1.joinpath(*parts, name)}: {exc.strerror or exc}") from exc
            return True

    def list_dir(self, parts: tuple[str, ...], *, only: Callable[[str], bool] | None = None) -> list[tuple[str, os.stat_result]]:
        """(name, lstat) of everything in ``v1/<parts>`` (whose name ``only`` accepts), sorted by name; [] if absent."""
        with self._fs.dir("v1", *parts) as fd:
            if fd is None:
                return []
            return _list(fd, self.v1.joinpath(*parts), only=only)

    def list_names(self, parts: tuple[str, ...]) -> list[str]:
        """The names in ``v1/<parts>`` (no stat: a shard of a big store holds thousands); [] if absent."""
        with self._fs.dir("v1", *parts) as fd:
            if fd is None:
                return []
            try:
                with os.scandir(fd) as it:
                    return sorted(entry.name for entry in it)
            except OSError as exc:
                raise StoreError(f"cannot list {self.v1.joinpath(*parts)}: {exc.strerror or exc}") from exc

    def file_lock(self, parts: tuple[str, ...], name: str, timeout: float | None = None,
                  what: str = "") -> AbstractContextManager[None]:
        """An exclusive cross-process lock on ``v1/<parts>/<name>``."""
        return self._locked(parts, name, self.lock_timeout if timeout is None else timeout, what)

    @contextmanager
    def _locked(self, parts: tuple[str, ...], name: str, timeout: float, what: str) -> Iterator[None]:
        with self._fs.dir("v1", *parts, create=True) as fd:
            with file_lock(self.v1.joinpath(*parts, name), timeout, what=what, dir_fd=fd, clock=self._clock):
                yield

    # -- Layer ----------------------------------------------------------------------------------

    def read_entry(self, digest: Digest, limit: int, *, touch: bool = False) -> bytes | None:
        """At most ``limit + 1`` bytes of the CAS entry (unverified); None if absent. Links: ``NotRegularFile``."""
        hex_ = digest.hex
        if self._fs.in_session:
            # A batch or session holds each shard it used: a read (pack) or a miss (prefetch's
            # check before and under the lock) opens one name, not two.
            shard = self._fs.session_read_dir("v1", "cas", hex_[:2])
            if shard is None:
                return None
            return read_at(shard, hex_, limit, path=f"{self.cas_dir}/{hex_[:2]}/{hex_}", touch=touch)
        cas = self._fs.held_dir("v1", "cas")  # two names opened, not a walk from the root (read_verified: one)
        # The path only names the file in messages: a string, not two Path joins per hit.
        data = None if cas is None else read_below(cas, hex_[:2], hex_, limit, path=f"{self.cas_dir}/{hex_[:2]}/{hex_}",
                                                   touch=touch)
        if data is None and not (cas is not None and self._is_current(cas)):
            # `cas` did not exist when first opened, or was replaced since: walk, and hold the new one.
            data = self.read_file(("cas", hex_[:2]), hex_, limit, touch=touch)
            if data is not None:
                self._fs.held_dir("v1", "cas", refresh=True)
        return data

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        try:
            data = self.read_entry(digest, limit_for(size), touch=True)
        except NotRegularFile as exc:
            # Never follow a planted symlink; the next write replaces the link itself.
            _log.warning("ignoring %s: %s", self.path_for(digest), exc)
            return None
        held = self._shards.get(digest.hex[:2])
        if data is not None and held is not None:
            # Found here, so read_verified may have missed it through a shard directory replaced
            # since it was opened (or the entry was written meanwhile): check, once per such read.
            self._hold_shard(digest.hex[:2], stale=held)
        return data

    def read_verified(self, digest: Digest, size: int) -> bytes | None:
        """The entry's bytes if it is a regular file of exactly ``size`` bytes that checks out, else None.

        The check: where this store passes the ownership rule (``trusts_records``) and the entry is
        this user's (or root's) and not writable by others, its record (``record.py``: xxh3-128 and
        the sha256 it was verified against when written) must match; else, or without a record,
        sha256. An entry of ours that passes sha256 without a matching record gets one.

        The hit path (``Store.get``, ``pack``): one open below the shard's held descriptor that
        follows no link (a shard's first hit opens and closes its directory too, see ``__init__``),
        one fstat, one read of at most ``size + 1`` bytes (with gc's mtime bump at most hourly),
        one getxattr, one hash. Where the compiled helper was built (``cubinstore._core.native``)
        these are one call of its ``read_entry``, given the same rules; any outcome of it but the
        bytes or a missing name takes the Python path below, which reads again and decides. Raises
        nothing and changes nothing else: a None (a miss, a link, bad bytes, an I/O error) is the
        caller's to resolve through the layered ``Store.get``, which words the error, quarantines
        bad bytes and fetches.
        """
        hex_ = digest.hex
        name = hex_[:2]
        shard = self._shards.get(name)
        opened = shard is None
        if opened:
            if name in self._shards_read:
                shard = self._hold_shard(name)  # its second hit: held from now on
                if shard is None:
                    return None
                opened = False
            else:  # its first hit: open and close the shard (see __init__)
                self._shards_read.add(name)
                shard = self._open_shard(name)
                if shard is None:
                    return None
        trusts = self._trusts
        # The ownership rule for the store (decided once) and the shard (as opened); the entry's, below.
        trusted = (trusts if trusts is not None else self.trusts_records()) and self._shard_owned.get(name, False)
        try:
            read = self._read_native
            if read is not None:
                # One call: the entry's ownership, size and record, checked as below. Anything but
                # bytes or a missing name (0) is the Python path's to look at again, and to word.
                got = read(shard, hex_, size, READ_FLAGS, TOUCH_AFTER,
                           (_record.NAME, _record.head(hex_), *self._vouch) if trusted else None)
                if got.__class__ is bytes:
                    if trusted:
                        self.checks["xxh3"] += 1
                        return got
                    return self._check_by_sha256(name, hex_, got, None, None, trusted=False)
                if got == 0:
                    return None
            got = read_entry_at(shard, hex_, size, path=f"{self._cas_text}/{name}/{hex_}")
        except (NotRegularFile, StoreError):  # a link, not a file, unreadable: Store.get tells which
            return None
        finally:
            if opened:
                os.close(shard)
        if got is None:
            return None
        data, st, record = got
        if len(data) != size:
            return None
        # The entry's ownership; then the record (version, sha256, xxh3-128).
        if trusted and owned_entry(st):
            if record is not None and _record.matches(record, hex_, data):
                self.checks["xxh3"] += 1
                return data
            return self._check_by_sha256(name, hex_, data, st, record, trusted=True)
        return self._check_by_sha256(name, hex_, data, st, record, trusted=False)

    def _check_by_sha256(self, name: str, hex_: str, data: bytes, st: os.stat_result | None, record: bytes | None, *,
                         trusted: bool) -> bytes | None:
        """``read_verified``'s check where no record vouches for ``data``: sha256; an entry of ours
        (``trusted``, with its ``st``) that passes gets its record, for the next process's first load."""
        if hashlib.sha256(data).hexdigest() != hex_:
            return None
        self.checks["sha256"] += 1
        if trusted and self._record(name, hex_, st, data):  # ours, verified, its record missing or stale:
            self.checks["recorded" if record is None else "stale records"] += 1  # recorded for the next load
            if record is not None:
                _log.warning("%s/%s/%s: its record did not match its bytes, which verify by sha256; recorded again",
                             self._cas_text, name, hex_)
        return data

    def trusts_records(self) -> bool:
        """Whether a first load may check an entry's record instead of sha256: ``CUBINSTORE_VERIFY`` is
        not ``full``, the store was not declared shared, xxhash is installed, and the root, ``v1`` and
        ``v1/cas`` pass the ownership rule (decided once per store object)."""
        if self._trusts is None:
            xxh3 = _record.xxh3_128()
            trusts = (not _env.verify_full() and not self._fs.allow_shared and xxh3 is not None
                      and self._fs.owned("v1", "cas"))
            if trusts and self._read_native is not None:
                # The native reader's rule, fixed with the decision: the hash, and the owners an entry
                # may have (entry_rule is POSIX's, as the reader is: not asked where there is none).
                self._vouch = (xxh3, *entry_rule())
            self._trusts = trusts
        return self._trusts

    def _open_shard(self, name: str, *, note: bool = False) -> int | None:
        """``cas/<name>`` opened below the held ``cas`` without following a link, its ownership noted
        once (again with ``note``); None if absent or a link (Store.get's layered read logs that).
        The caller closes it, or holds it (``_hold_shard``)."""
        cas = self._fs.held_dir("v1", "cas")
        if cas is None:
            return None
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=cas)
        except OSError:
            return None
        if note or name not in self._shard_owned:
            try:
                self._shard_owned[name] = not unsafe_reasons(os.fstat(fd))
            except OSError:
                os.close(fd)
                return None
        return fd

    def read_entry_and_record(self, digest: Digest, limit: int) -> tuple[bytes, os.stat_result, bytes | None] | None:
        """For ``verify``: at most ``limit + 1`` bytes of the entry (unverified, gc's clock untouched),
        its stat and its record, from one open; None if absent. Links: ``NotRegularFile``."""
        hex_ = digest.hex
        path = f"{self._cas_text}/{hex_[:2]}/{hex_}"
        if self._fs.in_session:  # verify's walk: each shard opened once
            shard = self._fs.session_read_dir("v1", "cas", hex_[:2])
            return None if shard is None else read_entry_at(shard, hex_, limit, path=path, touch=False)
        with self._fs.dir("v1", "cas", hex_[:2]) as held:
            return None if held is None else read_entry_at(held, hex_, limit, path=path, touch=False)

    def check_record(self, digest: Digest, data: bytes, st: os.stat_result, record: bytes | None) -> str:
        """For ``verify``, once ``data`` (the entry's bytes, read with ``st`` and ``record`` by
        ``read_entry_and_record``) verified by sha256: ``"ok"`` (its record matches), ``"recorded"`` /
        ``"re-recorded"`` (a missing / stale record written now), or ``"none"`` (no record can be kept:
        a store that fails the ownership rule, no xattrs, no xxhash)."""
        hex_ = digest.hex
        if record is not None and _record.matches(record, hex_, data):
            return "ok"
        if not (self.trusts_records() and owned_entry(st)):
            return "none"
        if not self._record(hex_[:2], hex_, st, data):
            return "none"
        return "recorded" if record is None else "re-recorded"

    def _record(self, name: str, hex_: str, st: os.stat_result, data: bytes) -> bool:
        """Attach the record of ``data`` (just verified by sha256) to the entry it was read from, if
        that file is still the one read (same inode); whether it was. Best effort: without a record
        the next load just hashes again."""
        value = _record.make(hex_, data)
        try:
            with self._fs.dir("v1", "cas", name) as shard:
                if shard is None:
                    return False
                fd = os.open(hex_, READ_FLAGS, dir_fd=shard)
                try:
                    now = os.fstat(fd)
                    return (now.st_ino, now.st_dev, now.st_size) == (st.st_ino, st.st_dev, st.st_size) and \
                        _record.write(fd, value)
                finally:
                    os.close(fd)
        except (OSError, StoreError, NotRegularFile) as exc:
            _log.debug("cannot record %s/%s/%s: %s", self._cas_text, name, hex_, exc)
            return False

    def _hold_shard(self, name: str, *, stale: int | None = None) -> int | None:
        """The held descriptor of ``cas/<name>``, opened below the held ``cas`` without following a link;
        None if absent or not a plain directory (the layered path logs a link).

        ``stale``: the held one missed an entry that the layered path found; it is replaced if
        ``cas/<name>`` is now another directory (never closed: another thread may be reading
        through it), so hits take the one-open path again.
        """
        fd = self._open_shard(name, note=True)
        if fd is None:
            return None
        with self._shards_lock:
            held = self._shards.get(name)
            if held is None or (held == stale and not os.path.samestat(os.fstat(fd), os.fstat(held))):
                self._shards[name] = held = fd
                return held
        os.close(fd)
        return held

    def read_verified_entries(self, blobs: Iterable[tuple[Digest, int]]) -> Iterator[bytes | None]:
        """``read_verified`` of each ``(digest, size)`` of ``blobs``, in order (``pack``). Not counted:
        the caller adds the hits."""
        read = self.read_verified
        for digest, size in blobs:
            yield read(digest, size)

    def _is_current(self, held: int) -> bool:
        """Whether the held ``v1/cas`` descriptor is still the directory at that path (a miss then needs no walk)."""
        try:
            now = os.stat(self.cas_dir, follow_symlinks=False)
        except OSError:
            return False
        return os.path.samestat(now, os.fstat(held))

    def write(self, digest: Digest, data: bytes) -> None:
        """Store verified bytes; re-hashes so nothing unverified can ever land at a final path."""
        verify(data, digest, None, where="the caller of LocalLayer.write")
        self.write_verified(digest, data)

    def write_verified(self, digest: Digest, data: bytes) -> None:
        """``write`` for the immutable ``bytes`` the Store hashed a moment ago: once per blob is enough."""
        record = _record.make(digest.hex, data)  # written with the entry: both appear at its rename
        if self._batch.grouped:
            self._batch.stage(digest, data, record)
            return
        self.write_file(("cas", digest.hex[:2]), digest.hex, data, record=record)
        _log.debug("stored %s (%d bytes) in %s", digest, len(data), self.root)

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        # Re-check by hash alone before moving anything: another process may already have
        # replaced the bad file, or the caller asked with a wrong size for a good entry.
        try:
            current = self.read_file(("cas", digest.hex[:2]), digest.hex, MAX_BLOB_SIZE)
        except (NotRegularFile, StoreError):
            current = None
        if current is not None:
            try:
                verify(current, digest, None, where=self.name)
                _log.warning("kept %s in %s: it verifies by hash; the request was wrong (%s)", digest, self.root, reason)
                return
            except CubinstoreError:
                pass
        moved = self.quarantine(digest)
        if moved is not None:
            _log.warning("quarantined corrupt entry %s to %s: %s", digest, moved, reason)

    def lock(self, digest: Digest) -> AbstractContextManager[None]:
        """The lock a fill of ``digest`` holds: byte ``int(hex[2:17], 16)`` of ``v1/locks/<hh>.lock``.

        One lock file per shard, not per digest: a fill creates one inode (its entry), and the
        256 lock files are never removed. Two digests that share the byte (15 hex digits beyond
        the shard) only serialise their downloads. Without range locks (not Linux), a lock file
        per digest, ``v1/locks/<hh>/<hex>.lock``, as older versions used. In a grouped batch the
        lock of an entry written under it is released when the entry is renamed into place.
        """
        return self._fills.lock(digest, self.lock_timeout)

    # -- inspection and maintenance -------------------------------------------------------------

    def quarantine(self, digest: Digest | Path) -> Path | None:
        """Move an entry (by digest, or its CAS path) out of the CAS, kept for forensics; None if gone."""
        name = digest.hex if isinstance(digest, Digest) else digest.name
        if not _HEX_RE.fullmatch(name):
            raise StoreError(f"cannot quarantine {digest}: not a CAS entry name")
        target = f"{name}.{time.time_ns()}.{os.getpid()}"
        with self._fs.dir("v1", "cas", name[:2], check=True) as src:
            if src is None:
                return None
            with self._fs.dir("v1", "quarantine", create=True) as dst:
                try:
                    os.replace(name, target, src_dir_fd=src, dst_dir_fd=dst)
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    raise StoreError(
                        f"cannot quarantine {self.cas_dir / name[:2] / name} to {self.quarantine_dir / target}: "
                        f"{exc.strerror or exc}"
                    ) from exc
        return self.quarantine_dir / target

    def status(self, digest: Digest, size: int | None) -> str:
        """``"ok"``, ``"missing"`` or ``"corrupt"`` for one entry, changing nothing (for ``ls``)."""
        try:
            data = self.read_entry(digest, limit_for(size))
        except NotRegularFile:
            return "corrupt"
        if data is None:
            return "missing"
        try:
            verify(data, digest, size, where=self.name)
        except CubinstoreError:
            return "corrupt"
        return "ok"

    def scan(self) -> tuple[list[Entry], list[Path]]:
        """Entries at well-formed final paths, and everything else under ``cas/`` (strays, temps, links)."""
        entries: list[Entry] = []
        strays: list[Path] = []
        for shard, st in self.list_dir(("cas",)):
            if not (_SHARD_RE.fullmatch(shard) and stat.S_ISDIR(st.st_mode)):
                strays.append(self.cas_dir / shard)
                continue
            for name, st in self.list_dir(("cas", shard)):
                path = self.cas_dir / shard / name
                if _HEX_RE.fullmatch(name) and name[:2] == shard and stat.S_ISREG(st.st_mode):
                    entries.append(Entry(Digest(name), path, st.st_size, st.st_mtime))
                else:
                    strays.append(path)
        return entries, strays

    def clean_temps(self, older_than: float = 3600.0) -> list[Path]:
        """Remove temp files left by killed writers (only old ones: a live writer may own a new one)."""
        removed: list[Path] = []
        cutoff = time.time() - older_than
        for shard, st in self.list_dir(("cas",)):
            if not (_SHARD_RE.fullmatch(shard) and stat.S_ISDIR(st.st_mode)):
                continue
            # Names first: only a temp's name costs a stat (a shard of a big store holds thousands).
            for name, st in self.list_dir(("cas", shard), only=lambda n: n.startswith(_TEMP_PREFIX)):
                if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                    if self.remove_file(("cas", shard), name):
                        removed.append(self.cas_dir / shard / name)
                        _log.info("removed stale temp file %s", self.cas_dir / shard / name)
        # Left by a killed unpack: in staging/<hh>/ (and staging/ itself, where older versions staged).
        shards = [(s,) for s, st in self.list_dir(("staging",)) if _SHARD_RE.fullmatch(s) and stat.S_ISDIR(st.st_mode)]
        for sub in [(), *shards]:
            where = ("staging", *sub)
            for name, st in self.list_dir(where, only=lambda n: n.startswith(_TEMP_PREFIX)):
                if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                    if self.remove_file(where, name):
                        removed.append(self.v1.joinpath(*where, name))
                        _log.info("removed stale staged file %s", self.v1.joinpath(*where, name))
        return removed

    def clean_locks(self) -> int:
        """Remove per-digest lock files (``v1/locks/<hh>/<hex>.lock``) that no process holds; how many went.

        Only older versions (and hosts without range locks) make them; of those, a file whose
        entry is present is kept where this host still locks per digest. The per-shard lock
        files of range locks are few and permanent, and never removed.
        """
        removed = 0
        for shard, st in self.list_dir(("locks",)):
            if not (_SHARD_RE.fullmatch(shard) and stat.S_ISDIR(st.st_mode)):
                continue
            present = set() if RANGE_LOCKS else set(self.list_names(("cas", shard)))
            with self._fs.dir("v1", "locks", shard, check=True) as fd:
                if fd is None:
                    continue
                absent = lambda n: (m := _LOCK_RE.fullmatch(n)) is not None and m.group(1) not in present  # noqa: E731
                for name, st in _list(fd, self.lock_dir / shard, only=absent):
                    if stat.S_ISREG(st.st_mode) and remove_if_unheld(fd, name):
                        removed += 1
        return removed

    def remove(self, digest: Digest) -> bool:
        return self.remove_file(("cas", digest.hex[:2]), digest.hex)

    def remove_many(self, digests: list[Digest]) -> set[Digest]:
        """Remove CAS entries (gc's evictions), one checked walk per shard; the digests that were there."""
        by_shard: dict[str, list[Digest]] = {}
        for digest in digests:
            by_shard.setdefault(digest.hex[:2], []).append(digest)
        removed: set[Digest] = set()
        for shard, group in by_shard.items():
            with self._fs.dir("v1", "cas", shard, check=True) as fd:
                if fd is None:
                    continue
                for digest in group:
                    try:
                        os.unlink(digest.hex, dir_fd=fd)
                    except FileNotFoundError:  # removed concurrently
                        continue
                    except OSError as exc:
                        raise StoreError(f"cannot remove {self.path_for(digest)}: {exc.strerror or exc}") from exc
                    removed.add(digest)
        return removed

    # -- staging: verify many blobs first, publish them together (unpack; batch.py) -------------

    def new_staged(self, digest: Digest) -> tuple[BinaryIO, str]:
        """A fresh temp file in ``v1/staging/<hh>`` to stream ``digest``'s bytes into, and its name."""
        return self._batch.new_staged(digest)

    def commit_staged(self, name: str, digest: Digest) -> None:
        """Rename a staged temp file (verified by the caller) to its CAS entry."""
        self._batch.commit_staged(name, digest)

    def sync_staged(self, staged: list[tuple[str, Digest]]) -> None:
        """Make staged files durable: one filesystem sync, else an fsync of each."""
        self._batch.sync_staged(staged)

    def drop_staged(self, name: str, digest: Digest) -> None:
        where = ("staging", digest.hex[:2])
        try:
            self.remove_file(where, name)
        except StoreError as exc:
            _log.warning("cannot remove staged file %s: %s", self.v1.joinpath(*where, name), exc)

    def iter_digests(self) -> Iterator[Digest]:
        entries, _ = self.scan()
        return (e.digest for e in entries)


def _close_all(fds: dict[str, int]) -> None:
    """Close a collected store's held shard descriptors (``LocalLayer._shards``)."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass


def _list(fd: int, where: Path, *, only: Callable[[str], bool] | None = None) -> list[tuple[str, os.stat_result]]:
    items: list[tuple[str, os.stat_result]] = []
    try:
        listing = sorted(os.scandir(fd), key=lambda e: e.name)  # scandir dups fd itself
    except OSError as exc:
        raise StoreError(f"cannot list {where}: {exc.strerror or exc}") from exc
    for item in listing:
        if only is not None and not only(item.name):
            continue
        try:
            items.append((item.name, item.stat(follow_symlinks=False)))
        except FileNotFoundError:  # removed by a concurrent gc or quarantine
            continue
    return items
