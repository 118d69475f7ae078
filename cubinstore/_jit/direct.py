"""The direct key: a warm JIT hit that checks the files the TU included, not every file it could reach.

The full key (``_jitkey``) hashes every file under each include root and the toolkit's whole
include tree; a fresh process must at least stat all of them (~2,700 for CUTLASS + CUDA).
After a compile, nvcc's dependency list (``-MD``) says which files the TU actually read, so
``v1/jit/deps/<key>.json`` records them as (root label, relative path, xxh3) beside the shape
(the set of file names, ``_jitkey.Shape``) of every root, and ``v1/jit/direct/<dkey>.json``
maps the *direct key* to the keys compiled under it. The direct key is xxh3 over what needs
no walk: the TU text and name, the number of include roots, the flags (directories as
``{dir}``, files by content), the arch, the toolkit's programs and libdevice
(``ToolkitCore``) and the host compiler's identity.

A candidate key is taken only when every recorded file has its recorded content and every
root (the include roots, directory flags, and the toolkit's include tree) has its recorded
shape. Then the preprocessor resolves every ``#include`` and ``__has_include`` to the same
files with the same bytes, and the compile, a function of those, gives the CUBIN of that key:

- a changed included header misses (its hash); a changed header the TU does not include hits;
- a new file anywhere in a root (one that would shadow an include earlier in the search path,
  or satisfy a ``__has_include``) changes the root's shape and misses;
- relative paths and content only, so a copied or symlinked tree at another prefix hits.

A fresh process at a known location does not even hash: ``v1/jit/stat/`` keeps, per direct key
and root locations, the stats of the recorded files and of every directory and link of the
roots; all equal (none modified within the racy window) means the check passed before on
these very files. Anything missing, damaged or different falls back to the full key, which
stays what ``explain`` and ``jit.key`` use.

``classify`` sorts each file of the dependency list: inside a root (recorded here), the TU or
a file flag (keyed by content), the toolkit, a *system header* (inside the host compiler's own
system include directories, ``HostCompiler.system_dirs``: covered by its identity), or an
*outside file* (anything else, e.g. ``#include "/abs/cfg.h"``). Outside files are keyed by
path and content in the key ``jit.compile`` reports (``KeyParts.outside``), which the direct
entry names, so a direct hit re-checks them too; a sealed compile refuses them.
"""

from __future__ import annotations

import functools
import marshal
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import xxhash

from cubinstore._core.abi import Arch, dumps_canonical
from cubinstore._jit import key as _jitkey
from cubinstore._jit.key import (
    Flags,
    HostCompiler,
    StatCache,
    ToolkitCore,
    hash_file,
    host_command,
    host_compiler,
    locate_toolkit,
    normalize_flags,
    probe_fingerprint,
    shape,
    toolkit_core,
    xxh3,
)
from cubinstore._core.log import get_logger
from cubinstore.errors import CubinstoreError

from cubinstore._jit.index import check_key
from cubinstore._jit.inputs import dep_rel_ok, join_below

if TYPE_CHECKING:
    from cubinstore._jit.index import JitIndex
    from cubinstore.store.local.cas import LocalLayer

__all__ = ["DEPS_NAME", "DirectRequest", "Deps", "Roots", "classify", "clear", "forget", "lookup", "observe", "outside_match",
           "parse_deps", "put_deps", "record", "remember"]

_log = get_logger(__name__)

DIRECT_SCHEME: Final = "cubinstore-jit-direct-v1"
DEPS_NAME: Final = "cubinstore_jit.d"  # nvcc -MF output in the compile directory
TOOLKIT: Final = "cuda"  # the toolkit's label: deps relative to its root, shape of its include tree


@dataclass(frozen=True)
class Roots:
    """Where each root label is on this host (never keyed): ``inc/<i>``, ``flagpath/<i>`` for
    directory flags, and ``cuda``. ``base`` is where recorded paths are opened, ``tree`` the
    directory whose shape is checked (the same but for the toolkit: its root, its include tree)."""

    labels: tuple[str, ...]
    base: tuple[str, ...]
    tree: tuple[str, ...]
    # The toolkit's real root and that of the nvcc binary it links to: an absolute dependency
    # in either that is not in ``tree`` cannot be placed (never taken for a system header).
    homes: tuple[str, ...] = ()
    # The real paths of the file flags (``-include /abs/f.h``): read by the compile, keyed by content.
    files: tuple[str, ...] = ()

    def index(self, label: str) -> int:
        return self.labels.index(label)


def make_roots(include_dirs: Sequence[str], flags: Flags, toolkit_root: Path) -> Roots:
    labels, base, tree = [], [], []
    for i, d in enumerate(include_dirs):
        real = os.path.realpath(d)
        labels.append(f"inc/{i}")
        base.append(real)
        tree.append(real)
    for i, fp in enumerate(flags.paths):
        if fp.is_dir:
            real = os.path.realpath(fp.path)
            labels.append(f"flagpath/{i}")
            base.append(real)
            tree.append(real)
    labels.append(TOOLKIT)
    base.append(str(toolkit_root))
    tree.append(os.path.realpath(toolkit_root / "include"))
    homes = {os.path.realpath(toolkit_root), os.path.dirname(os.path.dirname(os.path.realpath(toolkit_root / "bin" / "nvcc")))}
    files = tuple(os.path.realpath(fp.path) for fp in flags.paths if not fp.is_dir)
    return Roots(tuple(labels), tuple(base), tuple(tree), tuple(sorted(homes)), files)


class DirectRequest:
    """What the direct key covers for one call, computed without walking any tree.

    The toolkit's and host compiler's identities are taken only when needed (a slow check or a
    compile): a fresh process whose stat check passes reads neither, since the stats it checks
    include the files those identities were taken from."""

    def __init__(self, text: str, source_name: str, include_dirs: Sequence[str], flags: Sequence[str], arch: Arch,
                 local: LocalLayer, program: str | None = None, kind: str = "cubin") -> None:
        self.local = local
        self.flags: Flags = normalize_flags(flags, local=local, key_dirs=False)
        self.toolkit_root, _ = locate_toolkit()
        self.host_name, self.host_binary = host_command()
        self.roots = make_roots(include_dirs, self.flags, self.toolkit_root)
        self._request = {
            "scheme": DIRECT_SCHEME, "source": xxh3(text.encode("utf-8", "surrogateescape")), "source_name": source_name,
            "includes": len(include_dirs), "flags": list(self.flags.keyed), "arch": str(arch),
        }
        if program is not None:  # another nvcc program than the toolkit's (``jit.key.key_parts``)
            self._request["program"] = program
        if kind != "cubin":  # -ptx or -fatbin (``KeyParts.kind``)
            self._request["kind"] = kind
        # The stat cache's name: everything but the identities, and where each root is here.
        self._stat_name = "\0".join((
            "direct", xxhash.xxh3_128_hexdigest(dumps_canonical(self._request)), self.host_name, self.host_binary,
            *self.roots.base, *self.roots.tree))

    @functools.cached_property
    def core(self) -> ToolkitCore:
        return toolkit_core(local=self.local)

    @functools.cached_property
    def host(self) -> HostCompiler:
        return host_compiler(local=self.local)

    @functools.cached_property
    def key(self) -> str:
        doc = {**self._request, "toolkit": self.core.identity,
               "host": {"name": self.host.name, "identity": self.host.identity}}
        return xxhash.xxh3_128_hexdigest(dumps_canonical(doc))

    def ids(self) -> tuple[tuple[str, ...], tuple[tuple[int, ...] | None, ...]]:
        """The files the toolkit's and host compiler's identities were taken from, and their stats then."""
        if self.core.root != self.toolkit_root or self.host.id_paths[:1] != (self.host_binary,):
            return (), ()  # the environment moved under this request: nothing to vouch for
        return self.core.id_paths + self.host.id_paths, self.core.id_facts + self.host.id_facts


# -- recording, after a compile ---------------------------------------------------------------------

def _tokens(text: str) -> list[str] | None:
    """The words of a make rule as gcc writes it (``\\`` newline continues, ``\\ `` is a space,
    ``$$`` a dollar); None for anything this reader would have to guess at."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    out: list[str] = []
    word: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            if text[i + 1:i + 2] in (" ", "#"):
                word.append(text[i + 1])
                i += 2
                continue
            return None
        if c == "$":
            if text[i + 1:i + 2] != "$":
                return None
            word.append("$")
            i += 2
            continue
        if c.isspace():
            if word:
                out.append("".join(word))
                word = []
        else:
            word.append(c)
        i += 1
    if word:
        out.append("".join(word))
    return out


@dataclass(frozen=True)
class Deps:
    """What one compile read, sorted by ``classify``."""

    # (label, path relative to the label's base) of each file inside a root; None when one
    # could not be placed (no direct entry is then written, which is always safe).
    placed: list[tuple[str, str]] | None
    # Absolute paths (as the compile named them) of files outside every root, flag path, the
    # toolkit and the host compiler's system include directories: keyed by content after the compile.
    outside: list[str]
    # Files the compile read whose real path is outside the include roots, the flag paths, the
    # toolkit, the system include directories and the compile directory: what a sealed compile
    # refuses (the outside files, and a root's link that leads out of it).
    foreign: list[str]


def classify(text: str, roots: Roots, skip: Sequence[str], work: Path, system: Sequence[str] = ()) -> Deps | None:
    """Sort each file of nvcc's ``-MD`` output (``Deps``); None when the list cannot be read.

    Files named in ``skip`` (the TU, the anchor, ``-include`` files: keyed by content) are not
    placed; system headers (inside ``system``: the host compiler's identity covers them) neither.
    """
    words = _tokens(text)
    if words is None:
        return None
    try:
        start = next(i for i, w in enumerate(words) if w.endswith(":")) + 1
    except StopIteration:
        return None
    placed: list[tuple[str, str]] | None = []
    outside: list[str] = []
    foreign: list[str] = []
    seen: set[tuple[str, str]] = set()
    work_real = os.path.realpath(work)
    for word in words[start:]:
        if word.endswith(":"):
            return None  # a second rule: not what -MD without -MP writes
        real = os.path.realpath(word if os.path.isabs(word) else work / word)
        shown = word if os.path.isabs(word) else f"{word} (= {real})"
        if not _allowed(real, roots, system, work_real) and shown not in foreign:
            foreign.append(shown)
        where = _place(word, roots, skip, work, system, work_real)
        if isinstance(where, tuple) and where and not dep_rel_ok(where[1]):
            where = None  # a spelling the deps file's reader refuses (``inputs``): not placed, no direct entry
        if where == "outside":
            if word not in outside:
                outside.append(word)
        elif where is None:
            placed = None
        elif where and placed is not None and where not in seen:
            assert isinstance(where, tuple)
            seen.add(where)
            placed.append(where)
    return Deps(placed, sorted(outside), foreign)


def parse_deps(text: str, roots: Roots, skip: Sequence[str], work: Path,
               system: Sequence[str] = ()) -> list[tuple[str, str]] | None:
    """(label, path relative to the label's base) of each root file nvcc read (``Deps.placed``)."""
    deps = classify(text, roots, skip, work, system)
    return None if deps is None else deps.placed


def _inside(real: str, top: str) -> bool:
    return real.startswith(top.rstrip("/") + "/")


def _allowed(real: str, roots: Roots, system: Sequence[str], work_real: str) -> bool:
    """Whether the real path ``real`` lies where a sealed compile may read."""
    if real in roots.files:
        return True
    tops = (*roots.base[:-1], *roots.tree, *roots.homes, *system, work_real)  # base[-1]: the toolkit, in homes
    return any(_inside(real, top) for top in tops)


def _place(path: str, roots: Roots, skip: Sequence[str], work: Path, system: Sequence[str] = (),
           work_real: str = "") -> tuple[str, str] | tuple[()] | str | None:
    """(label, relative path) of one dependency; () to leave it out; "outside" for an outside
    file; None when it cannot be placed."""
    while path.startswith("./"):  # found through -I. (the anchor)
        path = path[2:]
    if path in skip:
        return ()
    if not os.path.isabs(path):
        head, _, rest = path.partition("/")
        if head in ("inc", "flagpath"):
            n, _, rest = rest.partition("/")
            head = f"{head}/{n}"
        if head not in roots.labels or not rest or os.path.normpath(rest).startswith(".."):
            return None
        # Kept as nvcc spelled it (a later check opens the same spelling under that host's root),
        # but only if it names the file nvcc read here.
        i = roots.index(head)
        real = os.path.realpath(f"{roots.base[i]}/{rest}")
        if real != os.path.realpath(work / path) or (head == TOOLKIT and not _inside(real, roots.tree[i])):
            return None  # and a toolkit header must lie in the tree whose shape is checked
        return (head, rest)
    # An absolute path (a wrapper nvcc expands its own location): inside a root it is checked
    # like the others; elsewhere it is a system header (the host compiler's identity covers it),
    # a file of the compile directory, or an outside file (keyed by content).
    real = os.path.realpath(path)
    for label, base, tree in zip(roots.labels, roots.base, roots.tree):
        if label == TOOLKIT:
            if _inside(real, tree):  # opened as <root>/include/..., which resolves to the tree
                return (label, "include/" + os.path.relpath(real, tree))
            continue  # elsewhere in the toolkit: refused below, with the nvcc binary's toolkit
        if _inside(real, base) or _inside(real, tree):
            return (label, os.path.relpath(real, base)) if _inside(real, base) else None
    if any(_inside(real, home) for home in roots.homes):
        return None
    if any(_inside(real, d) for d in system) or (work_real and _inside(real, work_real)):
        return ()
    return "outside"


def outside_match(files: Sequence[tuple[str, str]]) -> bool:
    """Whether each (path, xxh3) still names a regular file of that content (streamed, never blocks)."""
    for path, digest in files:
        try:
            if hash_file(path, "xxh3", what="JIT outside file") != digest:
                return False
        except CubinstoreError:
            return False
    return True


def hash_deps(deps: Sequence[tuple[str, str]], roots: Roots) -> list[tuple[str, str, str]] | None:
    """(label, rel, xxh3) of each file; None when one cannot be read, or is not a path below its
    root (``inputs.join_below``: a deps file's paths are a store file's claims, never opened outside)."""
    out = []
    for label, rel in deps:
        path = join_below(roots.base[roots.index(label)], rel) if label in roots.labels else None
        if path is None:
            _log.warning("direct record: %r/%r is not a path below a root of this call; not read", label, rel)
            return None
        try:  # streamed; a FIFO or device put in a file's place is refused, never opened
            out.append((label, rel, hash_file(path, "xxh3")))
        except CubinstoreError as exc:
            _log.debug("direct record: cannot read %s/%s: %s", label, rel, exc)
            return None
    return out


def shapes_of(roots: Roots, local: LocalLayer | None) -> dict[str, Any]:
    return {label: shape(tree, local=local, what=f"JIT root {label}") for label, tree in zip(roots.labels, roots.tree)}


def put_deps(index: JitIndex, key: str, files: list[tuple[str, str, str]], shapes: dict[str, Any],
             seen: _Observed | None = None) -> None:
    """What ``key``'s compile read; written before its index entry (best effort)."""
    try:
        index.put_deps(key, files, {label: s.key for label, s in shapes.items()})
    except CubinstoreError as exc:
        _log.warning("JIT xxh3:%s: cannot keep its dependency list (the full key still finds it): %s", key, exc)


def record(index: JitIndex, dreq: DirectRequest, key: str, files: list[tuple[str, str, str]],
           shapes: dict[str, Any], seen: _Observed | None) -> None:
    """After ``key`` is in the index: the direct entry, then this host's stat cache (``seen``:
    the stats taken before the recorded files were hashed).

    Best effort: a failure leaves the full key as the way in (which lists it again)."""
    try:
        index.add_direct(dreq.key, key)
    except CubinstoreError as exc:
        _log.warning("JIT xxh3:%s: cannot write its direct entry (the full key still finds it): %s", key, exc)
        return
    if seen is not None:
        _save(dreq, key, seen)


def remember(index: JitIndex, dreq: DirectRequest, key: str) -> None:
    """A full-key hit that the direct path missed (its entry lost, killed or damaged, or written
    before this path existed): list the key under the direct key again if its deps are kept."""
    try:
        if key in index.get_direct(dreq.key) or index.get_deps(key) is None:
            return
    except CubinstoreError as exc:  # a deps file naming a path outside its roots: not listed again
        _log.warning("JIT xxh3:%s: not listed under direct key %s: %s", key, dreq.key, exc)
        return
    try:
        index.add_direct(dreq.key, key)
    except CubinstoreError as exc:
        _log.debug("cannot re-add JIT xxh3:%s under direct key %s: %s", key, dreq.key, exc)


# -- the warm path ------------------------------------------------------------------------------------

def _paths(roots: Roots, files: Sequence[tuple[int, str]], probes: Sequence[tuple[int, str]]) -> list[str]:
    return ([f"{roots.base[i]}/{rel}" for i, rel in files]
            + [f"{roots.tree[i]}/{rel}" if rel else roots.tree[i] for i, rel in probes])


def _stats(paths: Sequence[str]) -> list[tuple[int, ...] | None]:
    """The stat facts of each path (links followed), None where missing: a tight loop, this is
    the whole cost of a warm hit."""
    out: list[tuple[int, ...] | None] = []
    append = out.append
    stat_ = os.stat
    for p in paths:
        try:
            st = stat_(p)
        except OSError:
            append(None)
            continue
        append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return out


def _stats_fingerprint(stats: Sequence[tuple[int, ...] | None]) -> str:
    return xxhash.xxh3_128_hexdigest(marshal.dumps(list(stats)))


# In-process memory of checks that passed, like the trees' (``clear_caches`` forgets them).
_passed: dict[str, str] = {}
_passed_lock = threading.Lock()


def clear() -> None:
    with _passed_lock:
        _passed.clear()


@dataclass(frozen=True)
class _Observed:
    """Stats of the recorded files, of every root's probes and of the identities' files, taken
    *before* the files are hashed (git's order): a change after the hash shows in a later stat."""

    files: tuple[tuple[int, str], ...]
    probes: tuple[tuple[int, str], ...]
    ids: tuple[str, ...]
    stats: tuple[tuple[int, ...] | None, ...]


def observe(dreq: DirectRequest, files: Sequence[tuple[str, str] | tuple[str, str, str]],
            shapes: dict[str, Any]) -> _Observed | None:
    """None when a shape or an identity no longer holds (a stat moved since it was taken)."""
    roots = dreq.roots
    id_paths, id_facts = dreq.ids()
    if not id_paths:
        return None
    file_refs = tuple((roots.index(f[0]), f[1]) for f in files)
    probe_refs = tuple((roots.index(label), rel) for label, s in shapes.items() for rel in s.probes)
    stats = tuple(_stats([*_paths(roots, file_refs, probe_refs), *id_paths]))
    at = len(file_refs)
    for s in shapes.values():
        if probe_fingerprint(s.probes, stats[at:at + len(s.probes)]) != s.fingerprint:
            return None
        at += len(s.probes)
    if stats[at:] != id_facts:
        return None
    return _Observed(file_refs, probe_refs, id_paths, stats)


def _save(dreq: DirectRequest, key: str, seen: _Observed) -> None:
    now = time.time_ns()
    # Modified too recently to trust a stat (git's racy entries), or gone: the next process
    # checks content again.
    if any(st is None or now - max(st[3], st[4]) < _jitkey.RACY_NS for st in seen.stats):
        return
    StatCache(dreq.local).put(dreq._stat_name, {
        "fingerprint": _stats_fingerprint(seen.stats), "key": key,
        "files": [list(r) for r in seen.files], "probes": [list(r) for r in seen.probes], "ids": list(seen.ids)})


def _fast(dreq: DirectRequest) -> str | None:
    doc = StatCache(dreq.local).read(dreq._stat_name)
    if doc is None:
        return None
    try:
        files = [(int(i), str(rel)) for i, rel in doc["files"]]
        probes = [(int(i), str(rel)) for i, rel in doc["probes"]]
        ids = [str(p) for p in doc["ids"]]
        key = check_key(doc["key"])
        if ids and _stats_fingerprint(_stats([*_paths(dreq.roots, files, probes), *ids])) == doc["fingerprint"]:
            return key
    except (KeyError, TypeError, ValueError, IndexError):  # BadArgumentError is a ValueError
        pass
    return None


def _check(dreq: DirectRequest, index: JitIndex, key: str) -> bool:
    """Whether ``key``'s recorded files and shapes are what this call's roots hold now."""
    recorded = index.get_deps(key)
    if recorded is None:
        return False
    files, shapes = recorded
    roots = dreq.roots
    if set(shapes) != set(roots.labels) or any(label not in shapes for label, _, _ in files):
        return False
    current = {}
    for label, tree in zip(roots.labels, roots.tree):
        try:
            s = shape(tree, local=dreq.local, what=f"JIT root {label}")
        except CubinstoreError:
            return False
        if s.key != shapes[label]:
            _log.debug("direct %s: root %s has another shape than xxh3:%s's", dreq.key, label, key)
            return False
        current[label] = s
    seen = observe(dreq, files, current)
    if seen is None:
        return False
    now = hash_deps([(label, rel) for label, rel, _ in files], roots)
    if now is None or now != files:
        _log.debug("direct %s: an included file differs from xxh3:%s's", dreq.key, key)
        return False
    _save(dreq, key, seen)
    return True


def lookup(dreq: DirectRequest, index: JitIndex, accept: Callable[[str], bool] | None = None) -> str | None:
    """The key a compile of this request was stored under, by the direct check; None: use the full key.

    ``accept`` (the caller's check of a candidate: its parts, outside files and index entry)
    must also pass; the first candidate that passes both is the answer."""
    name = dreq._stat_name
    ok = accept if accept is not None else (lambda _key: True)
    with _passed_lock:
        known = _passed.get(name)
    if known is not None and ok(known):
        return known
    found = None
    try:
        found = _fast(dreq)
        if found is not None and not ok(found):
            found = None
        if found is None:
            found = next((k for k in index.get_direct(dreq.key) if _check(dreq, index, k) and ok(k)), None)
    except (OSError, CubinstoreError) as exc:  # a cache: any trouble means the full key decides
        _log.debug("direct lookup %s: %s", dreq.key, exc)
    with _passed_lock:
        if found is not None:
            _passed[name] = found
        else:
            _passed.pop(name, None)
    return found


def forget(dreq: DirectRequest) -> None:
    """Drop this process's memory of a check (its key's CUBIN turned out unreadable)."""
    with _passed_lock:
        _passed.pop(dreq._stat_name, None)
