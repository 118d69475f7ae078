"""Call records: what lets ``cubinstore-nvcc`` answer a call it has seen, in milliseconds, without nvcc.

    v1/nvcc/calls/<2 hex>/<call>.json   call key -> up to 8 records, newest first. A record names
                                        the JIT key and CUBIN (sha256, size) of one compile of the
                                        call, every file the compile read (root label, relative
                                        path, xxh3; absolute path and xxh3 outside every root), the
                                        places a lookup could have found a file but found none
                                        (``absent``, from ``probes``), and nvcc's stdout and stderr
                                        with the compile directory's names.
    v1/nvcc/env/<2 hex>/<name>.json     the toolchain's identity on this host (toolkit programs and
                                        libdevice, host compiler, the nvcc program) and the stats of
                                        the files it was taken from: a call whose stats match takes
                                        the identity without hashing a binary

The *call key* covers content only: the TU's text, the flags (``-isystem`` paths by label), the
arch, the output kind, the number of include roots and the toolchain's identity. It never
covers where the library is installed, the working directory or the output path, so a
library at another prefix, a renamed virtualenv or a fresh cache finds the record, and the
record's check (``check``) decides: every file read still has its content (found at the new
prefix), and every absent place is still absent (no new file would shadow a header read).

Records are claims like the JIT index's entries: a record that does not check is a miss, and the
CUBIN it names is verified by sha256 before a byte of it is written. Everything is read without
following a link inside the store and within a size limit. A path a record names is checked
against the allow-list grammar of ``cubinstore._jit.inputs`` (standard library only) before it
is joined to its root, and a toolchain record's paths before they are stat'ed. Standard library
and ``xxhash``: a hit imports nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re

import xxhash

from cubinstore._jit.inputs import abs_path_ok, join_below, record_rel_ok

__all__ = ["CALL_SCHEME", "MAX_RECORDS", "MAX_RECORD_BYTES", "MAX_RECORD_FILES", "MAX_RECORD_READ_BYTES", "artifact",
           "call_key", "canonical", "check", "looks_like", "read_env", "read_path", "read_records", "read_store_file",
           "record_problem"]

CALL_SCHEME = "cubinstore-nvcc-v1"
RECORDS_SCHEMA = "cubinstore/nvcc-calls/v1"
ENV_SCHEMA = "cubinstore/nvcc-env/v1"
MAX_RECORDS = 8  # per call key: the same TU against differing headers (two library versions)
MAX_RECORDS_BYTES = 8 << 20
MAX_ENV_BYTES = 1 << 20
MAX_OUTPUT_CHARS = 1 << 20
MAX_HEADER_BYTES = 64 << 20  # a file a record says the compile read: checked only up to this size
MAX_RECORD_BYTES = MAX_RECORDS_BYTES  # one record (a remote's call.json): no larger than the file that keeps it
MAX_RECORD_FILES = 1 << 14  # files one record names: far more headers than a TU includes
MAX_RECORD_READ_BYTES = 256 << 20  # all the files read to build one record, together
_HEX32 = re.compile(r"[0-9a-f]{32}", re.ASCII)
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
_XXH3 = re.compile(r"xxh3:[0-9a-f]{32}", re.ASCII)
_LABEL = re.compile(r"inc/[0-9]{1,4}|flagpath/[0-9]{1,4}|cuda", re.ASCII)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


def canonical(doc: object) -> bytes:
    """The one JSON spelling of cubinstore-nvcc's records: sorted keys, compact, ASCII (nvcc's
    bytes that are not UTF-8 survive as escapes)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def call_key(text: bytes, arch: str, kind: str, flags: list[str], roots: int, env_identity: str) -> str:
    """The call key (32 hex): content only, never a path."""
    doc = {"scheme": CALL_SCHEME, "source": "xxh3:" + xxhash.xxh3_128_hexdigest(text), "arch": arch, "kind": kind,
           "flags": flags, "roots": roots, "env": env_identity}
    return xxhash.xxh3_128_hexdigest(canonical(doc))


# -- reading the store without following links ------------------------------------------------------

def read_store_file(root: str, parts: tuple[str, ...], limit: int) -> bytes | None:
    """The bytes of ``root/parts...`` if every directory below ``root`` and the file are what they
    claim (no link followed) and the file holds at most ``limit`` bytes; None otherwise."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return read_open(ffd, limit)


def read_path(path: str, limit: int) -> bytes | None:
    """The bytes of ``path`` (links followed) if it is a regular file of at most ``limit`` bytes;
    None otherwise. The open does not block: a FIFO or device is refused, never read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    return read_open(fd, limit)


def read_open(fd: int, limit: int) -> bytes | None:
    """The bytes of the open file ``fd`` (closed here) if it is a regular file of at most ``limit``
    bytes; None otherwise. Reads at most ``limit + 1`` bytes whatever the file claims."""
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o170000 != 0o100000 or st.st_size > limit:
            return None
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        return None if len(data) > limit else data
    except OSError:
        return None
    finally:
        os.close(fd)


def _json(raw: bytes | None) -> dict | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def read_env(root: str, name: str) -> dict | None:
    """The toolchain identity recorded under ``name`` if its files' stats are unchanged; else None."""
    doc = _json(read_store_file(root, ("v1", "nvcc", "env", name[:2], name + ".json"), MAX_ENV_BYTES))
    if doc is None or doc.get("schema") != ENV_SCHEMA or doc.get("name") != name:
        return None
    paths, facts = doc.get("paths"), doc.get("facts")
    identity, toolkit, program = doc.get("identity"), doc.get("toolkit"), doc.get("program")
    # The toolkit is the root of every "cuda" path a record names, and each path is stat'ed:
    # absolute paths of words only (``inputs.abs_path_ok``), as this host's toolchain writes them.
    if not (isinstance(paths, list) and isinstance(facts, list) and len(paths) == len(facts) and paths
            and isinstance(identity, str) and _HEX32.fullmatch(identity)
            and abs_path_ok(toolkit) and abs_path_ok(program) and all(abs_path_ok(p) for p in paths)
            and (doc.get("program_id") is None or (isinstance(doc["program_id"], str) and _XXH3.fullmatch(doc["program_id"])))):
        return None
    for path, fact in zip(paths, facts):
        try:
            st = os.stat(path)
        except OSError:
            if fact is not None:
                return None
            continue
        if fact != [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]:
            return None
    return doc


def read_records(root: str, key: str) -> list[dict]:
    """The records of call key ``key``, newest first ([] when absent or damaged)."""
    doc = _json(read_store_file(root, ("v1", "nvcc", "calls", key[:2], key + ".json"), MAX_RECORDS_BYTES))
    if doc is None or doc.get("schema") != RECORDS_SCHEMA or doc.get("call") != key:
        return []
    records = doc.get("records")
    if not isinstance(records, list):
        return []
    return [r for r in records[:MAX_RECORDS] if isinstance(r, dict) and record_problem(r) is None]


def _pairs(value: object, n: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, list) and len(item) == n and all(isinstance(x, str) for x in item) for item in value)


def record_problem(r: dict) -> str | None:
    """What is wrong with a record's shape (None: nothing); its claims are checked by ``check``."""
    if not (isinstance(r.get("key"), str) and _HEX32.fullmatch(r["key"])):
        return "key"
    if not (isinstance(r.get("digest"), str) and _SHA256.fullmatch(r["digest"])):
        return "digest"
    if not (isinstance(r.get("size"), int) and not isinstance(r["size"], bool) and 0 < r["size"] <= (1 << 30)):
        return "size"
    if not (_pairs(r.get("files"), 3) and len(r["files"]) <= MAX_RECORD_FILES
            and all(_LABEL.fullmatch(a) and record_rel_ok(b) and _XXH3.fullmatch(c) for a, b, c in r["files"])):
        return "files"
    if not (_pairs(r.get("absent"), 2) and all(_LABEL.fullmatch(a) and record_rel_ok(b) for a, b in r["absent"])):
        return "absent"
    if not (_pairs(r.get("outside"), 2) and all(abs_path_ok(a) and _XXH3.fullmatch(b)
                                                 for a, b in r["outside"])):
        return "outside"
    for stream in ("stdout", "stderr"):
        if not (isinstance(r.get(stream), str) and len(r[stream]) <= MAX_OUTPUT_CHARS):
            return stream
    return None


# -- the check ------------------------------------------------------------------------------------------

def _xxh3_file(path: str) -> str | None:
    """The file's xxh3 (None: missing, not a regular file, or over ``MAX_HEADER_BYTES``: no header is)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o170000 != 0o100000 or st.st_size > MAX_HEADER_BYTES:
            return None  # a FIFO or a device is never read; nor a file no compile reads whole
        h = xxhash.xxh3_128()
        left = MAX_HEADER_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(_CHUNK, left))
            if not chunk:
                return "xxh3:" + h.hexdigest()
            h.update(chunk)
            left -= len(chunk)
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def _absent(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno in (errno.ENOENT, errno.ENOTDIR)
    return False


def check(r: dict, bases: dict[str, str]) -> str | None:
    """Why record ``r`` does not hold here (None: it holds). ``bases``: where each root label is."""
    for label, rel, digest in r["files"]:
        base = bases.get(label)
        if base is None:
            return f"no root {label}"
        path = join_below(base, rel, record_rel_ok)
        if path is None:
            return f"{label}/{rel!r} is not a path below its root"
        if _xxh3_file(path) != digest:
            return f"{label}/{rel} changed"
    for path, digest in r["outside"]:
        if _xxh3_file(path) != digest:
            return f"{path} changed"
    for label, rel in r["absent"]:
        base = bases.get(label)
        if base is None:
            return f"no root {label}"
        path = join_below(base, rel, record_rel_ok)
        if path is None:
            return f"{label}/{rel!r} is not a path below its root"
        if not _absent(path):
            return f"{label}/{rel} appeared"
    return None


def looks_like(data: bytes, kind: str) -> bool:
    """Whether ``data`` has the shape of nvcc's ``kind`` output: an ELF CUBIN, a fatbin (its magic
    number) or PTX text (the JIT index checks the same: ``_jit.compiler``)."""
    if kind == "cubin":
        return data[:4] == b"\x7fELF"
    if kind == "fatbin":
        return data[:4] == b"\x50\xed\x55\xba"
    return kind == "ptx" and data.isascii() and b".version" in data[:4096]


def artifact(root: str, r: dict, kind: str) -> bytes | None:
    """The record's output from the local CAS, verified (sha256, size, its kind's shape); None if not there."""
    hex_ = r["digest"][len("sha256:"):]
    data = read_store_file(root, ("v1", "cas", hex_[:2], hex_), r["size"])
    if data is None or len(data) != r["size"] or hashlib.sha256(data).hexdigest() != hex_ or not looks_like(data, kind):
        return None
    return data
