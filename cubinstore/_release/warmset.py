"""The warm set: points a release did not have, met at run time, so CI can build them next time.

    <store>/v1/warmset/<2 hex>/<id>.json   one record per point: kind ("jit" or "miss"), family,
                                           params, arch, JIT key and CUBIN digest (jit), count,
                                           first and last seen (UTC, seconds)

A record is updated under its own lock (read, add one, atomic rewrite), so concurrent
processes never lose a count. Records go through the local store's descriptor-based file
API, like the CAS. Times are kept here only: no key or id contains one.
``export`` writes the points as a ``.bzl`` a family's ``BUILD.bazel`` loads (``WARM_POINTS``, passed to
``cubin_instantiations(warm_points = ...)``); ``prefetch`` fetches the
part of a manifest the warm set names; ``gc`` evicts warm-set CUBINs last.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cubinstore._core.abi import IDENT_RE, WORD_RE, Arch, dumps_canonical, loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.store.local.files import atomic_write
from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError, StoreError

__all__ = ["Record", "export", "prefetch", "record", "records", "warm_digests"]

_log = get_logger(__name__)

SCHEMA: Final = "cubinstore/warmset/v1"
EXPORT_MARK: Final = "# cubinstore-warmset-v1 points: "
_ID_RE: Final = re.compile(r"[0-9a-f]{64}", re.ASCII)
_KEY_RE: Final = re.compile(r"[0-9a-f]{32}", re.ASCII)
_KINDS: Final = ("jit", "miss")
_RECORD_KEYS: Final = frozenset({"schema", "kind", "family", "params", "arch", "key", "digest", "count",
                                 "first_seen", "last_seen"})
# Parameter values are ints of a grid (Starlark and ids hold them); counts and times fit in 63 bits.
_INT_BOUND: Final = 2**63
_MAX_RECORD_BYTES: Final = 1 << 20
_MAX_EXPORT_BYTES: Final = 16 << 20


@dataclass(frozen=True)
class Record:
    kind: str  # "jit": compiled at run time; "miss": asked of a manifest that did not have it
    family: str | None
    params: Mapping[str, str | int] = field(default_factory=dict)
    arch: str = ""
    key: str | None = None  # JIT key (32 hex)
    digest: Digest | None = None  # the CUBIN the JIT made
    count: int = 1
    first_seen: int = 0
    last_seen: int = 0

    @property
    def point(self) -> tuple[str | None, tuple[tuple[str, str | int], ...], str]:
        return self.family, tuple(sorted(self.params.items())), self.arch

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "kind": self.kind, "family": self.family, "params": dict(self.params),
            "arch": self.arch, "key": self.key, "digest": None if self.digest is None else str(self.digest),
            "count": self.count, "first_seen": self.first_seen, "last_seen": self.last_seen,
        }

    @classmethod
    def from_json(cls, doc: object) -> Record:
        """A record read back from the store, every field checked (a record is data another process,
        or a damaged disk, wrote); raises ``ValueError`` naming the first bad field."""
        if not isinstance(doc, dict):
            raise ValueError(f"expected an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - _RECORD_KEYS)
        if unknown:
            raise ValueError(f"unknown key {show(unknown[0])}")
        if doc.get("schema") != SCHEMA or doc.get("kind") not in _KINDS:
            raise ValueError(f"expected schema {SCHEMA!r} and kind one of {', '.join(_KINDS)}, "
                             f"got {show(doc.get('schema'))}, {show(doc.get('kind'))}")
        params = doc.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"params: expected an object, got {show(params)}")
        key = doc.get("key")
        if key is not None and (not isinstance(key, str) or not _KEY_RE.fullmatch(key)):
            raise ValueError(f"key: expected 32 lowercase hex digits or null, got {show(key)}")
        digest = doc.get("digest")
        try:
            checked = _check_point(doc.get("family"), params)
            arch = _check_arch(doc.get("arch"))
            parsed = None if digest is None else Digest.parse(digest)
        except BadArgumentError as exc:
            raise ValueError(str(exc)) from None
        count, first_seen, last_seen = (_count(doc, "count", 1), _count(doc, "first_seen", 0),
                                        _count(doc, "last_seen", 0))
        return cls(kind=doc["kind"], family=doc.get("family"), params=checked, arch=arch, key=key, digest=parsed,
                   count=count, first_seen=first_seen, last_seen=last_seen)


def _count(doc: Mapping[str, Any], name: str, default: int) -> int:
    value = doc.get(name, default)
    if type(value) is not int or not 0 <= value < _INT_BOUND:
        raise ValueError(f"{name}: expected a non-negative integer below 2**63, got {show(value)}")
    return value


def _check_arch(arch: object) -> str:
    try:
        return str(Arch.parse(arch))
    except (BadArgumentError, TypeError):  # TypeError: an unhashable value (Arch.parse is cached)
        raise BadArgumentError(f"warm set: arch must be like 'sm_90a', got {show(arch)}") from None


def _show_value(value: object) -> str:
    """``show`` of a parameter value; a huge int by its size (repr of one past 4300 digits raises)."""
    if type(value) is int and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    return show(value)


def _check_point(family: str | None, params: Mapping[str, Any] | None) -> dict[str, str | int]:
    if family is not None and (not isinstance(family, str) or not WORD_RE.fullmatch(family)):
        raise BadArgumentError(f"warm set: family must be a name like 'axpy', got {show(family)}")
    out: dict[str, str | int] = {}
    for k, v in (params or {}).items():
        if not isinstance(k, str) or not IDENT_RE.fullmatch(k):
            raise BadArgumentError(f"warm set: parameter names must be identifiers, got {show(k)}")
        if (type(v) not in (str, int) or (type(v) is str and not WORD_RE.fullmatch(v))
                or (type(v) is int and not -_INT_BOUND <= v < _INT_BOUND)):
            raise BadArgumentError(
                f"warm set: parameter {k} must be an int or a word like 'f32' (ints of at most 64 bits), got {_show_value(v)}")
        out[k] = v
    return out


def record(local: Any, *, kind: str, family: str | None, params: Mapping[str, str | int] | None, arch: str,
           key: str | None = None, digest: Digest | None = None) -> Record:
    """Add one occurrence of a point (a JIT compile, or a manifest miss) to the warm set."""
    if kind not in _KINDS:
        raise BadArgumentError(f"warm set: kind must be one of {', '.join(_KINDS)}, got {show(kind)}")
    checked = _check_point(family, params)
    arch = _check_arch(arch)
    # A JIT point without a family is known by its key alone; with one, by its family point.
    identity = {"family": family, "params": checked, "arch": arch} if family is not None else {"key": key, "arch": arch}
    rid = hashlib.sha256(dumps_canonical(identity)).hexdigest()
    at = (("warmset", rid[:2]), f"{rid}.json")
    now = int(time.time())
    with local.file_lock(("warmset", "locks"), f"{rid}.lock", timeout=30.0, what=f"warm set record {rid[:12]}"):
        old = _read(local, *at)
        new = Record(
            kind="jit" if kind == "jit" or (old is not None and old.kind == "jit") else "miss",
            family=family, params=checked, arch=arch,
            key=key if key is not None else (old.key if old else None),
            digest=digest if digest is not None else (old.digest if old else None),
            count=(old.count + 1) if old else 1,
            first_seen=old.first_seen if old else now, last_seen=now,
        )
        local.write_file(*at, dumps_canonical(new.to_json()), durable=False)
    return new


def _read(local: Any, parts: tuple[str, ...], name: str) -> Record | None:
    """The record ``v1/<parts>/<name>``, checked; None if absent. A damaged one is skipped with one
    warning naming its file: the warm set is advice, and the other records still count."""
    try:
        raw = local.read_file(parts, name, _MAX_RECORD_BYTES)
        if raw is None:
            return None
        if len(raw) > _MAX_RECORD_BYTES:
            raise ValueError(f"more than {_MAX_RECORD_BYTES} bytes")
        return Record.from_json(loads_strict(raw, "record", StoreError))
    except Exception as exc:  # noqa: BLE001 - a damaged record is skipped, never fatal
        why = " ".join(str(exc).split()) or type(exc).__name__  # one line
        _log.warning("ignoring damaged warm set record %s: %s", Path(local.v1, *parts, name), why)
        return None


def records(local: Any) -> list[Record]:
    """Every record, sorted by family, params, arch."""
    out: list[Record] = []
    for shard, st in local.list_dir(("warmset",)):
        if len(shard) != 2 or not stat.S_ISDIR(st.st_mode):
            continue
        for name, fst in local.list_dir(("warmset", shard)):
            if name.endswith(".json") and _ID_RE.fullmatch(name[:-5]) and stat.S_ISREG(fst.st_mode):
                rec = _read(local, ("warmset", shard), name)
                if rec is not None:
                    out.append(rec)
    out.sort(key=lambda r: (r.family or "", json.dumps(sorted(r.params.items())), r.arch, r.key or ""))
    return out


def warm_digests(local: Any) -> set[Digest]:
    """The CUBINs the warm set names (JIT records): ``gc`` evicts these last."""
    return {r.digest for r in records(local) if r.digest is not None}


# -- export ---------------------------------------------------------------------------------------

def _read_export(path: Path) -> bytes | None:
    """The bytes of an earlier export at ``path``, None if there is none. Only a regular file: the open
    neither follows a link nor waits on a FIFO (``--out`` is a path the user names)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadArgumentError(f"warmset export: --out {path} is a symbolic link; expected a regular file "
                                   f"or a new path") from None
        raise StoreError(f"cannot read the previous export {path}: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise BadArgumentError(f"warmset export: --out {path} is {kind}; expected a regular file or a new path")
    with os.fdopen(fd, "rb") as f:
        os.set_blocking(fd, True)
        try:
            data = f.read(_MAX_EXPORT_BYTES + 1)
        except OSError as exc:
            raise StoreError(f"cannot read the previous export {path}: {exc.strerror or exc}") from exc
    if len(data) > _MAX_EXPORT_BYTES:
        raise BadArgumentError(f"{path}: more than {_MAX_EXPORT_BYTES} bytes, so not an export; refusing to overwrite it")
    return data


def _previous_points(path: Path) -> list[dict[str, str | int]]:
    """The points of an earlier export: exports accumulate, or the next release would drop them."""
    data = _read_export(path)
    if data is None:
        return []
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith(EXPORT_MARK):
            again = "; delete the file and export again"
            points = loads_strict(line[len(EXPORT_MARK):], f"{path}: the points line", BadArgumentError)
            if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
                raise BadArgumentError(f"{path}: the points line is not a list of points{again}")
            try:
                return [_check_point("x", p) for p in points]
            except BadArgumentError as exc:
                raise BadArgumentError(f"{path}: the points line: {exc}{again}") from None
    raise BadArgumentError(f"{path} exists but was not written by `cubinstore warmset export`; refusing to overwrite it")


# The export is data only: `warm_grid` is tools/private/macros/warm_grid.bzl, which
# cubin_instantiations applies to the family's grid when given `warm_points`.
_STARLARK: Final = '''"""Warm set of family {family!r}: points met at run time that no release had.

Generated by `cubinstore warmset export --family {family}`; export again to update it (points
accumulate). In the family's BUILD.bazel:

    load(":warmset.bzl", "WARM_POINTS")
    cubin_instantiations(name = "{family}", grid = {{...the family's grid...}}, warm_points = WARM_POINTS, ...)

Each point is built for every arch of the family (seen at run time: {archs}).
"""

{mark}{points_json}
WARM_POINTS = {points_starlark}
'''


def _starlark_points(points: list[dict[str, str | int]]) -> str:
    """The points as buildifier formats a list of dicts (JSON strings and ints are Starlark).

    Each point is checked again here, where it becomes code: identifier keys, ints and words only
    (no quote, backslash or newline can reach the file)."""
    for p in points:
        _check_point("x", p)
    if not points:
        return "[]"
    lines = ["["]
    for p in points:
        lines.append("    {")
        lines += [f"        {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(p.items())]
        lines.append("    },")
    lines.append("]")
    return "\n".join(lines)


@dataclass(frozen=True)
class ExportResult:
    path: Path
    points: list[dict[str, str | int]]
    added: int
    skipped_without_family: int


def export(local: Any, family: str, out: Path, *, since: int = 0) -> ExportResult:
    """Write (or extend) ``out``, a ``.bzl`` with the warm points of ``family`` (seen at or after ``since``)."""
    _check_point(family, None)
    if not out.parent.is_dir():
        raise BadArgumentError(
            f"warmset export: {out.parent} is not a directory; run from the workspace root or pass --out PATH"
        )
    recs = records(local)
    previous = _previous_points(out)
    seen = {json.dumps(p, sort_keys=True) for p in previous}
    points = list(previous)
    archs: set[str] = set()
    added = 0
    for r in recs:
        if r.family != family or r.last_seen < since:
            continue
        archs.add(r.arch)
        p = dict(sorted(r.params.items()))
        if json.dumps(p, sort_keys=True) not in seen:
            seen.add(json.dumps(p, sort_keys=True))
            points.append(p)
            added += 1
    points.sort(key=lambda p: json.dumps(p, sort_keys=True))
    points_json = json.dumps(points, sort_keys=True, separators=(",", ":"))
    # JSON of strings and ints is valid Starlark.
    text = _STARLARK.format(family=family, archs=", ".join(sorted(archs)) or "none new", mark=EXPORT_MARK,
                            points_json=points_json, points_starlark=_starlark_points(points))
    atomic_write(out, text.encode("utf-8"))
    return ExportResult(out, points, added, sum(1 for r in recs if r.family is None))


# -- prefetch -------------------------------------------------------------------------------------

def closure(manifest: Any, recs: Iterable[Record]) -> list[Any]:
    """The manifest's kernels the warm set names: same family, params and arch (or the same CUBIN)."""
    points = {(r.family, tuple(sorted(r.params.items())), r.arch) for r in recs if r.family is not None}
    digests = {r.digest for r in recs if r.digest is not None}
    return [k for k in manifest.kernels
            if (k.family, tuple(sorted(k.params.items())), k.arch) in points or k.digest in digests]


def prefetch(manifest: Any, store: Any, local: Any) -> tuple[int, list[str]]:
    """Fetch the warm set's closure in ``manifest`` into the local store; (blobs fetched, failures).

    A failure about the store itself (``_prefetch.store_failure``) is raised once as a ``StoreError``."""
    from cubinstore._core import knobs as _env
    from cubinstore._release.prefetch import fetch_blobs

    specs = closure(manifest, records(local))
    names = {k.digest: k.id for k in specs}
    blobs = sorted({(k.digest, k.size) for k in specs}, key=lambda b: b[0].hex)
    failures = fetch_blobs(store, blobs, names=names.__getitem__, jobs=_env.fetch_jobs())
    return len(blobs), failures


def iter_families(recs: Iterable[Record]) -> Iterator[str]:
    return iter(sorted({r.family for r in recs if r.family is not None}))
