"""The JIT key: xxh3-128 over content only (source, include trees, toolkit, host compiler, flags, arch).

A key never contains an absolute path, a user, a host name or a time, with one exception: a
file the compile read from outside every include root, flag path, the toolkit and the host
compiler's system include directories (an absolute ``#include "/abs/cfg.h"``) is known only
after the compile and is keyed by the path the TU named it by and its content
(``KeyParts.outside``); ``jit.compile`` reports that key. Include trees are
keyed by the relative path and content of every file under them (symlinks followed, so a
symlinked and a copied tree give one key); the toolkit and the host compiler by the
digests of the files that compile. Each tree is hashed once per process; a stat
fingerprint (device, inode, size, mtime, ctime of every file) lets a fresh process reuse the
content hash a previous one computed, as git's index does. Fingerprints are local facts
kept under ``<store>/v1/jit/stat/``: they decide whether to re-read files, never the key.
Everything here is read and written through the local store's descriptor-based file API
(no link inside the store is followed). ``shape`` and ``toolkit_core`` are what the direct key
(``_jitdirect``) checks instead of whole trees.

Files are hashed in 1 MiB chunks (memory independent of their size); anything that is not a
directory or a regular file (a FIFO, socket or device) inside a root, or named by a file flag,
is a ``BadArgumentError`` naming it and is never opened.

``xxhash`` is imported here and only here: ``import cubinstore`` stays standard library only.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import xxhash

from cubinstore._core import knobs as _env
from cubinstore._core.abi import Arch, dumps_canonical, merge_flags
from cubinstore._core.text import show
from cubinstore._core.log import get_logger
from cubinstore._jit.bounded import run_bounded
from cubinstore.errors import BadArgumentError, StoreError

if TYPE_CHECKING:
    from cubinstore.store.local.cas import LocalLayer

__all__ = [
    "ACTION_ENV",
    "unchanged",
    "HostCompiler",
    "JitKey",
    "KeyParts",
    "RACY_NS",
    "SCHEME",
    "Shape",
    "StatCache",
    "Toolkit",
    "ToolkitCore",
    "Tree",
    "clear_caches",
    "find_toolkit",
    "hash_file",
    "host_command",
    "host_compiler",
    "make_key",
    "racy_window",
    "shape",
    "toolkit_core",
    "toolkit_unchanged",
    "tree",
    "xxh3",
]

_log = get_logger(__name__)

# Bumped when the command shape or what the key covers changes, so old entries stop matching.
SCHEME: Final = "cubinstore-jit-v1"
# The environment of the Bazel rule's actions (tools/private/rules/cuda_cubin.bzl).
ACTION_PATH: Final = "/usr/bin:/bin"
ACTION_ENV: Final[Mapping[str, str]] = {"PATH": ACTION_PATH, "LC_ALL": "C"}
# What third_party/cuda/cuda_toolkit.bzl makes the compile actions' inputs.
TOOL_FILES: Final = ("bin/nvcc", "bin/nvcc.profile", "bin/cudafe++", "bin/ptxas", "bin/fatbinary", "nvvm/bin/cicc")
TOOL_TREES: Final = ("nvvm/libdevice", "include")
#: A file modified this close to the fingerprint could change again within the clock's
#: granularity without changing its mtime (git's "racy" entries): never cache those. One value
#: for the key's and the direct key's stat caches (``cubinstore._jit.direct`` reads it here, at
#: call time, so ``racy_window`` changes it for both in this one place).
RACY_NS: int = 2_000_000_000


@contextmanager
def racy_window(ns: int) -> Iterator[None]:
    """Within the block, this process's stat caches trust files modified more than ``ns``
    nanoseconds ago (``RACY_NS`` again after it): a test of the caches, whose files are seconds
    old, passes 0."""
    global RACY_NS
    previous, RACY_NS = RACY_NS, ns
    try:
        yield
    finally:
        RACY_NS = previous


def xxh3(data: bytes) -> str:
    """``xxh3:<32 hex>``: the 128-bit xxh3 of ``data``, the spelling of every JIT key part."""
    return "xxh3:" + xxhash.xxh3_128_hexdigest(data)


# -- trees ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tree:
    """The content of a directory: each file's relative path and content hash."""

    key: str  # xxh3 of the canonical listing
    # relative path (with '/') -> xxh3 or sha256 of the content; None when the stat cache gave
    # the key and the listing stays on disk (``load_tree``) until ``explain`` wants it.
    files: Mapping[str, str] | None = field(repr=False, default=None)
    # Where it was read and its stat fingerprint then: local facts, never keyed, for ``unchanged``.
    root: str = field(default="", compare=False)
    fingerprint: str = field(default="", compare=False)

    @property
    def listing(self) -> bytes:
        if self.files is None:
            raise ValueError(f"tree {self.key}: listing not loaded")
        return _listing_bytes(self.files)


def _listing_bytes(files: Mapping[str, str]) -> bytes:
    return dumps_canonical({"schema": "cubinstore/jit-tree/v1", "files": dict(files)})


def _walk(root: Path, what: str) -> list[tuple[str, str, os.stat_result]]:
    """(relative path, absolute path, stat) of every regular file under ``root``, symlinks followed.

    A directory reached twice through symlinks (a cycle, or two links to one place) is
    listed under its first path only, so a link loop cannot make the walk endless.
    """
    out: list[tuple[str, str, os.stat_result]] = []
    seen: set[tuple[int, int]] = set()
    try:
        st = os.stat(root)
    except OSError as exc:
        raise BadArgumentError(f"{what} {root}: cannot read: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise BadArgumentError(f"{what} {root}: not a directory")
    stack = [("", str(root))]
    seen.add((st.st_dev, st.st_ino))
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            items = list(os.scandir(abs_dir))
        except OSError as exc:
            raise BadArgumentError(f"{what} {root}: cannot list {rel_dir or '.'}: {exc.strerror or exc}") from exc
        for item in items:
            rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
            try:
                st = item.stat(follow_symlinks=True)
            except FileNotFoundError:
                _log.debug("%s %s: skipping dangling link %s", what, root, rel)
                continue
            except OSError as exc:
                raise BadArgumentError(f"{what} {root}: cannot stat {rel}: {exc.strerror or exc}") from exc
            if stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    stack.append((rel, item.path))
            elif stat.S_ISREG(st.st_mode):
                out.append((rel, item.path, st))
            else:
                raise _not_regular(f"{what} {root}: {rel}", st)
    out.sort(key=lambda t: t[0])
    return out


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(what: str, st: os.stat_result) -> BadArgumentError:
    return BadArgumentError(
        f"{what} is {_kind(st)}, expected a regular file or a directory; refused (never opened: "
        "a compile would block on it or read a device)"
    )


def _fingerprint(files: Sequence[tuple[str, str, os.stat_result]]) -> str:
    # marshal is the fastest stable serialisation here; a Python upgrade that changes it
    # only costs one re-hash (the fingerprint is a local cache key, never a JIT key).
    return xxhash.xxh3_128_hexdigest(marshal.dumps(
        [(rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for rel, _, st in files]))


def _is_racy(files: Sequence[tuple[str, str, os.stat_result]]) -> bool:
    now = time.time_ns()
    return any(now - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS for _, _, st in files)


_CHUNK: Final = 1 << 20  # bytes read at a time: keying memory is independent of file sizes


# algo -> (prefix, a fresh streaming hasher)
_HASHERS: Final[Mapping[str, tuple[str, Callable[[], Any]]]] = {
    "xxh3": ("xxh3:", xxhash.xxh3_128), "sha256": ("sha256:", hashlib.sha256),
}


def hash_file(path: str, algo: str = "xxh3", what: str = "file") -> str:
    """``<algo>:<hex>`` of the regular file ``path`` (links followed), read in 1 MiB chunks.

    A FIFO, socket or device is a ``BadArgumentError`` naming it and is never opened (stat
    first; the open is non-blocking and re-checked, so a swap after the stat cannot block
    either). An unreadable file is a ``StoreError``.
    """
    prefix, make = _HASHERS[algo]
    try:
        st = os.stat(path)
    except OSError as exc:
        raise StoreError(f"cannot read {path} to hash it: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(f"{what} {path}", st)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise StoreError(f"cannot read {path} to hash it: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(f"{what} {path}", st)
        h = make()
        while True:
            try:
                chunk = os.read(fd, _CHUNK)
            except OSError as exc:
                raise StoreError(f"cannot read {path} to hash it: {exc.strerror or exc}") from exc
            if not chunk:
                break
            h.update(chunk)
        return prefix + h.hexdigest()
    finally:
        os.close(fd)


def _hash_file(path: str, algo: str) -> str:
    return hash_file(path, algo)


_tree_cache: dict[tuple[str, str], Tree] = {}
_toolkit_cache: dict[str, Toolkit] = {}
_host_cache: dict[str, HostCompiler] = {}
_cache_lock = threading.Lock()


def clear_caches() -> None:
    """Forget every tree, toolkit and host identity hashed in this process (files changed under it).
    The direct key's memory of passed checks is ``cubinstore._jit.direct.clear``'s; the compiler's
    ``clear_caches`` clears both."""
    with _cache_lock:
        _tree_cache.clear()
        _toolkit_cache.clear()
        _core_cache.clear()
        _host_cache.clear()


class StatCache:
    """``<store>/v1/jit/stat/<xxh3 of what>.json``: the last fingerprint of a tree and its listing's key.

    Best effort: an unreadable or stale entry only means the files are hashed again.
    """

    def __init__(self, local: LocalLayer | None) -> None:
        self.local = local

    @staticmethod
    def _name(name: str) -> str:
        return xxhash.xxh3_128_hexdigest(name.encode("utf-8", "surrogateescape")) + ".json"

    def read(self, name: str) -> dict[str, Any] | None:
        if self.local is None:
            return None
        try:
            raw = self.local.read_file(("jit", "stat"), self._name(name), 4 << 20)
            doc = json.loads(raw) if raw else None
        except Exception as exc:  # noqa: BLE001 - a cache, never fatal
            _log.debug("ignoring stat cache entry for %r: %s", name, exc)
            return None
        return doc if isinstance(doc, dict) else None

    def get(self, name: str, fingerprint: str) -> dict[str, Any] | None:
        doc = self.read(name)
        if doc is not None and doc.get("fingerprint") == fingerprint:
            return doc
        return None

    def put(self, name: str, doc: Mapping[str, Any]) -> None:
        if self.local is None:
            return
        try:
            self.local.write_file(("jit", "stat"), self._name(name), json.dumps(dict(doc), sort_keys=True).encode(),
                                  durable=False)
        except StoreError as exc:
            _log.debug("cannot write the stat cache entry for %r: %s", name, exc)


_TREE_KEY_RE: Final = re.compile(r"xxh3:[0-9a-f]{32}", re.ASCII)


def _tree_file(key: str) -> tuple[tuple[str, ...], str]:
    hex_ = key.split(":", 1)[1]
    return ("jit", "trees", hex_[:2]), f"{hex_}.json"


def _has_tree(local: LocalLayer, key: str) -> bool:
    try:
        return local.read_file(*_tree_file(key), 0) is not None
    except Exception:  # noqa: BLE001 - a link or unreadable file: not kept
        return False


def store_tree(local: LocalLayer | None, t: Tree) -> None:
    """Keep a tree's listing (content-addressed, written once) so ``explain`` can diff two trees."""
    if local is None or t.files is None or not t.key.startswith("xxh3:") or _has_tree(local, t.key):
        return
    try:
        local.write_file(*_tree_file(t.key), t.listing, durable=False)
    except StoreError as exc:
        _log.warning("cannot keep the listing of tree %s: %s", t.key, exc)


def load_tree(local: LocalLayer, key: str) -> Tree | None:
    """A stored listing, checked against its key; None when absent or damaged."""
    if not isinstance(key, str) or not _TREE_KEY_RE.fullmatch(key):
        return None
    try:
        raw = local.read_file(*_tree_file(key), 64 << 20)
    except Exception as exc:  # noqa: BLE001 - explain degrades to "listing not kept"
        _log.debug("cannot read tree %s: %s", key, exc)
        return None
    if raw is None or xxh3(raw) != key:
        return None
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        return None
    return Tree(key, files) if isinstance(files, dict) else None


def _known_tree(local: LocalLayer, key: object) -> Tree | None:
    """The tree a stat-cache entry names, if its listing is still kept (not re-read: a fresh
    process pays for a stat walk, not for parsing the listing)."""
    if not isinstance(key, str) or not _TREE_KEY_RE.fullmatch(key):
        return None
    return Tree(key) if _has_tree(local, key) else None


def _tree_from_files(files: Sequence[tuple[str, str, os.stat_result]], algo: str) -> Tree:
    listing = {rel: _hash_file(path, algo) for rel, path, _ in files}
    return Tree(xxh3(_listing_bytes(listing)), listing)


def tree(root: str | os.PathLike[str], *, local: LocalLayer | None = None, algo: str = "xxh3",
         cached: bool = True, what: str = "include root") -> Tree:
    """The content key of the directory ``root`` (computed once per process when ``cached``).

    ``local`` (the store) enables the cross-process stat cache and keeps the listing for
    ``explain``. ``algo="sha256"`` and ``cached=False`` exist for the benchmark.
    """
    if algo not in _HASHERS:
        raise BadArgumentError(f"tree hash: expected one of {', '.join(_HASHERS)}, got {show(algo)}")
    real = os.path.realpath(root)
    if cached:
        with _cache_lock:
            hit = _tree_cache.get((real, algo))
        if hit is not None:
            return hit
    files = _walk(Path(real), what)
    result: Tree | None = None
    stat_cache = StatCache(local if cached and algo == "xxh3" else None)
    fingerprint = _fingerprint(files)
    doc = stat_cache.get(f"tree\0{real}", fingerprint) if stat_cache.local is not None else None
    if doc is not None and local is not None:
        result = _known_tree(local, doc.get("tree"))
    if result is None:
        result = _tree_from_files(files, algo)
        if stat_cache.local is not None:
            store_tree(local, result)
            if not _is_racy(files):
                stat_cache.put(f"tree\0{real}", {"fingerprint": fingerprint, "tree": result.key})
    result = replace(result, root=real, fingerprint=fingerprint)
    if cached:
        with _cache_lock:
            _tree_cache[(real, algo)] = result
    return result


def unchanged(t: Tree) -> bool:
    """Whether the directory ``t`` was read from still has the files (by stat) it had then."""
    try:
        return _fingerprint(_walk(Path(t.root), "include root")) == t.fingerprint
    except BadArgumentError:
        return False


# -- the shape of a tree (the direct key's check) --------------------------------------------------

_SHAPE_TAG: Final = b"cubinstore/jit-shape/v1\0"


@dataclass(frozen=True)
class Shape:
    """Which regular files a directory holds (relative paths, no content): everything the
    preprocessor's include search and ``__has_include`` can observe besides the bytes of the
    files it opens. ``key`` is content only; ``probes`` (the root, every directory and every
    link, relative) and ``fingerprint`` (their stats) are local facts: a name added, removed
    or retargeted changes the stat of the directory holding it, the check git's untracked
    cache relies on."""

    key: str
    probes: tuple[str, ...] = field(repr=False, default=())
    fingerprint: str = field(default="", compare=False)


def _light_walk(root: str, what: str) -> tuple[list[str], list[tuple[str, os.stat_result | None]]]:
    """The relative paths ``_walk`` lists, in its traversal order (so a directory reached twice
    is listed under the same first path), statting only directories and links."""
    files: list[str] = []
    probes: list[tuple[str, os.stat_result | None]] = []
    try:
        st = os.stat(root)
    except OSError as exc:
        raise BadArgumentError(f"{what} {root}: cannot read: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise BadArgumentError(f"{what} {root}: not a directory")
    probes.append(("", st))
    seen = {(st.st_dev, st.st_ino)}
    stack = [("", root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            items = list(os.scandir(abs_dir))
        except OSError as exc:
            raise BadArgumentError(f"{what} {root}: cannot list {rel_dir or '.'}: {exc.strerror or exc}") from exc
        for item in items:
            rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
            try:
                link = item.is_symlink()
                if not link and not item.is_dir(follow_symlinks=False):
                    if not item.is_file(follow_symlinks=False):  # a FIFO, socket or device: as _walk
                        raise _not_regular(f"{what} {root}: {rel}", item.stat(follow_symlinks=False))
                    files.append(rel)
                    continue
                st = item.stat(follow_symlinks=True)
            except FileNotFoundError:
                probes.append((rel, None))  # a dangling link: its target may appear later
                continue
            except OSError as exc:
                raise BadArgumentError(f"{what} {root}: cannot stat {rel}: {exc.strerror or exc}") from exc
            if stat.S_ISDIR(st.st_mode):
                probes.append((rel, st))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    stack.append((rel, item.path))
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise _not_regular(f"{what} {root}: {rel}", st)
                probes.append((rel, st))
                files.append(rel)
    return files, probes


def stat_facts(st: os.stat_result | None) -> tuple[int, ...] | None:
    """What a stat fingerprint compares: device, inode, size, mtime, ctime (None: missing)."""
    return None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def probe_fingerprint(rels: Sequence[str], facts: Sequence[tuple[int, ...] | None]) -> str:
    return xxhash.xxh3_128_hexdigest(marshal.dumps([(rel,) if f is None else (rel, *f) for rel, f in zip(rels, facts)]))


def _probe_fingerprint(probes: Sequence[tuple[str, os.stat_result | None]]) -> str:
    return probe_fingerprint([rel for rel, _ in probes], [stat_facts(st) for _, st in probes])


def stat_probes(root: str, rels: Iterable[str]) -> list[tuple[str, os.stat_result | None]]:
    """``os.stat`` (links followed) of ``root/rel`` for each ``rel``; None where it is missing."""
    out: list[tuple[str, os.stat_result | None]] = []
    for rel in rels:
        try:
            out.append((rel, os.stat(f"{root}/{rel}" if rel else root)))
        except OSError:
            out.append((rel, None))
    return out


def shape_key(files: Iterable[str]) -> str:
    return xxh3(_SHAPE_TAG + "\0".join(sorted(files)).encode("utf-8", "surrogateescape"))


def shape(root: str, *, local: LocalLayer | None = None, what: str = "include root") -> Shape:
    """The shape of the directory ``root`` (a real path). With ``local``, a fresh process that
    finds every probe's stat unchanged reuses the key without listing a directory."""
    stat_cache = StatCache(local)
    name = f"shape\0{root}"
    doc = stat_cache.read(name)
    if doc is not None:
        probes = doc.get("probes")
        key = doc.get("shape")
        if isinstance(probes, list) and all(isinstance(p, str) for p in probes) and isinstance(key, str):
            fingerprint = _probe_fingerprint(stat_probes(root, probes))
            if fingerprint == doc.get("fingerprint"):
                return Shape(key, tuple(probes), fingerprint)
    files, found = _light_walk(root, what)
    result = Shape(shape_key(files), tuple(rel for rel, _ in found), _probe_fingerprint(found))
    if not _probes_racy(found):
        stat_cache.put(name, {"fingerprint": result.fingerprint, "shape": result.key, "probes": list(result.probes)})
    return result


def _probes_racy(probes: Iterable[tuple[str, os.stat_result | None]]) -> bool:
    now = time.time_ns()
    return any(st is not None and now - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS for _, st in probes)


# -- the toolkit ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Toolkit:
    """The CUDA toolkit the JIT compiles with: where it is (never keyed) and what it is (keyed)."""

    root: Path  # resolved; used to run nvcc, never part of a key
    source: str  # which search step found it, e.g. "$CUDA_PATH"
    version: str  # e.g. "13.0.88"
    files: Tree  # the files that compile, by relative path
    fingerprint: str = field(default="", compare=False)  # stat fingerprint of those files when keyed

    @property
    def identity(self) -> dict[str, str]:
        return {"version": self.version, "files": self.files.key}


def _is_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").is_file() and (root / "nvvm" / "bin" / "cicc").is_file()


def locate_toolkit() -> tuple[Path, str]:
    """The toolkit root, searched like ``third_party/cuda/cuda_toolkit.bzl``: $CUDA_PATH, $CUDA_HOME,
    /usr/local/cuda, the toolkit of nvcc on $PATH. Raises ``BadArgumentError`` listing what was tried."""
    tried: list[str] = []

    def candidates() -> Iterator[tuple[str | None, str]]:
        for name, value in (("CUDA_PATH", _env.cuda_path()), ("CUDA_HOME", _env.cuda_home())):
            yield (str(value), f"${name}") if value else (None, f"${name} (unset)")
        yield "/usr/local/cuda", "default location"
        nvcc = _env.which("nvcc")  # searched only when the others fail: a warm hit asks on every call
        if nvcc:
            yield str(Path(os.path.realpath(nvcc)).parent.parent), "nvcc on $PATH"
        else:
            yield None, "nvcc on $PATH (not found)"

    for root, source in candidates():
        if root is None:
            tried.append(source)
            continue
        if _is_toolkit(Path(root)):
            return Path(os.path.realpath(root)), source
        tried.append(f"{root} from {source} (no bin/nvcc and nvvm/bin/cicc)")
    raise BadArgumentError(
        f"no CUDA toolkit found for the JIT. Tried, in order: {'; '.join(tried)}. Set CUDA_PATH to the toolkit's root."
    )


_VERSION_RE: Final = re.compile(r"release [0-9.]+, V([0-9][0-9.]*)")


_TOOL_TIMEOUT: Final = 60.0  # seconds for `nvcc --version`, `gcc -v` and the like
_MAX_TOOL_OUTPUT: Final = 1 << 20  # bytes each of their streams may print (a few KiB is what they do)


def _run_tool(argv: Sequence[str], what: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a toolchain program asked about itself, in ``ACTION_ENV``,
    within ``_TOOL_TIMEOUT`` and ``_MAX_TOOL_OUTPUT`` (``run_bounded``); past either, or when it
    cannot run, a ``BadArgumentError`` naming ``what`` and the command."""
    command = " ".join(argv)
    try:
        status, out, err = run_bounded(list(argv), b"", _TOOL_TIMEOUT, _MAX_TOOL_OUTPUT, env=ACTION_ENV)
    except TimeoutError:  # before OSError, of which it is one
        raise BadArgumentError(f"{what}: {command} ran past {_TOOL_TIMEOUT:g} s and was killed") from None
    except OverflowError:
        raise BadArgumentError(f"{what}: {command} printed over {_MAX_TOOL_OUTPUT} bytes and was killed") from None
    except OSError as exc:
        raise BadArgumentError(f"{what}: cannot run {command}: {exc}") from exc
    return status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _run_checked(argv: Sequence[str], what: str) -> str:
    status, out, err = _run_tool(argv, what)
    if status != 0:
        raise BadArgumentError(f"{what}: {' '.join(argv)} exited with {status}: {(err or out).strip()[:500]}")
    return out


def _tool_programs(root: Path) -> list[tuple[str, str, os.stat_result]]:
    files: list[tuple[str, str, os.stat_result]] = []
    for rel in TOOL_FILES:
        path = root / rel
        try:
            files.append((rel, str(path), os.stat(path)))
        except FileNotFoundError:
            continue  # e.g. no fatbinary in a trimmed toolkit: nvcc -cubin does not run it
    return files


def _tool_files(root: Path, trees: Iterable[str]) -> list[tuple[str, str, os.stat_result]]:
    """The toolkit's programs and every file of the `trees` present, by root-relative path."""
    files = _tool_programs(root)
    for sub in trees:
        if (root / sub).is_dir():
            files.extend((f"{sub}/{rel}", path, st) for rel, path, st in _walk(root / sub, "CUDA toolkit"))
    files.sort(key=lambda t: t[0])
    return files


def _toolkit_files(root: Path) -> list[tuple[str, str, os.stat_result]]:
    return _tool_files(root, TOOL_TREES)


def find_toolkit(*, local: LocalLayer | None = None) -> Toolkit:
    """The toolkit and its identity, once per process (and once per machine with ``local``)."""
    root, source = locate_toolkit()
    with _cache_lock:
        hit = _toolkit_cache.get(str(root))
    if hit is not None:
        return hit
    files = _toolkit_files(root)
    stat_cache = StatCache(local)
    fingerprint = _fingerprint(files)
    doc = stat_cache.get(f"toolkit\0{root}", fingerprint)
    listing = _known_tree(local, doc.get("files")) if doc is not None and local is not None else None
    version = str(doc.get("version", "")) if doc is not None else ""
    if listing is None or not version:
        out = _run_checked([str(root / "bin" / "nvcc"), "--version"], "CUDA toolkit")
        match = _VERSION_RE.search(out)
        if match is None:
            raise BadArgumentError(f"CUDA toolkit: cannot read a version from `nvcc --version`: {out.strip()[-200:]}")
        version = match.group(1)
        listing = _tree_from_files(files, "xxh3")
        store_tree(local, listing)
        if not _is_racy(files):
            stat_cache.put(f"toolkit\0{root}", {"fingerprint": fingerprint, "files": listing.key, "version": version})
    toolkit = Toolkit(root, source, version, listing, fingerprint)
    with _cache_lock:
        _toolkit_cache[str(root)] = toolkit
    return toolkit


def toolkit_unchanged(toolkit: Toolkit) -> bool:
    """Whether the toolkit's files still have the stats they had when ``toolkit`` was keyed."""
    try:
        return _fingerprint(_toolkit_files(toolkit.root)) == toolkit.fingerprint
    except (BadArgumentError, OSError):
        return False


@dataclass(frozen=True)
class ToolkitCore:
    """The toolkit's programs (nvcc, its profile, cudafe++, cicc, ptxas, fatbinary) and libdevice:
    what the direct key holds instead of the whole include tree, whose files the direct check
    covers one by one (the headers the TU included) and by shape (the rest)."""

    root: Path  # resolved; never keyed
    version: str
    binaries: str  # xxh3 of the listing of those files
    # The stats the identity was taken at (local facts, never keyed): the programs (None: absent),
    # libdevice's directory and files. The direct path's stat check covers them too.
    id_paths: tuple[str, ...] = field(default=(), compare=False, repr=False)
    id_facts: tuple[tuple[int, ...] | None, ...] = field(default=(), compare=False, repr=False)

    @property
    def identity(self) -> dict[str, str]:
        return {"version": self.version, "binaries": self.binaries}


_core_cache: dict[str, ToolkitCore] = {}


def _core_files(root: Path) -> list[tuple[str, str, os.stat_result]]:
    return _tool_files(root, ("nvvm/libdevice",))


def toolkit_core(*, local: LocalLayer | None = None) -> ToolkitCore:
    """The toolkit's programs and their identity, once per process (and per machine with ``local``)."""
    root, _ = locate_toolkit()
    with _cache_lock:
        hit = _core_cache.get(str(root))
    if hit is not None:
        return hit
    lib = str(root / "nvvm" / "libdevice")
    try:
        lib_facts = stat_facts(os.stat(lib))  # before its listing: a file added later moves it
    except OSError:
        lib_facts = None
    files = _core_files(root)
    fingerprint = _fingerprint(files)
    absent = [str(root / rel) for rel in TOOL_FILES if not any(f == rel for f, _, _ in files)]
    id_paths = (*(p for _, p, _ in files), *absent, lib)
    id_facts = (*(stat_facts(st) for _, _, st in files), *(None for _ in absent), lib_facts)
    stat_cache = StatCache(local)
    doc = stat_cache.get(f"toolkit-core\0{root}", fingerprint)
    version = doc.get("version") if doc is not None else None
    binaries = doc.get("binaries") if doc is not None else None
    if not (isinstance(version, str) and version and isinstance(binaries, str) and _TREE_KEY_RE.fullmatch(binaries)):
        out = _run_checked([str(root / "bin" / "nvcc"), "--version"], "CUDA toolkit")
        match = _VERSION_RE.search(out)
        if match is None:
            raise BadArgumentError(f"CUDA toolkit: cannot read a version from `nvcc --version`: {out.strip()[-200:]}")
        version = match.group(1)
        binaries = _tree_from_files(files, "xxh3").key
        if not _is_racy(files):
            stat_cache.put(f"toolkit-core\0{root}", {"fingerprint": fingerprint, "binaries": binaries, "version": version})
    core = ToolkitCore(root, version, binaries, id_paths, id_facts)
    with _cache_lock:
        _core_cache[str(root)] = core
    return core


# -- the host compiler ----------------------------------------------------------------------------

@dataclass(frozen=True)
class HostCompiler:
    """The compiler nvcc preprocesses and compiles host code with (``-ccbin``)."""

    name: str  # the command name on /usr/bin:/bin, what -ccbin gets
    identity: str  # the text third_party/cuda writes to host_compiler.id
    # The binary and cc1plus, and their stats when the identity was taken (local facts).
    id_paths: tuple[str, ...] = field(default=(), compare=False, repr=False)
    id_facts: tuple[tuple[int, ...] | None, ...] = field(default=(), compare=False, repr=False)
    # Its own system include directories (real paths; ``<cc> -E -v -x c++ /dev/null``): the
    # headers there are covered by the identity, never keyed one by one. Local facts.
    system_dirs: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def summary(self) -> str:
        version = self.identity.split("version:\n", 1)[-1].strip().splitlines()
        return f"{self.name}: {version[0] if version else '?'}"


def _stat_sig(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def host_command() -> tuple[str, str]:
    """``$CUBINSTORE_HOST_CC`` (default gcc) and the binary it names on /usr/bin:/bin (resolved)."""
    name = _env.host_cc()
    if not name or "/" in name:
        raise BadArgumentError(f"CUBINSTORE_HOST_CC must be a command name on {ACTION_PATH}, got {show(name)}")
    binary = next((os.path.realpath(p) for d in ACTION_PATH.split(":") if os.path.isfile(p := os.path.join(d, name))), None)
    if binary is None:
        raise BadArgumentError(f"host compiler {show(name)} (CUBINSTORE_HOST_CC) not found on {ACTION_PATH}")
    return name, binary


def _facts_of(path: str) -> tuple[int, ...] | None:
    try:
        return stat_facts(os.stat(path))
    except OSError:
        return None


_SEARCH_START: Final = "#include <...> search starts here:"
_SEARCH_END: Final = "End of search list."


def system_include_dirs(binary: str) -> tuple[str, ...]:
    """The host compiler's own C++ system include directories (real paths), as ``-E -v`` lists them."""
    argv = [binary, "-E", "-v", "-x", "c++", "/dev/null"]
    status, _, stderr = _run_tool(argv, "host compiler")
    lines = stderr.splitlines()
    if status != 0 or _SEARCH_START not in lines or _SEARCH_END not in lines:
        raise BadArgumentError(
            f"host compiler: {' '.join(argv)} (exit {status}) printed no include search list: {stderr.strip()[-300:]}"
        )
    listed = lines[lines.index(_SEARCH_START) + 1:lines.index(_SEARCH_END)]
    dirs = []
    for line in listed:
        d = line.strip().removesuffix(" (framework directory)")
        if os.path.isabs(d) and os.path.isdir(d):
            dirs.append(os.path.realpath(d))
    return tuple(dict.fromkeys(dirs))


def _cached_dirs(doc: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    dirs = doc.get("system_dirs") if doc is not None else None
    if isinstance(dirs, list) and all(isinstance(d, str) and os.path.isabs(d) for d in dirs):
        return tuple(dirs)
    return None


def host_compiler(*, local: LocalLayer | None = None) -> HostCompiler:
    """``$CUBINSTORE_HOST_CC`` (default gcc) on /usr/bin:/bin and its identity, like the repository rule."""
    name = _env.host_cc()
    if not name or "/" in name:
        raise BadArgumentError(f"CUBINSTORE_HOST_CC must be a command name on {ACTION_PATH}, got {show(name)}")
    with _cache_lock:
        hit = _host_cache.get(name)
    if hit is not None:
        return hit
    name, binary = host_command()
    stat_cache = StatCache(local)
    cache_name = f"host\0{name}\0{binary}"
    id_paths: tuple[str, ...] = (binary,)
    id_facts: tuple[tuple[int, ...] | None, ...] = (_facts_of(binary),)
    sig = _stat_sig(binary)
    identity = None
    doc = stat_cache.get(cache_name, sig)
    system_dirs = _cached_dirs(doc)
    if doc is not None and system_dirs is not None:  # an entry without them (older) is taken again
        front = doc.get("cc1plus")
        try:
            if front is None or (isinstance(front, list) and _stat_sig(front[0]) == front[1]):
                identity = doc.get("identity")
                if front is not None:
                    id_paths, id_facts = (binary, front[0]), (id_facts[0], _facts_of(front[0]))
        except OSError:
            identity = None
    if not isinstance(identity, str):
        id_paths, id_facts = (binary,), (_facts_of(binary),)
        lines = [f"name: {name}", f"sha256: {_hash_file(binary, 'sha256').split(':', 1)[1]}"]
        front_end = _run_checked([binary, "-print-prog-name=cc1plus"], "host compiler").strip()
        front_doc = None
        if front_end.startswith("/") and os.path.exists(front_end):
            real_front = os.path.realpath(front_end)
            front_facts = _facts_of(real_front)  # before its content is read
            lines.append(f"cc1plus sha256: {_hash_file(real_front, 'sha256').split(':', 1)[1]}")
            front_doc = [real_front, _stat_sig(real_front)]
            id_paths, id_facts = (binary, real_front), (id_facts[0], front_facts)
        lines.append("version:")
        lines.append(_run_checked([binary, "--version"], "host compiler"))
        identity = "\n".join(lines)
        system_dirs = system_include_dirs(binary)
        stat_cache.put(cache_name, {"fingerprint": sig, "cc1plus": front_doc, "identity": identity,
                                    "system_dirs": list(system_dirs)})
    assert system_dirs is not None
    host = HostCompiler(name, identity, id_paths, id_facts, system_dirs)
    with _cache_lock:
        _host_cache[name] = host
    return host


# -- flags ----------------------------------------------------------------------------------------

# The command line sets these itself; a caller's copy would change what is compiled or where it goes.
_RESERVED: Final = (
    "-o", "--output-file", "-arch", "--gpu-architecture", "-code", "--gpu-code", "-gencode", "--generate-code",
    "-ccbin", "--compiler-bindir", "-cubin", "--cubin", "-ptx", "--ptx", "-fatbin", "--fatbin", "-c", "--compile",
    "-E", "--preprocess", "-M", "-MM", "-MD", "-MMD", "-MF", "--dryrun", "-dryrun", "-keep", "--keep",
    "-keep-dir", "--keep-dir", "-odir", "--output-directory", "-run", "--run", "-lib", "-link", "--link",
)
# Options that take a path (to a directory, or a file for the -include forms); longest first, so
# "-isystem/x" is not read as "-I" + "system/x".
_PATH_OPTIONS: Final = ("--include-path", "--system-include", "--pre-include", "-isystem", "-include", "-I")
_GLUED: Final = frozenset({"-isystem", "-include", "-I"})  # also spelled with the path attached: -I/x
_DIR_OPTIONS: Final = frozenset({"-I", "-isystem", "--include-path", "--system-include"})


@dataclass(frozen=True)
class FlagPath:
    """An absolute path a flag names, and the relative name the compile uses for it."""

    option: str
    path: str  # absolute, as given
    is_dir: bool
    key: str  # tree key or file content key
    tree: Tree | None = None  # for a directory


@dataclass(frozen=True)
class Flags:
    """The caller's flags split into what the key sees and what the compile runs."""

    keyed: tuple[str, ...]  # merged defaults + flags, each path replaced by {tree:...}/{file:...}
    command: tuple[str, ...]  # the same, each path replaced by its relative name in the compile dir
    paths: tuple[FlagPath, ...]  # paths[i] is compiled as flagpath/<i>


def _path_option(flag: str) -> str | None:
    for o in _PATH_OPTIONS:
        if flag == o or flag.startswith(o + "=") or (o in _GLUED and flag.startswith(o)):
            return o
    return None


def _option_of(flag: str) -> str:
    return flag.split("=", 1)[0]


def normalize_flags(flags: Sequence[str], *, local: LocalLayer | None, key_dirs: bool = True) -> Flags:
    """Check the caller's flags and replace every absolute path by the content key of what it names.

    Raises ``BadArgumentError`` naming the flag for a reserved option (the JIT sets it), a
    relative path (it would be resolved against a temp directory) or an absolute path
    anywhere the JIT cannot key it. ``key_dirs=False`` (the direct key) leaves directories
    unhashed: their marker is ``{dir}`` and their content is checked file by file instead.
    """
    if isinstance(flags, (str, bytes)):
        raise BadArgumentError(f"flags: expected a sequence of strings, got the single string {show(flags)}")
    items = list(flags)
    for f in items:
        if not isinstance(f, str) or not f or "\0" in f or "\n" in f:
            raise BadArgumentError(f"flags: expected non-empty strings without NUL or newline, got {show(f)}")
    keyed: list[str] = []
    command: list[str] = []
    paths: list[FlagPath] = []
    i = 0
    merged = merge_flags(items)
    while i < len(merged):
        flag = merged[i]
        option = _option_of(flag)
        if option in _RESERVED or option.startswith("-M"):
            raise BadArgumentError(f"flag {show(flag)}: the JIT sets {option} itself; remove it (arch goes in arch=)")
        opt = _path_option(flag)
        if opt is not None:
            if flag == opt:
                if i + 1 >= len(merged):
                    raise BadArgumentError(f"flag {show(flag)}: expects a path after it")
                value, spelled, i = merged[i + 1], (opt,), i + 2
            else:
                value = flag[len(opt) + 1:] if flag.startswith(opt + "=") and opt not in _GLUED else flag[len(opt):]
                spelled, i = (), i + 1
            if not os.path.isabs(value):
                raise BadArgumentError(
                    f"flag {show(flag)}: {show(value)} is relative; JIT paths must be absolute (they are keyed by content)"
                )
            is_dir = opt in _DIR_OPTIONS
            named: Tree | None = None
            if is_dir and not key_dirs:
                if not os.path.isdir(value):
                    raise BadArgumentError(f"flag {opt} {value}: not a directory")
                key = ""
            elif is_dir:
                named = tree(value, local=local, what=f"flag {opt}")
                key = named.key
            else:
                if not os.path.isfile(value):
                    raise BadArgumentError(f"flag {show(flag)}: {value} is not a file")
                key = hash_file(value, "xxh3", what=f"flag {opt}")
            paths.append(FlagPath(opt, value, is_dir, key, named))
            rel = f"flagpath/{len(paths) - 1}"
            marker = ("{tree:" + key + "}" if key else "{dir}") if is_dir else "{file:" + key + "}"
            if spelled:
                keyed.extend([opt, marker])
                command.extend([opt, rel])
            else:
                sep = "=" if flag.startswith(opt + "=") and opt not in _GLUED else ""
                keyed.append(f"{opt}{sep}{marker}")
                command.append(f"{opt}{sep}{rel}")
            continue
        if flag.startswith("/") or "=/" in flag or ":/" in flag:
            raise BadArgumentError(
                f"flag {show(flag)} holds an absolute path the JIT cannot key by content; "
                "pass include directories in include_dirs or as -I/-isystem"
            )
        keyed.append(flag)
        command.append(flag)
        i += 1
    return Flags(tuple(keyed), tuple(command), tuple(paths))


# -- the key --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyParts:
    """Everything the key covers, each part a content hash or a value: never a path, user, host or time."""

    scheme: str
    source: str  # xxh3 of the TU text
    source_name: str  # the TU's relative name in the compile dir (salts anonymous-namespace symbols)
    includes: tuple[str, ...]  # tree key of each include root, in -I order
    flags: tuple[str, ...]  # Flags.keyed
    arch: str
    toolkit: Mapping[str, str]  # version, files (tree key)
    host: Mapping[str, str]  # name, identity (host_compiler.id text)
    # (absolute path as the compile named it, xxh3) of each file it read outside every root,
    # flag path, the toolkit and the host compiler's system include directories, sorted.
    # Known only after a compile: the key before it (``base``) has none. Absent from the JSON
    # when empty, so a key of a TU that reads no such file is what it always was.
    outside: tuple[tuple[str, str], ...] = ()
    # What nvcc writes: "cubin" (what every release and family holds), or "ptx" / "fatbin" for a
    # cubinstore-nvcc call asking for them. Absent from the JSON for a CUBIN, so those keys are unchanged.
    kind: str = "cubin"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "scheme": self.scheme, "source": self.source, "source_name": self.source_name,
            "includes": list(self.includes), "flags": list(self.flags), "arch": self.arch,
            "toolkit": dict(self.toolkit), "host": dict(self.host),
        }
        if self.outside:
            doc["outside"] = [list(f) for f in self.outside]
        if self.kind != "cubin":
            doc["kind"] = self.kind
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> KeyParts:
        outside = doc.get("outside", [])
        if not isinstance(outside, list) or not all(
                isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f) for f in outside):
            raise ValueError(f"outside: expected a list of [path, xxh3] pairs, got {show(outside)}")
        return cls(
            scheme=str(doc["scheme"]), source=str(doc["source"]), source_name=str(doc["source_name"]),
            includes=tuple(str(x) for x in doc["includes"]), flags=tuple(str(x) for x in doc["flags"]),
            arch=str(doc["arch"]), toolkit={str(k): str(v) for k, v in doc["toolkit"].items()},
            host={str(k): str(v) for k, v in doc["host"].items()},
            outside=tuple((a, b) for a, b in outside), kind=_output_kind(doc.get("kind", "cubin")),
        )

    @property
    def base(self) -> KeyParts:
        """These parts without the outside files: the key a call computes before compiling."""
        return replace(self, outside=()) if self.outside else self


@dataclass(frozen=True)
class JitKey:
    """A JIT key: ``hex`` (32 hex, xxh3-128 of the canonical parts) and the parts it was made of."""

    hex: str
    parts: KeyParts

    def __str__(self) -> str:
        return "xxh3:" + self.hex


#: What a compile may write: nvcc's -cubin, -ptx or -fatbin.
OUTPUT_KINDS: Final = ("cubin", "ptx", "fatbin")


def _output_kind(kind: object) -> str:
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(OUTPUT_KINDS)}, got {show(kind)}")
    return str(kind)


def make_key(parts: KeyParts) -> JitKey:
    return JitKey(xxhash.xxh3_128_hexdigest(dumps_canonical(parts.to_json())), parts)


def key_parts(source_text: str, source_name: str, include_trees: Iterable[Tree], flags: Flags, arch: Arch,
              toolkit: Toolkit, host: HostCompiler, program: str | None = None, kind: str = "cubin") -> KeyParts:
    """The parts of one call's key. ``program``: the content key of the nvcc program run when it is
    not the toolkit's own (``cubinstore-nvcc`` under ``CUBINSTORE_NVCC``), kept with the toolkit's identity."""
    return KeyParts(
        scheme=SCHEME,
        source=xxh3(source_text.encode("utf-8", "surrogateescape")),
        source_name=source_name,
        includes=tuple(t.key for t in include_trees),
        flags=flags.keyed,
        arch=str(arch),
        toolkit=toolkit.identity if program is None else {**toolkit.identity, "program": program},
        host={"name": host.name, "identity": host.identity},
        kind=_output_kind(kind),
    )
