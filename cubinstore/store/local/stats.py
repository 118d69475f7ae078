"""The local store's persistent counters (``v1/stats.json``, for ``cubinstore stats``): hits,
misses, bytes fetched and verification failures.

A hit must not pay a lock and a file rewrite (that was most of a verified load), so counts
gather in memory per store root and are added to stats.json under its lock in batches (every
FLUSH_EVENTS counts or FLUSH_SECONDS), when read, and at exit. Each flush is a locked
read-add-write, so concurrent processes never lose each other's counts.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cubinstore._core.abi import loads_strict
from cubinstore._core.log import get_logger
from cubinstore.errors import StoreError
from cubinstore.store.local.lock import Clock
from cubinstore.store.local.root import NotRegularFile

__all__ = ["FLUSH_EVENTS", "FLUSH_SECONDS", "MAX_STATS_FILE", "STAT_KEYS", "Counters"]

_log = get_logger(__name__)

# ptx_loads: kernels loaded as PTX (the driver JIT-compiled them: no CUBIN of their point ran on the device).
STAT_KEYS = ("hits", "misses", "bytes_fetched", "verification_failures", "ptx_loads")
FLUSH_EVENTS = 1024
FLUSH_SECONDS = 10.0
# stats.json holds five counters (about 100 bytes): a longer one is not ours, and is ignored.
MAX_STATS_FILE = 1 << 16


class Counters:
    """The counter methods of ``Counters`` (a mixin over its file API)."""

    root: Path
    stats_path: Path
    _stats_key: str  # str(root): the pending counts' key (a Path hashes and compares in Python, a str in C)
    # A flush is due after this many counts, or FLUSH_SECONDS by this clock's ``monotonic``
    # (``LocalLayer``'s ``flush_events`` and ``clock``; the first store of a root in a process sets its root's).
    _flush_events: int = FLUSH_EVENTS
    _clock: Clock = time

    if TYPE_CHECKING:  # provided by Counters
        def read_file(self, parts: tuple[str, ...], name: str, limit: int, *, touch: bool = False) -> bytes | None: ...

        def write_file(self, parts: tuple[str, ...], name: str, data: bytes, *, durable: bool = True) -> None: ...

        def file_lock(self, parts: tuple[str, ...], name: str, timeout: float | None = None,
                      what: str = "") -> AbstractContextManager[None]: ...

    def read_stats(self) -> dict[str, int]:
        """The persistent counters, this process's pending counts included."""
        self.flush_stats()
        return self._read_stats_file()

    def _read_stats_file(self) -> dict[str, int]:
        """stats.json's counts; an unreadable, oversized or malformed file (another user of a shared
        store can write one) is logged and counts as zero, so the next flush starts it over."""
        counts = dict.fromkeys(STAT_KEYS, 0)
        try:
            data = self.read_file((), "stats.json", MAX_STATS_FILE)
        except (NotRegularFile, StoreError) as exc:
            _log.warning("ignoring unreadable stats file %s: %s", self.stats_path, exc)
            return counts
        if data is None:
            return counts
        if len(data) > MAX_STATS_FILE:  # read_file stops one byte past the limit: the rest is unread
            _log.warning("ignoring stats file %s: expected at most %d bytes, got more",
                         self.stats_path, MAX_STATS_FILE)
            return counts
        try:
            loaded = loads_strict(data, str(self.stats_path), StoreError)
        except StoreError as exc:
            _log.warning("ignoring malformed stats file %s", exc)
            return counts
        if isinstance(loaded, dict):
            for key in STAT_KEYS:
                value = loaded.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    counts[key] = value
        return counts

    def add_stats(self, delta: Mapping[str, int]) -> None:
        """Add to the counters: in memory now, in stats.json with the next flush. Never fails."""
        if not any(delta.values()):
            return
        if _pending.add(self, delta):
            self.flush_stats()

    def add_hit(self) -> None:
        """``add_stats({"hits": 1})``, the hot path's count: no mapping to walk."""
        if _pending.add_hit(self):
            self.flush_stats()

    def flush_stats(self) -> None:
        """Add this process's pending counts to stats.json. Best effort: counting must never make a load fail."""
        delta = _pending.take(self._stats_key)
        if delta is None:
            return
        try:
            with self.file_lock((), "stats.lock", 5.0, what="stats"):
                counts = self._read_stats_file()
                for key, value in delta.items():
                    counts[key] = counts.get(key, 0) + value
                self.write_file((), "stats.json", json.dumps(counts, sort_keys=True).encode() + b"\n", durable=False)
        except StoreError as exc:
            _log.warning("cannot update stats in %s: %s", self.stats_path, exc)
            _pending.put_back(self, delta)


class _PendingStats:
    """Counts of this process not yet in a store's stats.json, per store root."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # root (its str: hashed in C) -> (the store, its counts, [start, counts since, its flush_events,
        # its clock's monotonic])
        self._by_root: dict[str, tuple[Counters, dict[str, int], list[Any]]] = {}
        self._registered = False

    def add(self, local: Counters, delta: Mapping[str, int]) -> bool:
        """Record ``delta``; True when the root's batch is due for a flush."""
        root = local._stats_key
        with self._lock:
            item = self._by_root.get(root)
            if item is None:
                item = self._by_root[root] = (local, dict.fromkeys(STAT_KEYS, 0), _batch(local))
                if not self._registered:
                    atexit.register(self.flush_all)
                    self._registered = True
            counts, batch = item[1], item[2]
            for key, value in delta.items():
                counts[key] = counts.get(key, 0) + value
            batch[1] += 1
            return batch[1] >= batch[2] or batch[3]() - batch[0] >= FLUSH_SECONDS

    def add_hit(self, local: Counters) -> bool:
        """``add(local, {"hits": 1})``: one increment where the root already has pending counts."""
        with self._lock:
            item = self._by_root.get(local._stats_key)
            if item is not None:
                item[1]["hits"] += 1
                batch = item[2]
                batch[1] += 1
                return batch[1] >= batch[2] or batch[3]() - batch[0] >= FLUSH_SECONDS
        return self.add(local, {"hits": 1})

    def take(self, root: str) -> dict[str, int] | None:
        with self._lock:
            item = self._by_root.pop(root, None)
        return None if item is None or not any(item[1].values()) else item[1]

    def put_back(self, local: Counters, delta: dict[str, int]) -> None:
        root = local._stats_key
        with self._lock:
            item = self._by_root.get(root)
            if item is None:
                self._by_root[root] = (local, dict(delta), _batch(local))
            else:
                for key, value in delta.items():
                    item[1][key] = item[1].get(key, 0) + value

    def flush_all(self) -> None:
        with self._lock:
            stores = [item[0] for item in self._by_root.values()]
        for local in stores:
            local.flush_stats()

    def forget(self) -> None:
        """In a forked child: the parent flushes its own counts."""
        self._lock = threading.Lock()
        self._by_root = {}


def _batch(local: Counters) -> list[Any]:
    """A root's new batch: started now, no counts yet, due by ``local``'s settings."""
    monotonic = local._clock.monotonic
    return [monotonic(), 0, local._flush_events, monotonic]


_pending = _PendingStats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pending.forget)
