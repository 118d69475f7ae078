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

__all__ = ["file_lock"]

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
def file_lock(path: Path, timeout: float, *, what: str = "") -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed) for the ``with`` body.

    Polls with backoff rather than blocking so the timeout needs no signals. The
    lock is released when the descriptor closes, including when the process dies.
    """
    deadline = time.monotonic() + timeout
    delay = 0.002
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create lock directory {path.parent}: {exc.strerror or exc}") from exc
    while True:
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open lock file {path}: {exc.strerror or exc}") from exc
        if _try_lock(fd):
            # Someone may have replaced the lock file after we opened it; our lock would then guard nothing.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
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
