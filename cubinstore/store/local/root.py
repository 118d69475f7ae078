"""Paths below a store root opened through directory descriptors, never following a link.

``O_NOFOLLOW`` on a path guards only its last component: a symlinked ``v1``, ``cas/<hh>``,
``locks/<hh>``, ``pins`` or ``quarantine`` would redirect every write, rename and unlink
below it. So every operation walks from the root one component at a time
(``openat(dir_fd, name, O_DIRECTORY | O_NOFOLLOW)``) and then acts on a name relative to
the last descriptor. The root itself is followed (the user chose it); nothing below is.

Before anything is created, renamed, locked or removed, each directory on the way is
checked: writable by group or others, or owned by another user (not root), means another
local user could swap or delete entries, so writes are refused with ``UnsafeStoreError``
unless the store was declared shared (``CUBINSTORE_ALLOW_SHARED_STORE``). Reads need no
such check: every byte read is verified by digest.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from cubinstore._core.log import get_logger
from cubinstore.errors import StoreError, UnsafeStoreError
from cubinstore.store.local import record as _record

__all__ = ["DIR_MODE", "StoreRoot", "atomic_file_at", "atomic_write_at", "fsync_fd", "read_at", "read_below"]

_log = get_logger(__name__)

DIR_MODE = 0o755  # explicit: mkdir's default 0o777 under umask 002 would make a group-writable store
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK so a FIFO planted at an entry name cannot hang open(); regular files ignore it.
READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
              | getattr(os, "O_BINARY", 0))
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 1 << 20
TEMP_PREFIX = ".tmp."
TOUCH_AFTER = 3600.0


class NotRegularFile(Exception):
    """The name is a symlink, directory, FIFO or other non-regular file (never followed or read)."""


class LinkInStore(NotRegularFile):
    """A directory on the way below the root is a symlink or not a directory (a ``strict`` read)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is a symlink or not a directory")
        self.path = path


class StoreRoot:
    """The root directory of a local store; ``dir(*parts)`` opens a directory below it safely."""

    def __init__(self, root: Path, *, allow_shared: bool) -> None:
        self.root = root
        self.allow_shared = allow_shared
        self._held: dict[tuple[str, ...], int] = {}
        self._held_lock = threading.Lock()
        self._session: dict[tuple[str, ...], int] | None = None
        self._session_reads: dict[tuple[str, ...], int] = {}
        self._session_depth = 0

    def held_dir(self, *parts: str, refresh: bool = False) -> int | None:
        """A descriptor of ``root/parts...`` (opened like ``dir``) kept open for reads.

        Hits then open two names instead of walking from the root. Reads through it need no
        re-check (every byte is verified); a caller that misses passes ``refresh`` after a
        fresh walk found the directory replaced. Old descriptors are never closed: another
        thread may be using one, and a closed number could be reused for another file.
        """
        fd = None if refresh else self._held.get(parts)
        if fd is None:
            with self._held_lock:
                fd = None if refresh else self._held.get(parts)
                if fd is None:
                    fd = self._open(parts, create=False, check=False)
                    if fd is not None:
                        self._held[parts] = fd
        return fd

    @contextmanager
    def dir(self, *parts: str, create: bool = False, check: bool = False,
            strict: bool = False) -> Iterator[int | None]:
        """A descriptor of ``root/parts...``, or None when it does not exist (and not ``create``).

        ``create`` makes missing directories (mode 0755); ``create`` or ``check`` verifies that
        no directory on the way is writable by another user. A symlink or non-directory on
        the way is an ``UnsafeStoreError`` when writing and a miss (None, logged) when reading,
        or ``LinkInStore`` with ``strict`` (where reading it as absent would hide state).
        """
        session = self._session
        if session is not None:
            with self._held_lock:
                fd = session.get(parts)
        if session is not None and not strict and (fd is not None or create or check):
            # Inside a session a directory checked once serves every operation; a read of one not
            # yet held takes the plain path below (reads need no ownership check).
            if fd is None:
                fd = self._open(parts, create=create, check=True)
                if fd is not None:
                    with self._held_lock:
                        if parts in session:  # another thread opened it first
                            os.close(fd)
                            fd = session[parts]
                        else:
                            session[parts] = fd
            yield fd
            return
        fd = self._open(parts, create=create, check=check or create, strict=strict)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @property
    def in_session(self) -> bool:
        return self._session is not None

    def session_read_dir(self, *parts: str) -> int | None:
        """In a session, a descriptor of ``root/parts...`` for reads, opened once (unchecked, like
        ``held_dir``) and kept until the session ends; None outside a session or if absent.

        A pack reads thousands of entries of 256 shards: one open per shard, not per entry.
        """
        session = self._session
        if session is None:
            return None
        with self._held_lock:
            fd = session.get(parts)
            if fd is None:
                fd = self._session_reads.get(parts)
        if fd is not None:
            return fd
        fd = self._open(parts, create=False, check=False)
        if fd is None:
            return None
        with self._held_lock:
            if self._session is not session:  # the session ended meanwhile
                os.close(fd)
                return None
            held = self._session_reads.setdefault(parts, fd)
        if held != fd:
            os.close(fd)
        return held

    def begin_session(self) -> None:
        """Until ``end_session``, ``dir`` keeps each directory it opens (checked, as for a write).

        For a batch of many writes (prefetch, unpack, gc): the walk from the root and the
        ownership checks run once per directory, not once per file. What a walk guards
        against is the same: every operation still acts on a descriptor of a directory that
        was reached without following a link and checked when it was opened.
        """
        with self._held_lock:
            self._session_depth += 1
            if self._session is None:
                self._session = {}

    def end_session(self) -> None:
        with self._held_lock:
            self._session_depth -= 1
            if self._session_depth > 0 or self._session is None:
                return
            session, self._session = self._session, None
            reads, self._session_reads = self._session_reads, {}
        for fd in [*session.values(), *reads.values()]:
            os.close(fd)

    def _open(self, parts: tuple[str, ...], *, create: bool, check: bool, strict: bool = False) -> int | None:
        path = self.root
        try:
            fd = os.open(path, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.makedirs(path, DIR_MODE, exist_ok=True)
                fd = os.open(path, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                raise StoreError(f"cannot create store directory {path}: {exc.strerror or exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot open store directory {path}: {exc.strerror or exc}") from exc
        try:
            if check:
                self._check(fd, path)
            for part in parts:
                path = path / part
                parent, fd = fd, None  # _step closes the parent, whatever happens
                fd = self._step(parent, part, path, create=create, check=check, strict=strict)
                if fd is None:
                    return None
                if check:
                    self._check(fd, path)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return fd

    def _step(self, parent: int, name: str, path: Path, *, create: bool, check: bool, strict: bool = False) -> int | None:
        """Open ``name`` below ``parent`` (closing ``parent``): the child's descriptor or None."""
        try:
            for _ in range(2):
                try:
                    return os.open(name, _DIR_FLAGS, dir_fd=parent)
                except FileNotFoundError:
                    if not create:
                        return None
                    try:
                        os.mkdir(name, DIR_MODE, dir_fd=parent)
                    except FileExistsError:
                        pass  # another process made it first
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                message = (
                    f"{path} is a symlink or not a directory; cubinstore never follows links inside "
                    f"its store (remove it, or point CUBINSTORE_HOME at the real directory)"
                )
                if create or check:
                    raise UnsafeStoreError(f"refusing to use {message}") from exc
                if strict:
                    raise LinkInStore(path) from exc
                _log.warning("ignoring %s", message)
                return None
            raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(parent)

    def _check(self, fd: int, path: Path) -> None:
        if self.allow_shared:
            return
        problems = unsafe_reasons(os.fstat(fd))
        if problems:
            raise UnsafeStoreError(
                f"refusing to write to the store at {self.root}: {path} is {' and '.join(problems)}, so another "
                f"local user could replace or delete its entries; run `chmod go-w {path}` (and chown it), or set "
                "CUBINSTORE_ALLOW_SHARED_STORE=1 if everyone who can write it is trusted"
            )

    def owned(self, *parts: str) -> bool:
        """Whether the root and each directory down to ``root/parts...`` exist and pass the ownership
        rule (``unsafe_reasons``): the walk a write makes, answered instead of raised. A store declared
        shared passes no check, so it is never owned."""
        if self.allow_shared:
            return False
        try:
            fd = self._open(parts, create=False, check=True)
        except StoreError:  # UnsafeStoreError (the rule, or a link on the way) or an unreadable directory
            return False
        if fd is None:
            return False
        os.close(fd)
        return True


_geteuid = getattr(os, "geteuid", None)  # None on Windows: no owners to check
OTHERS_WRITE = 0o022  # the ownership rule: no directory or entry of the store writable by group or others


def unsafe_reasons(st: os.stat_result) -> list[str]:
    """The ownership rule, for a directory or an entry: why another local user could change it
    (writable by group or others, owned by someone other than this user or root); [] if none could."""
    problems = []
    if st.st_mode & OTHERS_WRITE:
        problems.append(f"writable by {'group and others' if st.st_mode & OTHERS_WRITE == OTHERS_WRITE else 'group' if st.st_mode & 0o020 else 'others'} "
                        f"(mode {stat.S_IMODE(st.st_mode):#o})")
    if _geteuid is not None and st.st_uid not in (_geteuid(), 0):
        problems.append(f"owned by uid {st.st_uid}, not {_geteuid()}")
    return problems


def owned_entry(st: os.stat_result) -> bool:
    """``unsafe_reasons(st) == []`` for the hit path: two compares, no list."""
    return not st.st_mode & OTHERS_WRITE and (_geteuid is None or st.st_uid == 0 or st.st_uid == _geteuid())


def entry_rule() -> tuple[int, int, int]:
    """``owned_entry`` as the native reader applies it (``cubinstore._core.native``): the two owners
    an entry may have (this user, root) and the mode bits it must not have. POSIX only."""
    return os.geteuid(), 0, OTHERS_WRITE


def read_below(dir_fd: int, sub: str, name: str, limit: int, *, path: Path | str, touch: bool = False) -> bytes | None:
    """``read_at`` of ``sub/name`` below ``dir_fd``, ``sub`` opened without following a link.

    None if absent; a symlinked ``sub`` is a miss (logged), like a walk of ``StoreRoot.dir``.
    """
    try:
        fd = os.open(sub, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            _log.warning("ignoring %s: a symlink or not a directory; cubinstore never follows links inside its store",
                         Path(path).parent)
            return None
        raise StoreError(f"cannot open {Path(path).parent}: {exc.strerror or exc}") from exc
    try:
        return read_at(fd, name, limit, path=path, touch=touch)
    finally:
        os.close(fd)


def _open_file(dir_fd: int | None, name: str, path: Path | str) -> int | None:
    """``name`` in ``dir_fd`` opened for reading without following a link; None if absent.
    A symlink (or a path below a non-directory) raises ``NotRegularFile``, another failure ``StoreError``."""
    try:
        return os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
            raise NotRegularFile(f"{path} is a symlink or below a non-directory") from exc
        raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from exc


def read_at(dir_fd: int | None, name: str, limit: int, *, path: Path | str, touch: bool = False) -> bytes | None:
    """At most ``limit + 1`` bytes of the regular file ``name`` in ``dir_fd`` (None: a plain path); None if absent.

    A symlink or non-regular file raises ``NotRegularFile``; ``touch`` bumps mtime (gc's LRU clock)
    when it is ``TOUCH_AFTER`` seconds old or more.
    """
    fd = _open_file(dir_fd, name, path)
    if fd is None:
        return None
    try:
        return read_fd(fd, limit, path=path, touch=touch)
    finally:
        os.close(fd)


def read_entry_at(dir_fd: int, name: str, limit: int, *, path: str,
                  touch: bool = True) -> tuple[bytes, os.stat_result, bytes | None] | None:
    """``read_at`` of a CAS entry (with ``touch``, gc's clock, unless told), plus the file's stat and
    its record (``record.py``), all from the one open file; None if absent."""
    try:  # every first load passes here: _open_file's common case first, without a call
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        fd = _open_file(dir_fd, name, path)  # None if absent; else words why
        if fd is None:
            return None
    try:
        st = os.fstat(fd)
        data = read_fd(fd, limit, path=path, touch=touch, st=st)
        try:
            record = os.getxattr(fd, _record.NAME)
        except OSError:  # none, no xattrs here, or unreadable: treated as absent (sha256 decides)
            record = None
        return data, st, record
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int, *, path: Path | str, touch: bool = False, st: os.stat_result | None = None) -> bytes:
    """Read at most ``limit + 1`` bytes from the open regular file ``fd`` (``NotRegularFile`` otherwise);
    ``st``: its fstat, if the caller has it."""
    try:
        if st is None:
            st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            want = min(_CHUNK, limit + 1 - total)
            chunk = os.read(fd, want)
            chunks.append(chunk)
            total += len(chunk)
            if len(chunk) < want:
                # A regular file reads short only at its end (or where it is being cut short,
                # which the caller's size and sha256 check sees): no second read to find EOF.
                break
        # An hour of resolution is plenty for gc's LRU order, and most hits then write nothing.
        if touch and time.time() - st.st_mtime >= TOUCH_AFTER:
            try:
                os.utime(fd)
            except OSError as exc:  # a read-only shared store still serves reads
                _log.debug("cannot update mtime of %s: %s", path, exc)
        return b"".join(chunks)
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc


def fsync_fd(fd: int, what: Path) -> None:
    """Make a rename in the directory ``fd`` durable; best effort (not every filesystem supports it)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        _log.debug("cannot fsync directory %s: %s", what, exc)


def sync_filesystem(path: Path) -> bool:
    """Flush every dirty page and directory entry of the filesystem holding ``path`` (one
    ``syncfs``; ``os.sync`` where there is none). False if neither could run.

    A ``syncfs`` that fails (a writeback error: since Linux 5.8 it reports them) raises
    ``StoreError`` naming the path and the error: the caller must not take the bytes as durable
    (``os.sync`` cannot stand in for it, since it reports nothing).
    """
    try:
        fd = os.open(path, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        _log.debug("cannot open %s to sync its filesystem: %s", path, exc)
        return False
    try:
        if sys.platform.startswith("linux"):
            import ctypes  # only a batch of writes needs it

            libc = ctypes.CDLL(None, use_errno=True)
            syncfs = getattr(libc, "syncfs", None)
            if syncfs is not None:
                if syncfs(fd) == 0:
                    return True
                err = ctypes.get_errno()
                if err not in (errno.ENOSYS, errno.EOPNOTSUPP):
                    raise StoreError(f"cannot make the writes under {path} durable: syncfs failed: "
                                     f"{os.strerror(err)} (errno {err})")
        if hasattr(os, "sync"):
            os.sync()
            return True
        return False
    finally:
        os.close(fd)


def unlink_quiet(dir_fd: int, name: str, path: Path) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        _log.warning("cannot remove temp file %s: %s", path, exc)


def new_temp(dir_fd: int, name: str, directory: Path) -> tuple[int, str]:
    """Create a fresh temp file beside ``name`` (mode 0600, never through a link): (fd, its name)."""
    for _ in range(100):
        tmp = f"{TEMP_PREFIX}{name}.{os.urandom(6).hex()}"  # what secrets.token_hex does, without its imports
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise StoreError(f"cannot create a temp file in {directory}: {exc.strerror or exc}") from exc
    raise StoreError(f"cannot create a temp file in {directory}: every name tried exists")


@contextmanager
def atomic_file_at(dir_fd: int, name: str, directory: Path, *, mode: int = 0o644,
                   durable: bool = True, sync_dir: bool = True, record: bytes | None = None) -> Iterator[BinaryIO]:
    """Stream into a temp file in ``dir_fd``; on a clean exit fsync it and rename it to ``name``.

    ``sync_dir=False``: the caller fsyncs the directory later (once for many renames). ``record``
    (a CAS entry's, ``record.py``) is attached to the temp file before the fsync and the rename.

    Any exception removes the temp file; an ``OSError`` becomes a ``StoreError`` naming the path
    (an old file at ``name`` is unchanged).
    """
    path = directory / name
    fd, tmp = new_temp(dir_fd, name, directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            _record.write(f.fileno(), record)
            if durable:
                os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        unlink_quiet(dir_fd, tmp, directory / tmp)
        if isinstance(exc, OSError):
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise
    if durable and sync_dir:
        fsync_fd(dir_fd, directory)


def write_temp_at(dir_fd: int, name: str, directory: Path, data: bytes, *, mode: int = 0o644,
                  record: bytes | None = None) -> str:
    """A new temp file beside ``name`` in ``dir_fd`` holding ``data`` (and ``record``), neither synced
    nor renamed: its name.

    For writes made durable together and renamed later (``LocalLayer.batch(grouped=True)``).
    """
    fd, tmp = new_temp(dir_fd, name, directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            _record.write(f.fileno(), record)
            os.fchmod(f.fileno(), mode)
    except BaseException as exc:
        unlink_quiet(dir_fd, tmp, directory / tmp)
        if isinstance(exc, OSError):
            raise StoreError(f"cannot write {directory / name}: {exc.strerror or exc}") from exc
        raise
    return tmp


def atomic_write_at(dir_fd: int, name: str, directory: Path, data: bytes, *, mode: int = 0o644,
                    durable: bool = True, sync_dir: bool = True, record: bytes | None = None) -> None:
    """``atomic_file_at`` for bytes already in memory."""
    with atomic_file_at(dir_fd, name, directory, mode=mode, durable=durable, sync_dir=sync_dir,
                        record=record) as f:
        f.write(data)
