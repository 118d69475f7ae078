"""The JIT index under ``<store>/v1/jit/``: key -> CUBIN digest, plus each key's parts for ``explain``.

    v1/jit/index/<2 hex>/<key>.json   {"schema", "key", "digest", "size", "arch", "kernels"}: written
                                      last, after the CUBIN is in the CAS, so an entry never names a
                                      missing blob and a killed compile leaves none
    v1/jit/parts/<2 hex>/<key>.json   the key's parts, written before compiling (so a failed or
                                      killed compile can still be explained)
    v1/jit/trees/<2 hex>/<key>.json   include-tree and toolkit listings (content-addressed)
    v1/jit/stat/                      stat fingerprints of trees (a local speed-up, never keyed)
    v1/jit/locks/<2 hex>/<key>.lock   one compile per key across processes
    v1/jit/tmp/<key>.<pid>.<n>/       private compile directories

Every file is written atomically (``_files.atomic_write``); every read is bounded and
validated, and a damaged entry reads as absent (a miss recompiles and rewrites it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cubinstore._abi import dumps_canonical
from cubinstore._digest import Digest
from cubinstore._files import atomic_write, read_regular
from cubinstore._jitkey import KeyParts
from cubinstore._lock import file_lock
from cubinstore.errors import BadArgumentError, CubinstoreError

__all__ = ["IndexEntry", "JitIndex"]

_log = logging.getLogger(__name__)

SCHEMA: Final = "cubinstore/jit-index/v1"
PARTS_SCHEMA: Final = "cubinstore/jit-parts/v1"
_KEY_RE: Final = re.compile(r"[0-9a-f]{32}", re.ASCII)
_MAX_ENTRY: Final = 1 << 20


def check_key(key: object) -> str:
    """A key as 32 lowercase hex (``xxh3:`` prefix allowed); ``BadArgumentError`` before any path is built."""
    text = key.removeprefix("xxh3:") if isinstance(key, str) else key
    if not isinstance(text, str) or not _KEY_RE.fullmatch(text):
        raise BadArgumentError(f"invalid JIT key {key!r}: expected 'xxh3:<32 lowercase hex>'")
    return text


@dataclass(frozen=True)
class IndexEntry:
    key: str
    digest: Digest
    size: int
    arch: str
    kernels: tuple[str, ...]  # the CUBIN's __global__ symbols

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "key": self.key, "digest": str(self.digest), "size": self.size,
                "arch": self.arch, "kernels": list(self.kernels)}


class JitIndex:
    """The JIT directories of one local store root."""

    def __init__(self, root: Path, lock_timeout: float) -> None:
        self.dir = Path(root) / "v1" / "jit"
        self.lock_timeout = lock_timeout

    def _shard(self, kind: str, key: str, suffix: str = ".json") -> Path:
        return self.dir / kind / key[:2] / f"{key}{suffix}"

    # -- entries --------------------------------------------------------------------------------

    def get(self, key: str) -> IndexEntry | None:
        path = self._shard("index", check_key(key))
        try:
            raw = read_regular(path, _MAX_ENTRY)
        except Exception as exc:  # noqa: BLE001 - unreadable reads as absent; the compile rewrites it
            _log.warning("ignoring unreadable JIT index entry %s: %s", path, exc)
            return None
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            if doc.get("schema") != SCHEMA or doc.get("key") != key:
                raise ValueError(f"schema {doc.get('schema')!r}, key {doc.get('key')!r}")
            size = doc["size"]
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"size {size!r}")
            kernels = doc["kernels"]
            if not isinstance(kernels, list) or not all(isinstance(k, str) for k in kernels):
                raise ValueError("kernels")
            return IndexEntry(key, Digest.parse(doc["digest"]), size, str(doc["arch"]), tuple(kernels))
        except (ValueError, KeyError, TypeError, AttributeError, CubinstoreError) as exc:
            _log.warning("ignoring malformed JIT index entry %s: %s", path, exc)
            return None

    def put(self, entry: IndexEntry) -> None:
        atomic_write(self._shard("index", check_key(entry.key)), dumps_canonical(entry.to_json()))

    def entries(self) -> Iterator[IndexEntry]:
        for key in self._keys("index"):
            entry = self.get(key)
            if entry is not None:
                yield entry

    def _keys(self, kind: str) -> Iterator[str]:
        base = self.dir / kind
        try:
            shards = sorted(os.listdir(base))
        except FileNotFoundError:
            return
        for shard in shards:
            try:
                names = sorted(os.listdir(base / shard))
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                key = name.removesuffix(".json")
                if name.endswith(".json") and _KEY_RE.fullmatch(key) and key[:2] == shard:
                    yield key

    # -- parts ----------------------------------------------------------------------------------

    def put_parts(self, key: str, parts: KeyParts) -> None:
        path = self._shard("parts", check_key(key))
        if not path.exists():
            atomic_write(path, dumps_canonical({"schema": PARTS_SCHEMA, "key": key, "parts": parts.to_json()}),
                         durable=False)

    def get_parts(self, key: str) -> KeyParts | None:
        path = self._shard("parts", check_key(key))
        try:
            raw = read_regular(path, _MAX_ENTRY)
            if raw is None:
                return None
            doc = json.loads(raw)
            if doc.get("schema") != PARTS_SCHEMA or doc.get("key") != key:
                raise ValueError("schema or key")
            return KeyParts.from_json(doc["parts"])
        except Exception as exc:  # noqa: BLE001 - explain says "parts not kept"
            _log.warning("ignoring malformed JIT parts %s: %s", path, exc)
            return None

    def parts_keys(self) -> Iterator[str]:
        return self._keys("parts")

    # -- single flight and compile directories --------------------------------------------------

    def lock(self, key: str) -> AbstractContextManager[None]:
        key = check_key(key)
        return file_lock(self._shard("locks", key, ".lock"), self.lock_timeout, what=f"JIT key xxh3:{key}")

    def compile_dir(self, key: str, attempt: int) -> Path:
        """A fresh private directory for one compile of ``key``; call with the key's lock held."""
        tmp = self.dir / "tmp"
        # Holding the lock, any directory of this key is a leftover of a killed compile.
        for stale in tmp.glob(f"{key}.*"):
            _log.info("removing the compile directory of a killed compile: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self._shard("index", key).parent.glob(f".tmp.{key}.json.*"):
            _log.info("removing the temp file of a killed index write: %s", stale)
            stale.unlink(missing_ok=True)
        path = tmp / f"{key}.{os.getpid()}.{attempt}"
        path.mkdir(parents=True, mode=0o700)
        return path


def describe(entry: IndexEntry | None) -> Mapping[str, Any] | None:
    return None if entry is None else entry.to_json()
