"""The interface every store layer implements (memory, local directory, disk cache, HTTP, ...)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from cubinstore._core.digest import Digest
from cubinstore.errors import StoreError

__all__ = ["Layer", "UNSIZED_LIMIT", "limit_for"]

#: Most bytes read for a blob of unknown size (manifests by digest); callers that know a
#: blob's size (every KernelSpec does) pass it and get exactly that bound instead.
UNSIZED_LIMIT = 64 * 1024 * 1024


def limit_for(size: int | None) -> int:
    return UNSIZED_LIMIT if size is None else size


class Layer:
    """One place bytes may come from. ``Store`` verifies whatever ``read`` returns.

    ``read`` returns the candidate bytes (at most ``limit_for(size) + 1`` of them) or None for a
    clean miss, and raises a ``CubinstoreError`` when it cannot tell (server down,
    I/O error). Layers never need to trust their own bytes: the store hashes them.
    """

    #: A hit here is a store hit (in-process memory, the local store); others are fetches.
    cache: bool = False
    #: Bytes here were verified when stored and live in this process: skip re-hashing.
    trusted: bool = False
    #: ``write`` is supported; the store back-fills writable layers in front of a hit.
    writable: bool = False
    #: ``lock`` returns a cross-process lock; the store holds it while filling this layer.
    lockable: bool = False
    #: Bytes come over the network (a remote cache): a miss with none configured says how to add one.
    remote: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        raise NotImplementedError

    def write(self, digest: Digest, data: bytes) -> None:
        raise StoreError(f"{self.name} is read only; cannot store {digest}")

    def write_verified(self, digest: Digest, data: bytes) -> None:
        """``write`` of an immutable ``bytes`` object the Store has just verified (a layer may skip re-hashing)."""
        self.write(digest, data)

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        """Called after bytes from ``read`` failed verification (quarantine, drop, or just log)."""

    def lock(self, digest: Digest) -> AbstractContextManager[None] | None:
        """A cross-process lock for filling ``digest`` into this layer (when ``lockable``), else None."""
        return None

    def __repr__(self) -> str:
        return f"<{self.name}>"
