"""Blobs the store tests make: random bytes with their digest, and a Bazel --disk_cache holding some."""

from __future__ import annotations

import random
from pathlib import Path

from cubinstore import Digest
from cubinstore.store import DiskCacheLayer


def random_blob(n: int, seed: int | None = 0) -> tuple[Digest, bytes]:
    data = random.Random(seed).randbytes(n)
    return Digest.of(data), data


def disk_cache_with(root: Path, blobs: list[tuple[Digest, bytes]]) -> DiskCacheLayer:
    """A real Bazel --disk_cache directory (layout `cas/<2 hex>/<hex>`) holding `blobs`."""
    for digest, data in blobs:
        path = root / "cas" / digest.hex[:2] / digest.hex
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return DiskCacheLayer(root)
