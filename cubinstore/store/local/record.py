"""The record of a CAS entry: its xxh3-128 and the sha256 it was verified against, kept in an
extended attribute of the entry's inode (``user.cubinstore.v1``).

Why: sha256 of a median 50 KB CUBIN costs about as much as the driver's load of it; xxh3-128
costs a fifteenth. Every byte that enters the store is still checked by sha256; the record
written with it lets a later first load from a store this user owns check size and xxh3
instead (``LocalLayer.read_verified``): bit rot, a truncation or a swapped file is still caught.

Why an xattr: it is written to the temp file before the rename that publishes the entry, so
an entry and its record appear together and a crash leaves both or neither; a file moved or
hard-linked to another digest's name carries its own record, which names its own digest. A
filesystem without user xattrs (or a copy that dropped them) just has no records: every first
load then pays sha256, as before.
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = ["NAME", "Recorder", "head", "make", "matches", "write"]

NAME = "user.cubinstore.v1"
_VERSION = b"\x01"
SIZE = 1 + 32 + 16  # version, sha256, xxh3-128
# No record support here (xattrs unsupported, not permitted, a read-only or full filesystem):
# the entry is stored without one and loads with sha256.
_UNSUPPORTED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOSPC,
                          errno.EDQUOT, errno.E2BIG})

_xxh3: Any = None  # xxhash.xxh3_128_digest once imported; False: not installed


def xxh3_128() -> Any:
    """``xxhash.xxh3_128_digest``, imported on first use (not by ``import cubinstore``); None without xxhash."""
    global _xxh3
    if _xxh3 is None:
        try:
            from xxhash import xxh3_128_digest
        except ImportError:  # a --no-deps install: no records, sha256 on every first load
            _xxh3 = False
        else:
            _xxh3 = xxh3_128_digest
    return _xxh3 or None


def head(hex_: str) -> bytes:
    """The record's bytes before the xxh3-128 digest: its version, the sha256 ``hex_`` names."""
    return _VERSION + bytes.fromhex(hex_)


def _value(hex_: str, xxh3: bytes) -> bytes:
    """The record's bytes: its version, the sha256 ``hex_`` names, the xxh3-128 digest."""
    return head(hex_) + xxh3


def make(hex_: str, data: bytes) -> bytes | None:
    """The record of ``data``, verified a moment ago to hash to sha256 ``hex_``; None without xxhash."""
    digest = xxh3_128()
    return None if digest is None else _value(hex_, digest(data))


def matches(record: bytes, hex_: str, data: bytes) -> bool:
    """Whether ``record`` names sha256 ``hex_`` and the xxh3-128 of ``data`` (size is the caller's check)."""
    digest = _xxh3 or xxh3_128()  # the imported function, without a call once it is (every first load)
    return digest is not None and record == _value(hex_, digest(data))


def write(fd: int, record: bytes | None) -> bool:
    """Attach ``record`` to the open file ``fd``; False where the filesystem or permissions allow no record."""
    if record is None:
        return False
    try:
        os.setxattr(fd, NAME, record)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


class Recorder:
    """A writable file that hashes what passes through it, for an entry streamed into a staged temp
    file (``new_staged``): ``close()`` attaches the record. The caller verifies the bytes by sha256
    before ``commit_staged`` moves the file into the CAS; a file that fails is dropped, record and all.
    """

    def __init__(self, file: Any, hex_: str) -> None:
        self._file = file
        self._hex = hex_
        self._hasher = None
        if xxh3_128() is not None:
            import xxhash

            self._hasher = xxhash.xxh3_128()

    def write(self, data: bytes) -> int:
        if self._hasher is not None:
            self._hasher.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        if not self._file.closed and self._hasher is not None:
            self._file.flush()
            write(self._file.fileno(), _value(self._hex, self._hasher.digest()))
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
