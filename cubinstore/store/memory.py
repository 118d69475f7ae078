"""The in-process memory layer: verified bytes, least recently used evicted past a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict

from cubinstore._core.digest import Digest
from cubinstore.store.layer import Layer

__all__ = ["MemoryLayer"]


class MemoryLayer(Layer):
    """Holds only bytes the store has verified; they are immutable ``bytes``, so no re-hash."""

    cache = True
    trusted = True
    writable = True

    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Digest, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "memory"

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        with self._lock:
            data = self._items.get(digest)
            if data is not None:
                self._items.move_to_end(digest)
            return data

    def write(self, digest: Digest, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self._bytes -= len(old)
            self._items[digest] = bytes(data)
            self._bytes += len(data)
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= len(evicted)

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._items)
