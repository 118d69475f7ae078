"""Read-only sources: a Bazel ``--disk_cache`` directory and a build output tree (``bazel-bin``)."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

from cubinstore._core.digest import Digest
from cubinstore.store.local.files import NotRegularFile, read_regular
from cubinstore.store.layer import Layer, limit_for
from cubinstore._core.log import get_logger

__all__ = ["BUILD_TREE_SUFFIXES", "DirectorySource", "DiskCacheLayer"]

_log = get_logger(__name__)

#: What a release's closure is made of in a build tree: CUBINs (``cuda_cubin``), PTX (``cuda_ptx``)
#: and the source bundles of family JIT templates (``cubin_jit_template`` writes
#: ``<name>.sources.json``). An allow-list: nothing else in the tree is ever statted, read or hashed.
BUILD_TREE_SUFFIXES: tuple[str, ...] = (".cubin", ".ptx", ".sources.json")


class DiskCacheLayer(Layer):
    """Read-only view of a Bazel ``--disk_cache``: ``cas/<2 hex>/<hex>`` (Bazel >= 4) or flat ``cas/<hex>``.

    Bazel owns this directory: a corrupt entry is reported and skipped, never modified.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    @property
    def name(self) -> str:
        return f"disk cache {self.root}"

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        limit = limit_for(size)
        for path in (self.root / "cas" / digest.hex[:2] / digest.hex, self.root / "cas" / digest.hex):
            try:
                data = read_regular(path, limit)
            except NotRegularFile as exc:
                _log.warning("ignoring %s: %s", path, exc)
                continue
            if data is not None:
                return data
        return None

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        _log.warning("corrupt blob %s in Bazel disk cache %s (left in place): %s", digest, self.root, reason)


class DirectorySource(Layer):
    """Finds blobs by content among the files of a build tree such as ``bazel-bin`` whose names
    end in ``suffix`` (one suffix or several; by default ``BUILD_TREE_SUFFIXES``, every kind of
    blob a release's closure holds).

    Files are indexed by size on first use and hashed only when their size matches the
    blob asked for, so no label or path naming convention is assumed.
    """

    def __init__(self, root: str | Path, *, suffix: str | tuple[str, ...] = BUILD_TREE_SUFFIXES) -> None:
        self.root = Path(root).expanduser()
        self.suffix = suffix
        self._by_size: dict[int, list[Path]] | None = None
        self._found: dict[Digest, Path] = {}  # what each file hashed to (the first file of each digest)
        self._hashed: set[Path] = set()
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"build tree {self.root}"

    def _index(self) -> dict[int, list[Path]]:
        with self._lock:
            if self._by_size is None:
                by_size: dict[int, list[Path]] = {}
                # The root itself may be a symlink (bazel-bin is); nothing below it is followed.
                for dirpath, _dirs, files in os.walk(self.root.resolve()):
                    for file in files:
                        if not file.endswith(self.suffix):
                            continue
                        path = Path(dirpath, file)
                        try:
                            st = path.lstat()
                        except OSError:
                            continue
                        if stat.S_ISREG(st.st_mode):
                            by_size.setdefault(st.st_size, []).append(path)
                self._by_size = by_size
                _log.debug("indexed %d %s files under %s", sum(map(len, by_size.values())),
                           "/".join((self.suffix,) if isinstance(self.suffix, str) else self.suffix), self.root)
            return self._by_size

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        return self._find(digest, size, limit_for(size))

    def read_capped(self, digest: Digest, limit: int) -> bytes | None:
        """A small document (a signature, a record) of at most ``limit`` bytes: no larger file of
        the tree is read or hashed."""
        return self._find(digest, None, limit)

    def _find(self, digest: Digest, size: int | None, limit: int) -> bytes | None:
        """The file of ``size`` bytes (None: any size up to ``limit``) that hashes to ``digest``."""
        data = self._known(digest, limit)
        if data is not None:
            return data
        index = self._index()
        if size is not None:
            candidates = index.get(size, ())
        else:
            candidates = [path for file_size in sorted(index) if file_size <= limit for path in index[file_size]]
        # Each file is hashed at most once, and what it hashed to remembered: a release of many
        # same-size blobs costs one hash a file, not one a file per blob asked for. One scan at a
        # time (publish and prefetch read from many threads): a file another thread is hashing
        # would otherwise be skipped here before its digest is remembered.
        with self._scan_lock:
            data = self._known(digest, limit)  # found by another thread's scan meanwhile
            if data is not None:
                return data
            for path in candidates:
                if path in self._hashed:
                    continue
                data = self._read(path, limit)
                self._hashed.add(path)
                if data is None:
                    continue
                hex_ = hashlib.sha256(data).hexdigest()
                self._found.setdefault(Digest(hex_), path)
                if hex_ == digest.hex:
                    return data
        return None

    def _known(self, digest: Digest, limit: int) -> bytes | None:
        """The bytes of the file a scan found ``digest`` in, if it still hashes to it."""
        path = self._found.get(digest)
        if path is None:
            return None
        data = self._read(path, limit)
        return data if data is not None and hashlib.sha256(data).hexdigest() == digest.hex else None

    @staticmethod
    def _read(path: Path, limit: int) -> bytes | None:
        try:
            return read_regular(path, limit)
        except NotRegularFile:
            return None
