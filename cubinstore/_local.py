"""The local directory store: ``<root>/v1/cas/<first two hex>/<hex>``, one immutable file per blob."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from cubinstore import _env
from cubinstore._digest import Digest
from cubinstore._files import NotRegularFile, atomic_write, read_regular, verify
from cubinstore._layer import Layer, limit_for
from cubinstore._lock import file_lock
from cubinstore.errors import CubinstoreError, StoreError

__all__ = ["Entry", "LocalStore", "STAT_KEYS"]

_log = logging.getLogger(__name__)

_HEX_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_SHARD_RE = re.compile(r"[0-9a-f]{2}", re.ASCII)
_TEMP_PREFIX = ".tmp."
MAX_BLOB_SIZE = 1024 * 1024 * 1024  # same bound as the manifest's
STAT_KEYS = ("hits", "misses", "bytes_fetched", "verification_failures")


@dataclass(frozen=True)
class Entry:
    """A file at a final CAS path (not yet verified)."""

    digest: Digest
    path: Path
    size: int
    mtime: float


class LocalStore(Layer):
    """The embedded default store: a directory, no server.

    Entries are written atomically and re-verified on every read; a corrupt entry is
    moved to ``v1/quarantine`` so the next read refetches it.
    """

    cache = True
    writable = True
    lockable = True

    def __init__(self, root: str | Path, *, lock_timeout: float | None = None) -> None:
        self.root = Path(root).expanduser()
        self.v1 = self.root / "v1"
        self.cas_dir = self.v1 / "cas"
        self.quarantine_dir = self.v1 / "quarantine"
        self.lock_dir = self.v1 / "locks"
        self.pins_dir = self.v1 / "pins"
        self.stats_path = self.v1 / "stats.json"
        self.lock_timeout = _env.lock_timeout() if lock_timeout is None else lock_timeout

    @property
    def name(self) -> str:
        return f"local store {self.root}"

    def path_for(self, digest: Digest) -> Path:
        return self.cas_dir / digest.hex[:2] / digest.hex

    # -- Layer ----------------------------------------------------------------------------------

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        path = self.path_for(digest)
        try:
            return read_regular(path, limit_for(size), touch=True)
        except NotRegularFile as exc:
            # Never follow a planted symlink; the next write replaces the link itself.
            _log.warning("ignoring %s: %s", path, exc)
            return None

    def write(self, digest: Digest, data: bytes) -> None:
        """Store verified bytes; re-hashes so nothing unverified can ever land at a final path."""
        verify(data, digest, None, where="the caller of LocalStore.write")
        atomic_write(self.path_for(digest), data)
        _log.debug("stored %s (%d bytes) in %s", digest, len(data), self.root)

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        path = self.path_for(digest)
        # Re-check by hash alone before moving anything: another process may already have
        # replaced the bad file, or the caller asked with a wrong size for a good entry.
        try:
            current = read_regular(path, MAX_BLOB_SIZE)
        except (NotRegularFile, StoreError):
            current = None
        if current is not None:
            try:
                verify(current, digest, None, where=self.name)
                _log.warning("kept %s in %s: it verifies by hash; the request was wrong (%s)", digest, self.root, reason)
                return
            except CubinstoreError:
                pass
        moved = self.quarantine(path)
        if moved is not None:
            _log.warning("quarantined corrupt entry %s to %s: %s", digest, moved, reason)

    def lock(self, digest: Digest) -> AbstractContextManager[None]:
        return file_lock(self.lock_dir / digest.hex[:2] / f"{digest.hex}.lock", self.lock_timeout, what=str(digest))

    # -- inspection and maintenance -------------------------------------------------------------

    def quarantine(self, path: Path) -> Path | None:
        """Move ``path`` out of the CAS (kept for forensics); None if it had already gone."""
        target = self.quarantine_dir / f"{path.name}.{time.time_ns()}.{os.getpid()}"
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot quarantine {path} to {target}: {exc.strerror or exc}") from exc
        return target

    def status(self, digest: Digest, size: int | None) -> str:
        """``"ok"``, ``"missing"`` or ``"corrupt"`` for one entry, changing nothing (for ``ls``)."""
        limit = limit_for(size)
        try:
            data = read_regular(self.path_for(digest), limit)
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
        try:
            shards = sorted(os.scandir(self.cas_dir), key=lambda e: e.name)
        except FileNotFoundError:
            return entries, strays
        except OSError as exc:
            raise StoreError(f"cannot list {self.cas_dir}: {exc.strerror or exc}") from exc
        for shard in shards:
            if not (_SHARD_RE.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False)):
                strays.append(Path(shard.path))
                continue
            for item in sorted(os.scandir(shard.path), key=lambda e: e.name):
                path = Path(item.path)
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed by a concurrent gc or quarantine
                    continue
                if (
                    _HEX_RE.fullmatch(item.name)
                    and item.name[:2] == shard.name
                    and stat.S_ISREG(st.st_mode)
                ):
                    entries.append(Entry(Digest(item.name), path, st.st_size, st.st_mtime))
                else:
                    strays.append(path)
        return entries, strays

    def clean_temps(self, older_than: float = 3600.0) -> list[Path]:
        """Remove temp files left by killed writers (only old ones: a live writer may own a new one)."""
        removed: list[Path] = []
        cutoff = time.time() - older_than
        _, strays = self.scan()
        for path in strays:
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if path.name.startswith(_TEMP_PREFIX) and stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path)
                _log.info("removed stale temp file %s", path)
        return removed

    def remove(self, digest: Digest) -> bool:
        try:
            self.path_for(digest).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot remove {self.path_for(digest)}: {exc.strerror or exc}") from exc
        return True

    # -- persistent counters (for `cubinstore stats`) -------------------------------------------

    def read_stats(self) -> dict[str, int]:
        counts = dict.fromkeys(STAT_KEYS, 0)
        try:
            data = read_regular(self.stats_path, 1 << 16)
        except (NotRegularFile, StoreError) as exc:
            _log.warning("ignoring unreadable stats file %s: %s", self.stats_path, exc)
            return counts
        if data is None:
            return counts
        try:
            loaded = json.loads(data)
        except ValueError:
            _log.warning("ignoring malformed stats file %s", self.stats_path)
            return counts
        if isinstance(loaded, dict):
            for key in STAT_KEYS:
                value = loaded.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    counts[key] = value
        return counts

    def add_stats(self, delta: dict[str, int]) -> None:
        """Add to the persistent counters. Best effort: counting must never make a load fail."""
        if not any(delta.values()):
            return
        try:
            with file_lock(self.v1 / "stats.lock", 5.0, what="stats"):
                counts = self.read_stats()
                for key, value in delta.items():
                    counts[key] = counts.get(key, 0) + value
                atomic_write(self.stats_path, json.dumps(counts, sort_keys=True).encode() + b"\n", durable=False)
        except StoreError as exc:
            _log.warning("cannot update stats in %s: %s", self.stats_path, exc)

    def iter_digests(self) -> Iterator[Digest]:
        entries, _ = self.scan()
        return (e.digest for e in entries)
