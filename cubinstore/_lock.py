"""A cross-process exclusive lock on a file, with a timeout (``flock`` on POSIX)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cubinstore.errors import LockTimeoutError, StoreError

__all__ = ["file_lock", "remove_if_unheld"]

_log = logging.getLogger(__name__)

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


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


@contextmanager
def file_lock(path: Path, timeout: float, *, what: str = "", dir_fd: int | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body.

    With ``dir_fd`` the lock file is ``path.name`` in that directory (``path`` only names it in
    messages), so no link on the way is followed. Polls with backoff rather than blocking so
    the timeout needs no signals. The lock is released when the descriptor closes, including
    when the process dies.
    """
    deadline = time.monotonic() + timeout
    delay = 0.002
    target: str | Path = path
    if dir_fd is None:
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create lock directory {path.parent}: {exc.strerror or exc}") from exc
    else:
        target = path.name
    while True:
        try:
            fd = os.open(target, _OPEN_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise StoreError(f"cannot open lock file {path}: {exc.strerror or exc}") from exc
        if _try_lock(fd):
            # gc may have removed (or someone replaced) the file after we opened it; our lock
            # would then guard nothing, so retry on the file now at that name.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(target, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
        os.close(fd)
        if time.monotonic() >= deadline:
            raise LockTimeoutError(
                f"timed out after {timeout:g}s waiting for lock {path}{' (' + what + ')' if what else ''} "
                "held by another process; raise CUBINSTORE_LOCK_TIMEOUT or find the stuck process"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    _log.debug("locked %s", path)
    try:
        yield
    finally:
        os.close(fd)


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
