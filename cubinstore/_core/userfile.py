"""Opening a file a user named (a manifest, a bundle, a key, a policy): the one place below
the store that touches the filesystem, so ``manifest`` and ``trust`` need not import a store."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from cubinstore.errors import BadArgumentError, CubinstoreError

__all__ = ["open_regular"]


def open_regular(path: Path, what: str, error: type[CubinstoreError] = BadArgumentError) -> BinaryIO:
    """Open a file the user named (a manifest, a bundle) for reading, refusing anything not regular.

    Links are followed (``bazel-bin`` is one), but a FIFO, device or directory is refused
    before any blocking read: the open is non-blocking and the type is checked on the
    descriptor. Raises ``error`` naming ``what`` and the path.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise error(f"cannot read {what} {path}: it is {kind}; expected a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
