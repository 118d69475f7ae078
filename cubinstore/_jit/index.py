"""The JIT index under ``<store>/v1/jit/``: key -> CUBIN digest, plus each key's parts for ``explain``.

    v1/jit/index/<2 hex>/<key>.json   {"schema", "key", "digest", "size", "arch", "kernels", "parts"}:
                                      written last, after the CUBIN is in the CAS, so an entry never
                                      names a missing blob and a killed compile leaves none. A claim,
                                      re-checked on every use (``jit``): its key and parts make the
                                      file's key, the CUBIN verifies and has its arch and kernels;
                                      a mismatch is removed (quarantined) and compiled again. A v1
                                      entry (no "parts") is checked against its parts file.
    v1/jit/parts/<2 hex>/<key>.json   the key's parts, written before compiling (so a failed or
                                      killed compile can still be explained)
    v1/jit/outside/<2 hex>/<key>.json base key -> the keys compiled under it whose compile read
                                      files outside every root (``KeyParts.outside``: path and
                                      content), newest first. A compile keys what it reads: the key a
                                      call computes first (the base) covers the roots; such a
                                      compile is stored under the key of its base parts plus those
                                      files, and a later call takes it only while each still has its
                                      recorded content (else: a miss, compiled under another key)
    v1/jit/trees/<2 hex>/<key>.json   include-tree and toolkit listings (content-addressed)
    v1/jit/deps/<2 hex>/<key>.json    the files a key's compile included (root label, relative path,
                                      xxh3) and the shape of each root: what a direct hit checks
    v1/jit/direct/<2 hex>/<dkey>.json direct key -> the keys compiled under it, newest first
    v1/jit/output/<2 hex>/<key>.json  nvcc's stdout and stderr when it compiled the key (the compile
                                      directory's names): what ``cubinstore-nvcc`` replays
    v1/jit/stat/                      stat fingerprints of trees (a local speed-up, never keyed)
    v1/jit/locks/<2 hex>/<key>.lock   one compile per key across processes
    v1/jit/tmp/<key>.<pid>.<n>/       private compile directories

Every file goes through the local store's descriptor-based API (atomic writes, no link
inside the store followed, the same permission rules as the CAS); every read is bounded and
validated, and a damaged entry reads as absent (a miss recompiles and rewrites it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from cubinstore._core.abi import dumps_canonical, loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore._jit.inputs import dep_rel_ok
from cubinstore._jit.key import KeyParts
from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError, CubinstoreError, StoreError

if TYPE_CHECKING:
    from cubinstore.store.local.cas import LocalLayer

__all__ = ["IndexEntry", "JitIndex"]

_log = get_logger(__name__)

SCHEMA: Final = "cubinstore/jit-index/v2"
SCHEMA_V1: Final = "cubinstore/jit-index/v1"  # no parts inside: checked against the parts file
OUTSIDE_SCHEMA: Final = "cubinstore/jit-outside/v1"
PARTS_SCHEMA: Final = "cubinstore/jit-parts/v1"
DEPS_SCHEMA: Final = "cubinstore/jit-deps/v1"
DIRECT_SCHEMA: Final = "cubinstore/jit-direct/v1"
OUTPUT_SCHEMA: Final = "cubinstore/jit-output/v1"
_MAX_OUTPUT: Final = 4 << 20
MAX_CANDIDATES: Final = 8  # keys kept per direct key (the same TU against differing included headers)
_KEY_RE: Final = re.compile(r"[0-9a-f]{32}", re.ASCII)
_MAX_ENTRY: Final = 1 << 20
_STALE_S: Final = 24 * 3600  # no compile runs this long


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
    parts: KeyParts | None = None  # what the key was made of (None: a v1 entry whose parts file is gone)

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": SCHEMA, "key": self.key, "digest": str(self.digest), "size": self.size,
               "arch": self.arch, "kernels": list(self.kernels)}
        if self.parts is not None:
            doc["parts"] = self.parts.to_json()
        return doc


class JitIndex:
    """The JIT files of one local store."""

    def __init__(self, local: LocalLayer, lock_timeout: float | None = None) -> None:
        self.local = local
        self.dir = Path(local.root) / "v1" / "jit"  # for messages; files go through ``local``
        self.lock_timeout = lock_timeout

    @staticmethod
    def _at(kind: str, key: str, suffix: str = ".json") -> tuple[tuple[str, ...], str]:
        return ("jit", kind, key[:2]), f"{key}{suffix}"

    def _read(self, kind: str, key: str, limit: int = _MAX_ENTRY) -> bytes | None:
        try:
            return self.local.read_file(*self._at(kind, check_key(key)), limit)
        except BadArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - unreadable reads as absent; a compile rewrites it
            _log.warning("ignoring unreadable JIT %s entry %s: %s", kind, key, exc)
            return None

    # -- entries --------------------------------------------------------------------------------

    def get(self, key: str) -> IndexEntry | None:
        raw = self._read("index", key)
        if raw is None:
            return None
        try:
            doc = loads_strict(raw, f"JIT index entry {key}", ValueError)
            if not isinstance(doc, dict) or doc.get("schema") not in (SCHEMA, SCHEMA_V1) or doc.get("key") != key:
                raise ValueError(f"schema {doc.get('schema')!r}, key {doc.get('key')!r}" if isinstance(doc, dict) else "not an object")
            size = doc["size"]
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"size {size!r}")
            kernels = doc["kernels"]
            if not isinstance(kernels, list) or not all(isinstance(k, str) for k in kernels):
                raise ValueError("kernels")
            if not isinstance(doc["arch"], str):
                raise ValueError(f"arch {doc['arch']!r}")
            parts = KeyParts.from_json(doc["parts"]) if doc["schema"] == SCHEMA else self.get_parts(key)
            return IndexEntry(key, Digest.parse(doc["digest"]), size, doc["arch"], tuple(kernels), parts)
        except (ValueError, KeyError, TypeError, AttributeError, CubinstoreError) as exc:
            _log.warning("ignoring malformed JIT index entry %s: %s", key, exc)
            return None

    def remove(self, key: str) -> bool:
        """Drop ``key``'s entry (it named a CUBIN that is not what it claims); False if absent."""
        return self.local.remove_file(*self._at("index", check_key(key)))

    def put(self, entry: IndexEntry) -> None:
        self.local.write_file(*self._at("index", check_key(entry.key)), dumps_canonical(entry.to_json()))

    def entries(self) -> Iterator[IndexEntry]:
        for key in self._keys("index"):
            entry = self.get(key)
            if entry is not None:
                yield entry

    def _keys(self, kind: str) -> Iterator[str]:
        for shard, st in self.local.list_dir(("jit", kind)):
            if len(shard) != 2 or not stat.S_ISDIR(st.st_mode):
                continue
            for name, fst in self.local.list_dir(("jit", kind, shard)):
                key = name.removesuffix(".json")
                if name.endswith(".json") and _KEY_RE.fullmatch(key) and key[:2] == shard and stat.S_ISREG(fst.st_mode):
                    yield key

    # -- parts ----------------------------------------------------------------------------------

    def put_parts(self, key: str, parts: KeyParts) -> None:
        data = dumps_canonical({"schema": PARTS_SCHEMA, "key": key, "parts": parts.to_json()})
        self.local.write_file(*self._at("parts", check_key(key)), data, durable=False)

    def get_parts(self, key: str) -> KeyParts | None:
        raw = self._read("parts", key)
        if raw is None:
            return None
        try:
            doc = loads_strict(raw, f"JIT parts {key}", ValueError)
            if doc.get("schema") != PARTS_SCHEMA or doc.get("key") != key:
                raise ValueError("schema or key")
            return KeyParts.from_json(doc["parts"])
        except Exception as exc:  # noqa: BLE001 - explain says "parts not kept"
            _log.warning("ignoring malformed JIT parts %s: %s", key, exc)
            return None

    def parts_keys(self) -> Iterator[str]:
        return self._keys("parts")

    # -- the direct path ------------------------------------------------------------------------

    def put_deps(self, key: str, files: list[tuple[str, str, str]], shapes: Mapping[str, str]) -> None:
        doc = {"schema": DEPS_SCHEMA, "key": key, "files": [list(f) for f in files], "shapes": dict(shapes)}
        self.local.write_file(*self._at("deps", check_key(key)), dumps_canonical(doc), durable=False)

    def get_deps(self, key: str) -> tuple[list[tuple[str, str, str]], dict[str, str]] | None:
        """(files, shapes) recorded for ``key``; None when absent or damaged (the direct path then
        falls back to the full key).

        Each file's path is nvcc's spelling below its root (``inputs.dep_rel_ok``): one that is
        not (absolute, climbing out, odd characters) is no writer's and is a ``StoreError``
        naming the deps file and the path, before anything opens it (callers that use the list
        as a cache take that as a miss)."""
        raw = self._read("deps", key)
        if raw is None:
            return None
        try:
            doc = loads_strict(raw, f"JIT deps {key}", ValueError)
            if doc.get("schema") != DEPS_SCHEMA or doc.get("key") != key:
                raise ValueError("schema or key")
            files = [(str(a), b, str(c)) for a, b, c in doc["files"]]
            shapes = doc["shapes"]
            if not isinstance(shapes, dict) or not all(isinstance(v, str) for v in shapes.values()):
                raise ValueError("shapes")
        except Exception as exc:  # noqa: BLE001 - damaged reads as absent
            _log.warning("ignoring malformed JIT deps %s: %s", key, exc)
            return None
        for label, rel, _ in files:
            if not dep_rel_ok(rel):
                where = self.dir / "deps" / key[:2] / f"{key}.json"
                raise StoreError(f"JIT deps file {where}: {show(label)} file {show(rel)} is not a path below its root; "
                                 "expected words, '.' and '..' between '/' that never climb above it")
        return files, {str(k): v for k, v in shapes.items()}

    def put_output(self, key: str, stdout: str, stderr: str) -> None:
        doc = {"schema": OUTPUT_SCHEMA, "key": key, "stdout": stdout, "stderr": stderr}
        # ASCII-escaped: nvcc's bytes that are not UTF-8 are kept (read with surrogateescape), not refused.
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
        self.local.write_file(*self._at("output", check_key(key)), data, durable=False)

    def get_output(self, key: str) -> tuple[str, str] | None:
        """(stdout, stderr) of the compile of ``key``; None when not kept (compiled before it was) or damaged."""
        raw = self._read("output", key, limit=_MAX_OUTPUT)
        if raw is None:
            return None
        try:
            doc = loads_strict(raw, f"JIT output {key}", ValueError)
            if doc.get("schema") != OUTPUT_SCHEMA or doc.get("key") != key:
                raise ValueError("schema or key")
            if not isinstance(doc.get("stdout"), str) or not isinstance(doc.get("stderr"), str):
                raise ValueError("streams")
            return doc["stdout"], doc["stderr"]
        except Exception as exc:  # noqa: BLE001 - damaged reads as absent
            _log.warning("ignoring malformed JIT output %s: %s", key, exc)
            return None

    def get_direct(self, dkey: str) -> list[str]:
        """The keys compiled under direct key ``dkey``, newest first ([] when absent or damaged)."""
        raw = self._read("direct", dkey)
        if raw is None:
            return []
        try:
            doc = loads_strict(raw, f"JIT direct entry {dkey}", ValueError)
            if doc.get("schema") != DIRECT_SCHEMA or doc.get("direct") != dkey:
                raise ValueError("schema or direct key")
            return [check_key(k) for k in doc["keys"]][:MAX_CANDIDATES]
        except Exception as exc:  # noqa: BLE001 - damaged reads as absent
            _log.warning("ignoring malformed JIT direct entry %s: %s", dkey, exc)
            return []

    def add_direct(self, dkey: str, key: str) -> None:
        """Put ``key`` first among ``dkey``'s keys (locked read-modify-write, so concurrent
        compiles of one TU against different headers keep each other's keys)."""
        dkey, key = check_key(dkey), check_key(key)
        with self.local.file_lock(*self._at("locks", dkey, ".direct.lock"), timeout=self.lock_timeout,
                                  what=f"JIT direct key {dkey}"):
            keys = [k for k in self.get_direct(dkey) if k != key]
            doc = {"schema": DIRECT_SCHEMA, "direct": dkey, "keys": [key, *keys][:MAX_CANDIDATES]}
            self.local.write_file(*self._at("direct", dkey), dumps_canonical(doc), durable=False)

    # -- keys of compiles that read outside files ---------------------------------------------

    def get_outside(self, base: str) -> list[str]:
        """The keys compiled under base key ``base`` that read outside files, newest first ([]: none or damaged)."""
        raw = self._read("outside", base)
        if raw is None:
            return []
        try:
            doc = loads_strict(raw, f"JIT outside entry {base}", ValueError)
            if not isinstance(doc, dict) or doc.get("schema") != OUTSIDE_SCHEMA or doc.get("key") != base:
                raise ValueError("schema or key")
            return [check_key(k) for k in doc["keys"]][:MAX_CANDIDATES]
        except Exception as exc:  # noqa: BLE001 - damaged reads as absent: a miss compiles again
            _log.warning("ignoring malformed JIT outside entry %s: %s", base, exc)
            return []

    def add_outside(self, base: str, key: str) -> None:
        """Put ``key`` first among ``base``'s keys; call with the base key's lock held."""
        base, key = check_key(base), check_key(key)
        keys = [k for k in self.get_outside(base) if k != key]
        doc = {"schema": OUTSIDE_SCHEMA, "key": base, "keys": [key, *keys][:MAX_CANDIDATES]}
        self.local.write_file(*self._at("outside", base), dumps_canonical(doc))

    # -- single flight and compile directories --------------------------------------------------

    def lock(self, key: str) -> AbstractContextManager[None]:
        key = check_key(key)
        return self.local.file_lock(*self._at("locks", key, ".lock"), timeout=self.lock_timeout,
                                    what=f"JIT key xxh3:{key}")

    def compile_dir(self, key: str, attempt: int) -> Path:
        """A fresh private directory for one compile of ``key``; call with the key's lock held."""
        key = check_key(key)
        # Holding the lock, anything of this key's is a leftover of a killed compile.
        for name, _ in self.local.list_dir(("jit", "index", key[:2])):
            if name.startswith(f".tmp.{key}.json."):
                _log.info("removing the temp file of a killed index write: %s", name)
                self.local.remove_file(("jit", "index", key[:2]), name)
        tmp = self.dir / "tmp"
        cutoff = time.time() - _STALE_S
        for name, st in self.local.list_dir(("jit", "tmp")):
            # Ours (we hold the key's lock), or any key's so old no live compile can own it.
            if name.startswith(f"{key}.") or st.st_mtime < cutoff:
                _log.info("removing the compile directory of a killed compile: %s", tmp / name)
                shutil.rmtree(tmp / name, ignore_errors=True)  # rmtree never follows links
        name = f"{key}.{os.getpid()}.{attempt}"
        # The parents are opened without following links and checked like the CAS's.
        with self.local._fs.dir("v1", "jit", "tmp", create=True) as fd:
            os.mkdir(name, 0o700, dir_fd=fd)
        return tmp / name


def describe(entry: IndexEntry | None) -> Mapping[str, Any] | None:
    return None if entry is None else entry.to_json()
