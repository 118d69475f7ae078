"""File helpers shared by the stores: bounded no-follow reads and atomic writes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from cubinstore._core.log import get_logger
from cubinstore.store.local.root import NotRegularFile, read_at
from cubinstore.errors import StoreError

__all__ = ["NotRegularFile", "atomic_file", "atomic_write", "fsync_dir", "read_regular"]

_log = get_logger(__name__)


def read_regular(path: Path, limit: int, *, touch: bool = False) -> bytes | None:
    """Read at most ``limit + 1`` bytes of the regular file at ``path``; None if it does not exist.

    The last component is not followed if it is a symlink and non-regular files are refused
    (``NotRegularFile``). For directories others may control (the local store) use
    ``LocalLayer.read_file``, which follows no link at all. Reading one byte past ``limit``
    lets the caller see "longer than expected" without reading an arbitrarily large file.
    """
    return read_at(None, os.fspath(path), limit, path=path, touch=touch)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable; best effort (not every OS or filesystem supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        _log.debug("cannot open directory %s to fsync: %s", path, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        _log.debug("cannot fsync directory %s: %s", path, exc)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see the old file, no file, or all of ``data``.

    Unique temp file in the same directory, fsync, rename; on any failure the temp
    file is removed and ``StoreError`` names the path (the old file is unchanged).
    ``durable=False`` skips the fsyncs: still atomic, but may be lost on power failure.
    """
    with atomic_file(path, mode=mode, durable=durable) as f:
        f.write(data)


@contextmanager
def atomic_file(path: Path, *, mode: int = 0o644, durable: bool = True, buffering: int = -1) -> Iterator[BinaryIO]:
    """Stream into a temp file beside ``path``; on a clean exit fsync and rename it to ``path``.

    Any exception removes the temp file; an ``OSError`` becomes a ``StoreError`` naming
    ``path``. ``durable=False`` skips the fsyncs (still atomic). ``buffering``: as ``open``'s.
    """
    directory = path.parent
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        import tempfile  # only the few writers outside the store need it; keeps `import cubinstore` small

        fd, tmp_name = tempfile.mkstemp(prefix=f".tmp.{path.name}.", dir=directory)
    except OSError as exc:
        raise StoreError(f"cannot create a temp file in {directory}: {exc.strerror or exc}") from exc
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
            if hasattr(os, "fchmod"):  # mkstemp creates 0600
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        except OSError as cleanup:
            _log.warning("cannot remove temp file %s: %s", tmp, cleanup)
        if isinstance(exc, OSError):
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise
    if durable:
        fsync_dir(directory)
