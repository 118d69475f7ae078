"""``cubinstore explain``: why a JIT key or a family point missed.

For a JIT key: its parts (kept in ``v1/jit/parts`` when it was first asked for), then the
nearest other key of the index (fewest differing parts) and, part by part, what differs:
which file under which include root changed content (by relative path), which flag, which
toolkit file or version, which host compiler, which arch. For a family point: the nearest
points of the manifest and which parameter or arch differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from cubinstore.errors import KernelNotFoundError

if TYPE_CHECKING:  # the JIT modules need xxhash; a family point's explanation does not
    from cubinstore._jit.index import JitIndex
    from cubinstore._jit.key import KeyParts, Tree

__all__ = ["explain_key", "explain_point", "nearest_points", "part_differences"]

_PARTS: Final = ("scheme", "source", "source_name", "includes", "flags", "arch", "toolkit", "host", "outside", "kind")
_MAX_FILES: Final = 12


@dataclass(frozen=True)
class _Nearest:
    key: str
    parts: KeyParts
    differing: tuple[str, ...]
    indexed: bool


def _differing(a: KeyParts, b: KeyParts) -> tuple[str, ...]:
    da, db = a.to_json(), b.to_json()
    # ``outside`` is left out of the JSON when the compile read no file outside its roots.
    return tuple(p for p in _PARTS if da.get(p) != db.get(p))


def _compared(a: KeyParts, b: KeyParts) -> int:
    """How many parts two keys have between them (``outside`` only where a compile read such files)."""
    da, db = a.to_json(), b.to_json()
    return sum(1 for p in _PARTS if p in da or p in db)


def _tree_diff(index: JitIndex, label: str, old: str, new: str, prefix: str = "") -> list[str]:
    from cubinstore._jit.key import load_tree

    a, b = load_tree(index.local, old), load_tree(index.local, new)
    if a is None or b is None or a.files is None or b.files is None:
        return [f"{label}: content differs ({old} -> {new}); the listing of {'the nearest' if a is None else 'this'} tree was not kept"]
    return _files_diff(label, a, b, prefix)


def _files_diff(label: str, a: Tree, b: Tree, prefix: str) -> list[str]:
    assert a.files is not None and b.files is not None
    changed = sorted(p for p in a.files.keys() & b.files.keys() if a.files[p] != b.files[p])
    added = sorted(b.files.keys() - a.files.keys())
    removed = sorted(a.files.keys() - b.files.keys())
    out: list[str] = []
    for what, paths in (("changed content", changed), ("added", added), ("removed", removed)):
        for p in paths[:_MAX_FILES]:
            out.append(f"{label}: {prefix}{p} {what}")
        if len(paths) > _MAX_FILES:
            out.append(f"{label}: ... and {len(paths) - _MAX_FILES} more files {what}")
    return out or [f"{label}: same files, listing key differs ({a.key} -> {b.key})"]


def _sequence_diff(label: str, old: Sequence[str], new: Sequence[str]) -> list[str]:
    out = [f"{label}: {f} only in the nearest entry" for f in old if f not in new]
    out += [f"{label}: {f} only in this key" for f in new if f not in old]
    if not out:
        out = [f"{label}: same values in another order: {' '.join(old)} -> {' '.join(new)}"]
    return out


def part_differences(index: JitIndex, old: KeyParts, new: KeyParts) -> list[str]:
    """One line per difference between the nearest entry's parts (``old``) and this key's (``new``)."""
    lines: list[str] = []
    for part in _differing(old, new):
        if part == "includes":
            for i in range(max(len(old.includes), len(new.includes))):
                a = old.includes[i] if i < len(old.includes) else None
                b = new.includes[i] if i < len(new.includes) else None
                if a == b:
                    continue
                if a is None or b is None:
                    lines.append(f"include root {i}: {'added' if a is None else 'removed'}")
                else:
                    lines.extend(_tree_diff(index, f"include root {i}", a, b))
        elif part == "flags":
            lines.extend(_sequence_diff("flag", old.flags, new.flags))
        elif part == "toolkit":
            if old.toolkit.get("version") != new.toolkit.get("version"):
                lines.append(f"toolkit: CUDA {old.toolkit.get('version')} -> {new.toolkit.get('version')}")
            if old.toolkit.get("files") != new.toolkit.get("files"):
                lines.extend(_tree_diff(index, "toolkit", old.toolkit.get("files", ""), new.toolkit.get("files", ""), "file "))
        elif part == "host":
            if old.host.get("name") != new.host.get("name"):
                lines.append(f"host compiler: {old.host.get('name')} -> {new.host.get('name')}")
            a_lines = old.host.get("identity", "").splitlines()
            b_lines = new.host.get("identity", "").splitlines()
            lines.extend(f"host compiler identity: {line!r} only in the nearest entry" for line in a_lines if line not in b_lines)
            lines.extend(f"host compiler identity: {line!r} only in this key" for line in b_lines if line not in a_lines)
        elif part == "outside":
            a_files, b_files = dict(old.outside), dict(new.outside)
            for path in sorted(a_files.keys() | b_files.keys()):
                if path not in b_files:
                    lines.append(f"file outside the roots: {path} read only by the nearest entry")
                elif path not in a_files:
                    lines.append(f"file outside the roots: {path} read only by this key")
                elif a_files[path] != b_files[path]:
                    lines.append(f"file outside the roots: {path} changed content")
        elif part == "source":
            lines.append(f"source: the TU text differs ({old.source} -> {new.source})")
        else:
            lines.append(f"{part}: {getattr(old, part)} -> {getattr(new, part)}")
    return lines


def _describe(parts: KeyParts) -> list[str]:
    host = parts.host.get("identity", "").split("version:\n", 1)[-1].strip().splitlines()
    lines = [f"  source       {parts.source} ({parts.source_name})"]
    lines += [f"  include[{i}]   {t}" for i, t in enumerate(parts.includes)]
    lines += [f"  flags        {' '.join(parts.flags)}",
              f"  arch         {parts.arch}",
              f"  toolkit      CUDA {parts.toolkit.get('version')}, files {parts.toolkit.get('files')}",
              f"  host         {parts.host.get('name')}: {host[0] if host else '?'}",
              f"  scheme       {parts.scheme}"]
    lines += [f"  outside      {path} {digest}" for path, digest in parts.outside]
    return lines


def _nearest(index: JitIndex, key: str, parts: KeyParts) -> _Nearest | None:
    indexed = {e.key for e in index.entries()}
    best: _Nearest | None = None
    for other in index.parts_keys():
        if other == key:
            continue
        other_parts = index.get_parts(other)
        if other_parts is None:
            continue
        cand = _Nearest(other, other_parts, _differing(other_parts, parts), other in indexed)
        # Fewest differing parts; among equals, one that compiled, then a same-source one.
        rank = (len(cand.differing), not cand.indexed, "source" in cand.differing, cand.key)
        if best is None or rank < (len(best.differing), not best.indexed, "source" in best.differing, best.key):
            best = cand
    return best


def explain_key(index: JitIndex, key: str) -> str:
    """The report for one JIT key (``xxh3:<hex>`` or the hex)."""
    from cubinstore._jit.index import check_key

    key = check_key(key)
    parts = index.get_parts(key)
    if parts is None:
        raise KernelNotFoundError(
            f"JIT key xxh3:{key}: no parts kept in {index.dir}; explain knows keys this store was asked to compile"
        )
    entry = index.get(key)
    state = f"in the index: {entry.digest} ({entry.size} bytes)" if entry else "not in the index (never compiled, or the compile failed)"
    lines = [f"JIT key xxh3:{key}: {state}", "parts:", *_describe(parts)]
    near = _nearest(index, key, parts)
    if near is None:
        lines.append("nearest entry: none (the index has no other key); everything above is new")
        return "\n".join(lines) + "\n"
    near_entry = index.get(near.key)
    where = f"{near_entry.digest}" if near_entry else "not compiled"
    lines.append(f"nearest entry: xxh3:{near.key} ({where}); {len(near.differing)} of {_compared(near.parts, parts)} parts differ: "
                 f"{', '.join(near.differing) or 'none'}")
    lines.append("why it missed:")
    lines += [f"  {line}" for line in part_differences(index, near.parts, parts)] or ["  (identical parts)"]
    return "\n".join(lines) + "\n"


def nearest_points(manifest: Any, family: str, params: Mapping[str, str | int], arch: str | None,
                   limit: int = 8) -> list[tuple[Any, list[str]]]:
    """The manifest's kernels of ``family`` with the fewest differences from the point, and the differences."""
    kernels = [k for k in manifest.kernels if k.family == family]
    if not kernels:
        families = sorted({k.family for k in manifest.kernels})
        raise KernelNotFoundError(f"manifest {manifest.digest} has no family {family!r}; families: {', '.join(families)}")

    def diff(k: Any) -> list[str]:
        out = []
        for name in sorted(set(params) | set(k.params)):
            if name not in k.params:
                out.append(f"parameter {name} is not a parameter of {family} (it has {', '.join(sorted(k.params))})")
            elif name not in params:
                continue  # unspecified: any value matches
            elif k.params[name] != params[name]:
                out.append(f"{name}: {k.params[name]!r} in the manifest, {params[name]!r} asked")
        if arch and k.arch != arch:
            out.append(f"arch: {k.arch} in the manifest, {arch} asked")
        return out

    ranked = sorted(kernels, key=lambda k: (len(diff(k)), k.id))
    best = len(diff(ranked[0]))
    return [(k, diff(k)) for k in ranked if len(diff(k)) == best][:limit]


def explain_point(manifest: Any, family: str, params: Mapping[str, str | int], arch: str | None) -> str:
    """The report for a family point: is it in ``manifest``, and if not, which points are nearest."""
    asked = " ".join(f"{k}={v}" for k, v in params.items()) + (f" arch={arch}" if arch else "")
    near = nearest_points(manifest, family, params, arch, limit=1000)
    best = len(near[0][1])
    lines = [f"{family} {asked}: " + ("in manifest " + str(manifest.digest) if best == 0 else f"not in manifest {manifest.digest}")]
    if best == 0:
        lines += [f"  {k.id}  {k.digest}" for k, _ in near]
        return "\n".join(lines) + "\n"
    lines.append(f"nearest points ({best} difference{'s' if best > 1 else ''}):")
    for k, differences in near[:8]:
        lines.append(f"  {k.id}")
        lines += [f"    {d}" for d in differences]
    lines.append(f"build it ahead of time: `cubinstore warmset export --family {family}` after the miss is recorded")
    return "\n".join(lines) + "\n"
