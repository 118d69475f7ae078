"""Cross-process exclusive locks with a timeout: a whole file (``flock`` on POSIX), or one byte of a
shared file (Linux open-file-description locks), so that many keys need no file each."""

from __future__ import annotations

import errno
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from cubinstore._core.log import get_logger
from cubinstore.errors import LockTimeoutError, StoreError

__all__ = ["RANGE_LOCKS", "Clock", "acquire", "file_lock", "range_lock", "remove_if_unheld"]

_log = get_logger(__name__)

if sys.platform == "win32":  # pragma: no cover - exercised only on Windows
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


# Byte-range locks that belong to the open file description (F_OFD_SETLK), not the process: two
# threads that each open the file exclude each other like two processes, and closing one
# descriptor releases only its own ranges. Linux only; the struct flock below is LP64's
# (short type, short whence, off_t start, off_t len, pid_t pid, padding).
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None) if sys.platform.startswith("linux") else None
RANGE_LOCKS = _OFD_SETLK is not None and struct.calcsize("l") == 8
_FLOCK = struct.Struct("hhqqi4x")
#: Range-lock offsets are below this (the off_t of start + length must not overflow).
RANGE_LIMIT = 1 << 60


def _try_range(fd: int, offset: int) -> bool:
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class Clock(Protocol):
    """What lock polls (and a local store's counter flushes) time with: the ``time`` module, or a test's stand-in."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float, /) -> None: ...


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


@contextmanager
def file_lock(path: Path, timeout: float, *, what: str = "", dir_fd: int | None = None,
              clock: Clock = time) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body.

    With ``dir_fd`` the lock file is ``path.name`` in that directory (``path`` only names it in
    messages), so no link on the way is followed. Polls with backoff rather than blocking so
    the timeout needs no signals. The lock is released when the descriptor closes, including
    when the process dies.
    """
    if dir_fd is None:
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create lock directory {path.parent}: {exc.strerror or exc}") from exc
    fd = acquire(path, path if dir_fd is None else path.name, dir_fd, timeout, what=what, clock=clock)
    try:
        yield
    finally:
        os.close(fd)


@contextmanager
def range_lock(dir_fd: int, name: str, offset: int, timeout: float, *, path: Path, what: str = "") -> Iterator[None]:
    """Hold an exclusive lock on byte ``offset`` of the file ``name`` in ``dir_fd`` for the ``with`` body (``acquire``)."""
    fd = acquire(path, name, dir_fd, timeout, offset=offset, what=what)
    try:
        yield
    finally:
        os.close(fd)


def acquire(path: Path, target: str | Path, dir_fd: int | None, timeout: float, *, offset: int | None = None,
            what: str = "", on_wait: Callable[[], None] | None = None, clock: Clock = time) -> int:
    """A descriptor of ``target`` (created if needed) that holds an exclusive lock; closing it releases it.

    ``offset`` None locks the whole file (``flock``); else byte ``offset`` of it, which needs
    ``RANGE_LOCKS``. Such a lock belongs to this open of the file, so threads that each call
    this exclude each other too, and two keys at one offset only wait for each other. It goes
    when the descriptor closes, also when the process dies. ``on_wait`` runs before each wait
    while the lock is held elsewhere (a grouped batch commits there what it staged meanwhile:
    two processes each waiting for an entry the other holds must not wait for ever). Polls with
    backoff until ``timeout``, timed and slept by ``clock``.
    """
    if offset is None:
        try_lock = _try_lock
    elif not RANGE_LOCKS or not 0 <= offset < RANGE_LIMIT:
        raise ValueError(f"no range lock at offset {offset} here (range locks: {RANGE_LOCKS}; limit 2**60)")
    else:
        try_lock = lambda fd: _try_range(fd, offset)  # noqa: E731
    deadline = clock.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            fd = os.open(target, _OPEN_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise StoreError(f"cannot open lock file {path}: {exc.strerror or exc}") from exc
        try:
            locked = try_lock(fd)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot lock {path}: {exc.strerror or exc}") from exc
        if locked:
            # gc may have removed (or someone replaced) the file after we opened it; our lock
            # would then guard nothing, so retry on the file now at that name.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(target, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
        os.close(fd)
        if on_wait is not None:
            on_wait()
        if clock.monotonic() >= deadline:
            raise LockTimeoutError(
                f"timed out after {timeout:g}s waiting for lock {path}{' (' + what + ')' if what else ''} "
                "held by another process; raise CUBINSTORE_LOCK_TIMEOUT or find the stuck process"
            )
        clock.sleep(delay)
        delay = min(delay * 2, 0.05)
    _log.debug("locked %s", path)
    return fd


def remove_if_unheld(dir_fd: int, name: str) -> bool:
    """Remove the lock file ``name`` in ``dir_fd`` if no process holds it; True if removed.

    The file is unlinked while we hold its lock, so a process that opened it before the
    unlink and locks it after sees (by ``samestat``) that it is gone and retries on a new one.
    """
    try:
        fd = os.open(name, _OPEN_FLAGS & ~os.O_CREAT, dir_fd=dir_fd)
    except OSError:
        return False  # gone already, or a link: never ours to remove
    try:
        if not _try_lock(fd):
            return False
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
                return False
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)
