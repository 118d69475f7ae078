"""The warm set: points a release did not have, met at run time, so CI can build them next time.

    <store>/v1/warmset/<2 hex>/<id>.json   one record per point: kind ("jit" or "miss"), family,
                                           params, arch, JIT key and CUBIN digest (jit), count,
                                           first and last seen (UTC, seconds)

A record is updated under its own lock (read, add one, atomic rewrite), so concurrent
processes never lose a count. Records go through the local store's descriptor-based file
API, like the CAS. Times are kept here only: no key or id contains one.
``export`` writes a ``.bzl`` a family's ``BUILD.bazel`` loads; ``prefetch`` fetches the
part of a manifest the warm set names; ``gc`` evicts warm-set CUBINs last.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cubinstore._abi import dumps_canonical
from cubinstore._digest import Digest, show
from cubinstore._files import atomic_write
from cubinstore._log import get_logger
from cubinstore.errors import BadArgumentError, CubinstoreError, StoreError

__all__ = ["Record", "export", "prefetch", "record", "records", "warm_digests"]

_log = get_logger(__name__)

SCHEMA: Final = "cubinstore/warmset/v1"
EXPORT_MARK: Final = "# cubinstore-warmset-v1 points: "
_ID_RE: Final = re.compile(r"[0-9a-f]{64}", re.ASCII)
_IDENT_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_WORD_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", re.ASCII)
_KINDS: Final = ("jit", "miss")


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
    def from_json(cls, doc: Mapping[str, Any]) -> Record:
        if doc.get("schema") != SCHEMA or doc.get("kind") not in _KINDS:
            raise ValueError(f"schema {doc.get('schema')!r}, kind {doc.get('kind')!r}")
        params = doc.get("params") or {}
        if not isinstance(params, dict):
            raise ValueError("params")
        digest = doc.get("digest")
        return cls(
            kind=doc["kind"], family=doc.get("family"), params=params, arch=str(doc.get("arch", "")),
            key=doc.get("key"), digest=None if digest is None else Digest.parse(digest),
            count=int(doc.get("count", 1)), first_seen=int(doc.get("first_seen", 0)), last_seen=int(doc.get("last_seen", 0)),
        )


def _check_point(family: str | None, params: Mapping[str, Any] | None) -> dict[str, str | int]:
    if family is not None and (not isinstance(family, str) or not _WORD_RE.fullmatch(family)):
        raise BadArgumentError(f"warm set: family must be a name like 'axpy', got {show(family)}")
    out: dict[str, str | int] = {}
    for k, v in (params or {}).items():
        if not isinstance(k, str) or not _IDENT_RE.fullmatch(k):
            raise BadArgumentError(f"warm set: parameter names must be identifiers, got {show(k)}")
        if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, str) and not _WORD_RE.fullmatch(v)):
            raise BadArgumentError(f"warm set: parameter {k} must be an int or a word like 'f32', got {show(v)}")
        out[k] = v
    return out


def record(local: Any, *, kind: str, family: str | None, params: Mapping[str, str | int] | None, arch: str,
           key: str | None = None, digest: Digest | None = None) -> Record:
    """Add one occurrence of a point (a JIT compile, or a manifest miss) to the warm set."""
    if kind not in _KINDS:
        raise BadArgumentError(f"warm set: kind must be one of {', '.join(_KINDS)}, got {show(kind)}")
    checked = _check_point(family, params)
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
    try:
        raw = local.read_file(parts, name, 1 << 20)
        return None if raw is None else Record.from_json(json.loads(raw))
    except Exception as exc:  # noqa: BLE001 - a damaged record is skipped, never fatal
        _log.warning("ignoring damaged warm set record %s/%s: %s", "/".join(parts), name, exc)
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

def _previous_points(path: Path) -> list[dict[str, str | int]]:
    """The points of an earlier export: exports accumulate, or the next release would drop them."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StoreError(f"cannot read the previous export {path}: {exc.strerror or exc}") from exc
    for line in text.splitlines():
        if line.startswith(EXPORT_MARK):
            try:
                points = json.loads(line[len(EXPORT_MARK):])
            except ValueError as exc:
                raise BadArgumentError(f"{path}: the points line is not JSON ({exc}); delete the file and export again") from exc
            if isinstance(points, list) and all(isinstance(p, dict) for p in points):
                return [_check_point("x", p) for p in points]
    raise BadArgumentError(f"{path} exists but was not written by `cubinstore warmset export`; refusing to overwrite it")


_STARLARK: Final = '''"""Warm set of family {family!r}: points met at run time that no release had.

Generated by `cubinstore warmset export --family {family}`; export again to update it (points
accumulate). In the family's BUILD.bazel:

    load(":warmset.bzl", "warm_grid")
    cubin_instantiations(name = "{family}", grid = warm_grid({{...the family's grid...}}), ...)

Each point is built for every arch of the family (seen at run time: {archs}).
"""

{mark}{points_json}
WARM_POINTS = {points_starlark}

def _in_grids(point, grids):
    for g in grids:
        inside = True
        for k, values in g.items():
            if point[k] not in values:
                inside = False
        if inside:
            return True
    return False

def warm_grid(grid, points = WARM_POINTS):
    """The family's grid plus each warm point it lacks.

    Args:
      grid: the family's grid: a dict of parameter -> values, or a list of such dicts.
      points: the warm points, each a dict of parameter -> value.

    Returns:
      A list of grids: `grid`'s, then one single-point grid per missing point.
    """
    grids = grid if type(grid) == "list" else [grid]
    keys = grids[0].keys()
    out = list(grids)
    for p in points:
        if sorted(p.keys()) != sorted(keys):
            fail("warmset.bzl: point {{}} has keys {{}}, the family's grid has {{}}; export again".format(p, sorted(p.keys()), keys))
        if not _in_grids(p, out):
            out.append({{k: [p[k]] for k in keys}})
    return out
'''


def _starlark_points(points: list[dict[str, str | int]]) -> str:
    """The points as buildifier formats a list of dicts (JSON strings and ints are Starlark)."""
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
    """Fetch the warm set's closure in ``manifest`` into the local store; (blobs fetched, failures)."""
    specs = closure(manifest, records(local))
    failures: list[str] = []
    blobs = sorted({(k.digest, k.size, k.id) for k in specs}, key=lambda b: b[0].hex)
    for digest, size, kid in blobs:
        try:
            store.get(digest, size, name=kid)
        except CubinstoreError as exc:
            failures.append(str(exc))
    return len(blobs), failures


def iter_families(recs: Iterable[Record]) -> Iterator[str]:
    return iter(sorted({r.family for r in recs if r.family is not None}))
