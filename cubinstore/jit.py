"""Run-time compilation under a content key: a kernel library's generated TU, compiled once.

    from cubinstore import jit
    k = jit.compile(tu_text, include_dirs=[f"{site}/deep_gemm/include"], flags=["-DN=4096"],
                    entries={"axpy_f32": ["i32", "f32", "ptr", "ptr"]})
    k.compiled, k.key, k.digest        # whether this call ran nvcc; xxh3:<key>; sha256:<CUBIN>
    k.launch("axpy_f32", grid=..., block=..., args=...)   # like lib.kernel(...).launch

The key (``cubinstore._jitkey``) covers content only, so a second install of the same
library at another prefix, a relocated container or a fresh process hits. A warm call first
tries the direct key (``cubinstore._jitdirect``): only the files an earlier compile of the
same TU included, and the shape of each root, are checked, so it needs no walk of the trees;
``k.found_by`` says whether the direct key, the full key or a compile found it. The CUBIN is an
ordinary blob of the local CAS (by sha256); ``<store>/v1/jit/index`` maps key -> digest.
nvcc runs with the Bazel rule's command shape and environment in a private directory under
the store's root in which every path is relative, so nvcc's messages and the CUBIN carry no
absolute path. N processes missing one key compile it once (a per-key lock and a re-check);
a compile killed at any point leaves no index entry. Every compile is recorded in the warm
set (``cubinstore warmset export`` turns it into Bazel targets for the next release).

Needs the ``jit`` extra (``xxhash``); ``import cubinstore`` does not import this module.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from cubinstore import _env, _jitkey
from cubinstore._abi import Arch, CubinImage, module_anchor, param_layout, param_type
from cubinstore._digest import Digest, show
from cubinstore._jitdirect import (
    DEPS_NAME,
    DirectRequest,
    forget,
    hash_deps,
    lookup,
    observe,
    parse_deps,
    put_deps,
    record,
    remember,
    shapes_of,
)
from cubinstore._jitindex import IndexEntry, JitIndex
from cubinstore._jitkey import (
    ACTION_ENV,
    Flags,
    HostCompiler,
    JitKey,
    Toolkit,
    find_toolkit,
    host_compiler,
    key_parts,
    make_key,
    normalize_flags,
    toolkit_unchanged,
    tree,
    unchanged,
    xxh3,
)
from cubinstore._log import get_logger
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    IntegrityError,
    JitCompileError,
    KernelNotFoundError,
    MissingBlobError,
    RemoteUnavailableError,
    StoreError,
)

if TYPE_CHECKING:
    from cubinstore.launch import Kernel, Library
    from cubinstore.manifest import KernelSpec
    from cubinstore.store import Store

__all__ = ["FamilyTemplate", "JitKernel", "clear_caches", "compile", "compile_family_point", "key", "resolve_miss"]

_log = get_logger(__name__)

# The TU's name in the compile directory: part of the key (it salts anonymous-namespace
# symbols through --orig_src_path_name and names the module anchor).
SOURCE_NAME: Final = "cubinstore_jit.cu"
ANCHOR_NAME: Final = "cubinstore_jit.anchor.h"
OUTPUT_NAME: Final = "cubinstore_jit.cubin"
_MAX_STDERR: Final = 16000


class JitKernel:
    """The result of ``compile``: a CUBIN in the store, launchable like ``Library.kernel``'s ``Kernel``."""

    def __init__(self, key: JitKey, entry: IndexEntry, entries: Mapping[str, Sequence[str]] | None,
                 compiled: bool, store: Store, compile_seconds: float, found_by: str = "compile") -> None:
        self.key = key
        self.digest: Digest = entry.digest
        self.size = entry.size
        self.arch = entry.arch
        self.kernels: tuple[str, ...] = entry.kernels  # every __global__ symbol of the CUBIN
        self.entries: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (entries or {}).items()}
        self.compiled = compiled  # this call ran nvcc (False: an index hit, or another process compiled it)
        self.compile_seconds = compile_seconds
        # "direct": the included files checked (``_jitdirect``); "key": the full key; "compile": nvcc ran.
        self.found_by = found_by
        self._store = store
        self._library: Library | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JitKernel({self.key}, {self.digest.short}, {self.arch}, compiled={self.compiled})"

    @property
    def spec(self) -> KernelSpec:
        """The manifest entry this CUBIN would have: id ``jit/<key>/<arch>``."""
        return self.library().manifest.kernels[0]

    def library(self) -> Library:
        """A one-kernel ``Library`` over this CUBIN (what ``kernel`` and ``launch`` load through)."""
        from cubinstore.launch import Library
        from cubinstore.manifest import KernelSpec, Manifest

        with self._lock:
            if self._library is None:
                if not self.entries:
                    raise BadArgumentError(
                        f"JIT kernel {self.key} ({', '.join(self.kernels)}): pass entries={{symbol: [types]}} "
                        "to compile() to launch it"
                    )
                spec = KernelSpec(
                    id=f"jit/{self.key.hex}/{self.arch}", family="jit", params={"key": self.key.hex},
                    arch=self.arch, digest=self.digest, size=self.size, entries=self.entries,
                    target=f"//jit:k{self.key.hex}",
                )
                self._library = Library(Manifest.build([spec], source=f"JIT {self.key}"), self._store)
            return self._library

    def kernel(self, device: Any = None) -> Kernel:
        """The loaded ``Kernel`` on ``device`` (an ordinal, torch/cuda.core device, or None: current)."""
        return self.library().kernel(f"jit/{self.key.hex}/{self.arch}", device=device)

    def launch(self, entry: str, *, device: Any = None, **kwargs: Any) -> None:
        """``Kernel.launch`` on ``device``: ``grid``, ``block``, ``args``, ``shared_mem``, ``cluster``, ``stream``."""
        self.kernel(device).launch(entry, **kwargs)


def _read_source(source: str | os.PathLike[str]) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, os.PathLike):
        path = Path(source)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadArgumentError(f"JIT source {path}: cannot read it as UTF-8 text: {exc}") from exc
    raise BadArgumentError(f"source: expected the TU text (str) or a path (os.PathLike), got {show(source)}")


def _device_arch() -> Arch:
    from cubinstore import _cuda

    ordinal = _cuda.check_ordinal(_cuda.current_device())
    major, minor = _cuda.compute_capability(ordinal)
    # The arch-specific target from Hopper on: it has every feature (wgmma, setmaxnreg) and
    # loads on exactly this GPU, which is the GPU that asked.
    return Arch(major, minor, "a" if major >= 9 else "")


def _local_store(store: Store) -> Any:
    local = store.local
    if local is None:
        raise StoreError(f"the JIT needs a local store layer to keep CUBINs and its index; {store!r} has none")
    return local


class _Inputs:
    """One call's inputs, checked: the TU text, the arch, the include roots (absolute)."""

    def __init__(self, source: str | os.PathLike[str], include_dirs: Sequence[str | os.PathLike[str]],
                 arch: str | Arch | None) -> None:
        if isinstance(include_dirs, (str, bytes, os.PathLike)):
            raise BadArgumentError(f"include_dirs: expected a list of directories, got the single value {show(include_dirs)}")
        self.text = _read_source(source)
        self.arch = arch if isinstance(arch, Arch) else (_device_arch() if arch is None else Arch.parse(arch))
        self.include_dirs = [os.fspath(d) for d in include_dirs]
        for d in self.include_dirs:
            if not os.path.isabs(d):
                raise BadArgumentError(f"include_dirs: {show(d)} is relative; pass the absolute path of the installed tree")


class _Request:
    """One call's inputs, resolved: text, trees, flags, toolkit, host, arch, and the full key."""

    def __init__(self, inputs: _Inputs, flags: Sequence[str], local: Any) -> None:
        self.text = inputs.text
        self.arch = inputs.arch
        self.include_dirs = inputs.include_dirs
        self.trees = [tree(d, local=local) for d in self.include_dirs]
        self.flags: Flags = normalize_flags(flags, local=local)
        self.toolkit: Toolkit = find_toolkit(local=local)
        self.host: HostCompiler = host_compiler(local=local)
        self.key = make_key(key_parts(self.text, SOURCE_NAME, self.trees, self.flags, self.arch, self.toolkit, self.host))


def key(source: str | os.PathLike[str], *, include_dirs: Sequence[str | os.PathLike[str]], flags: Sequence[str] = (),
        arch: str | Arch | None = None, store: Store | None = None) -> JitKey:
    """The key ``compile`` would use, with its parts; compiles nothing."""
    store = store if store is not None else _default_store()
    return _Request(_Inputs(source, include_dirs, arch), flags, _local_store(store)).key


_default: tuple[tuple[Any, ...], Store] | None = None
_default_lock = threading.Lock()


def _default_store() -> Store:
    """``Store.from_env()``, one per process (so hits share its memory layer), rebuilt when the
    variables that shape it change."""
    global _default
    from cubinstore.store import Store

    config = (_env.home(), _env.remotes(), _env.disk_cache(), _env.offline(), _env.memory_bytes())
    with _default_lock:
        if _default is None or _default[0] != config:
            _default = (config, Store.from_env())
        return _default[1]


def compile(  # noqa: A001 - the verb a kernel library expects
    source: str | os.PathLike[str],
    *,
    include_dirs: Sequence[str | os.PathLike[str]],
    flags: Sequence[str] = (),
    arch: str | Arch | None = None,
    entries: Mapping[str, Sequence[str]] | None = None,
    family: str | None = None,
    params: Mapping[str, str | int] | None = None,
    store: Store | None = None,
    jit: bool | None = None,
) -> JitKernel:
    """Compile ``source`` (TU text, or a path to it) for ``arch``, or find it compiled under the same key.

    ``include_dirs``: the library's include roots, absolute, wherever it is installed.
    ``flags``: extra nvcc flags (``-D``, ``-std=``...; absolute ``-I`` paths are keyed by
    content). ``arch``: default the current device's (``sm_XYa`` from Hopper on).
    ``entries``: symbol -> parameter types, checked against the CUBIN and needed to launch.
    ``family``/``params``: how the warm set names this point (for ``warmset export``).
    ``jit``: may this call run nvcc (default ``CUBINSTORE_JIT``); off, a miss raises
    ``KernelNotFoundError``. A failing compile raises ``JitCompileError`` with nvcc's command
    and output, and caches nothing.
    """
    store = store if store is not None else _default_store()
    local = _local_store(store)
    index = JitIndex(local, _env.lock_timeout())
    if entries is not None:
        entries = _check_entries(entries)
    inputs = _Inputs(source, include_dirs, arch)
    # The direct key first: only the files this TU included are checked (``_jitdirect``).
    dreq = DirectRequest(inputs.text, SOURCE_NAME, inputs.include_dirs, flags, inputs.arch, local)
    known = _direct_hit(index, store, dreq)
    if known is not None:
        k, found = known
        _log.debug("JIT %s: direct hit, %s", k, found.digest)
        _check_declared(found.kernels, entries, k, None, None)
        return JitKernel(k, found, entries, False, store, 0.0, "direct")
    req = _Request(inputs, flags, local)
    k = req.key
    found = _hit(index, store, k)
    if found is not None:
        _log.debug("JIT %s: index hit, %s", k, found.digest)
        remember(index, dreq, k.hex)
        _check_declared(found.kernels, entries, k, None, None)
        return JitKernel(k, found, entries, False, store, 0.0, "key")
    if not (_env.jit() if jit is None else jit):
        index.put_parts(k.hex, k.parts)  # so `cubinstore explain` can say why it missed
        _record(local, k, req.arch, None, family, params, kind="miss")  # so CI can build it ahead
        raise KernelNotFoundError(
            f"JIT key {k} (arch {req.arch}{_named(family, params)}) is not in the index of {local.root} "
            f"and run-time compilation is off (CUBINSTORE_JIT=0 or jit=False); `cubinstore explain {k}` says why"
        )
    with index.lock(k.hex):
        # Another process may have compiled it while we waited for the lock.
        found = _hit(index, store, k)
        if found is not None:
            remember(index, dreq, k.hex)
            _check_declared(found.kernels, entries, k, None, None)
            return JitKernel(k, found, entries, False, store, 0.0, "key")
        index.put_parts(k.hex, k.parts)
        started = time.perf_counter()
        data, deps = _compile(req, index, dreq)
        seconds = time.perf_counter() - started
        image = CubinImage(data, f"JIT kernel {k}")
        kernels = tuple(sorted(image.kernels))
        _check_declared(kernels, entries, k, image, req.arch)
        digest = Digest.of(data)
        local.write(digest, data)
        found = IndexEntry(k.hex, digest, len(data), str(req.arch), kernels)
        if deps is not None:  # before the index entry, so a kill after it still leaves them to re-list
            put_deps(index, k.hex, *deps)
        # An index entry exists only once its CUBIN is in the CAS; the direct entry only once
        # the index entry does.
        index.put(found)
        if deps is not None:
            record(index, dreq, k.hex, *deps)
    _log.info("JIT %s: compiled %s in %.2f s (%d bytes, %s)", k, req.arch, seconds, len(data), digest.short)
    _record(local, k, req.arch, digest, family, params)
    return JitKernel(k, found, entries, True, store, seconds)


def _named(family: str | None, params: Mapping[str, Any] | None) -> str:
    if family is None:
        return ""
    return f", family {family}" + "".join(f" {k}={v!r}" for k, v in (params or {}).items())


# Keys whose parts were read back and re-hashed in this process: a key names its parts, so
# they never go stale (``clear_caches`` forgets them anyway, for tests of damaged files).
_parts_read: dict[str, JitKey] = {}


def clear_caches() -> None:
    """Forget every tree, toolkit and host identity hashed in this process, every direct check
    that passed and every key's parts read back (files changed under this process)."""
    _jitkey.clear_caches()
    _parts_read.clear()


def _direct_hit(index: JitIndex, store: Store, dreq: DirectRequest) -> tuple[JitKey, IndexEntry] | None:
    hex_ = lookup(dreq, index)
    if hex_ is None:
        return None
    k = _parts_read.get(hex_)
    if k is None:
        parts = index.get_parts(hex_)
        # The parts must still make the key (a damaged file reads as a miss, never as another key).
        if parts is None or make_key(parts).hex != hex_:
            return None
        k = _parts_read.setdefault(hex_, JitKey(hex_, parts))
    found = _hit(index, store, k)
    if found is None:
        forget(dreq)
        return None
    return k, found


def _hit(index: JitIndex, store: Store, k: JitKey) -> IndexEntry | None:
    entry = index.get(k.hex)
    if entry is None:
        return None
    try:
        # Verified now (and kept in memory), so a later load cannot find it gone.
        store.get(entry.digest, entry.size, name=f"JIT {k}")
    except (MissingBlobError, RemoteUnavailableError, IntegrityError, StoreError) as exc:
        # Evicted by gc, or only bad bytes found: the sources are here, so compile it again.
        _log.warning("JIT %s: the index names %s, which cannot be read (%s); compiling again", k, entry.digest, exc)
        return None
    return entry


def _record(local: Any, k: JitKey, arch: Arch, digest: Digest | None, family: str | None,
            params: Mapping[str, str | int] | None, kind: str = "jit") -> None:
    from cubinstore import _warmset

    try:
        _warmset.record(local, kind=kind, family=family, params=params, arch=str(arch), key=k.hex, digest=digest)
    except CubinstoreError as exc:  # the warm set is advice; the kernel is compiled and stored
        _log.warning("JIT %s: cannot record it in the warm set: %s", k, exc)


# -- the compile ----------------------------------------------------------------------------------

def command(req: _Request) -> list[str]:
    """nvcc's argv, relative to the compile directory: the Bazel rule's shape (cuda_cubin.bzl)."""
    argv = ["cuda/bin/nvcc", "-cubin", f"-arch={req.arch}", "-ccbin", req.host.name, *req.flags.command, "-I."]
    argv += [f"-Iinc/{i}" for i in range(len(req.include_dirs))]
    # -MD: the files the TU read, for the direct key (it does not change the CUBIN's bytes).
    argv += ["-include", ANCHOR_NAME, "-Xcicc", "--orig_src_path_name", "-Xcicc", SOURCE_NAME,
             "-MD", "-MF", DEPS_NAME, "-o", OUTPUT_NAME, SOURCE_NAME]
    return argv


def _lay_out(req: _Request, work: Path) -> None:
    """The compile directory: the toolkit, include roots and flag paths as relative symlinks' names."""
    (work / "cuda").symlink_to(req.toolkit.root, target_is_directory=True)
    (work / "inc").mkdir()
    for i, d in enumerate(req.include_dirs):
        (work / "inc" / str(i)).symlink_to(os.path.realpath(d), target_is_directory=True)
    if req.flags.paths:
        (work / "flagpath").mkdir()
        for i, fp in enumerate(req.flags.paths):
            (work / "flagpath" / str(i)).symlink_to(os.path.realpath(fp.path), target_is_directory=fp.is_dir)
    (work / SOURCE_NAME).write_text(req.text, encoding="utf-8", errors="surrogateescape")
    (work / ANCHOR_NAME).write_text(module_anchor(SOURCE_NAME), encoding="utf-8")
    (work / "tmp").mkdir()


def _compile(req: _Request, index: JitIndex, dreq: DirectRequest) -> tuple[bytes, tuple[Any, Any, Any] | None]:
    """The CUBIN's bytes, and what the direct entry records (None: write none)."""
    work = index.compile_dir(req.key.hex, 0)
    try:
        try:
            _lay_out(req, work)
        except OSError as exc:
            raise StoreError(f"cannot prepare the compile directory {work} for JIT {req.key}: {exc.strerror or exc}") from exc
        argv = command(req)
        result = _run_nvcc(argv, work)
        if result.returncode != 0:
            raise JitCompileError(_failure(req, argv, result))
        # Read before the check below: the trees are then known to be what nvcc read and the key hashed.
        deps = _direct_deps(req, dreq, work, index)
        _check_unchanged(req)
        if deps is not None and not toolkit_unchanged(req.toolkit):
            _log.warning("JIT %s: the CUDA toolkit changed while compiling; no direct entry written", req.key)
            deps = None
        try:
            return (work / OUTPUT_NAME).read_bytes(), deps
        except OSError as exc:
            raise JitCompileError(
                f"nvcc exited 0 for JIT {req.key} but wrote no {OUTPUT_NAME}: {shlex.join(argv)}\n{result.stderr}"
            ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _direct_deps(req: _Request, dreq: DirectRequest, work: Path, index: JitIndex) -> tuple[Any, Any, Any] | None:
    try:
        text = (work / DEPS_NAME).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        _log.warning("JIT %s: nvcc wrote no dependency list (%s); no direct entry", req.key, exc)
        return None
    skip = [SOURCE_NAME, ANCHOR_NAME, *(f"flagpath/{i}" for i, fp in enumerate(req.flags.paths) if not fp.is_dir)]
    placed = parse_deps(text, dreq.roots, skip, work)
    if placed is None:
        _log.info("JIT %s: a dependency outside the known roots; no direct entry (the full key finds it)", req.key)
        return None
    try:
        shapes = shapes_of(dreq.roots, index.local)
    except CubinstoreError as exc:
        _log.warning("JIT %s: cannot read the shape of its roots (%s); no direct entry", req.key, exc)
        return None
    seen = observe(dreq, placed, shapes)  # stats first, then content
    files = hash_deps(placed, dreq.roots)
    if files is None:
        _log.info("JIT %s: cannot read back a file nvcc read; no direct entry", req.key)
        return None
    return files, shapes, seen


def _hash_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return xxh3(f.read())
    except OSError:
        return ""


def _check_unchanged(req: _Request) -> None:
    """nvcc read the trees as they are now: they must still be what the key hashed (a tree
    edited since, during the compile or after this process cached its key, would put a CUBIN
    of other content under this key)."""
    named = [(f"include_dirs[{i}] ({d})", t) for i, (d, t) in enumerate(zip(req.include_dirs, req.trees))]
    named += [(f"flag {fp.option} {fp.path}", fp.tree) for fp in req.flags.paths if fp.tree is not None]
    for what, t in named:
        if not unchanged(t):
            clear_caches()
            raise JitCompileError(
                f"{what} changed after JIT key {req.key} was computed (while compiling, or since this process "
                "hashed it); nothing was cached: compile again to key and compile the new content"
            )
    for fp in req.flags.paths:
        if not fp.is_dir and _hash_file(fp.path) != fp.key:
            clear_caches()
            raise JitCompileError(f"flag {fp.option} {fp.path} changed while JIT key {req.key} was compiling; nothing was cached")


def _run_nvcc(argv: list[str], work: Path) -> subprocess.CompletedProcess[str]:
    # nvcc's intermediates go to TMPDIR: inside the compile directory, under the store's root.
    env = dict(ACTION_ENV, TMPDIR=str(work / "tmp"))
    try:
        return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, errors="replace")
    except OSError as exc:
        raise JitCompileError(f"cannot run nvcc ({shlex.join(argv)}): {exc.strerror or exc}") from exc


def _failure(req: _Request, argv: list[str], result: subprocess.CompletedProcess[str]) -> str:
    output = (result.stderr + result.stdout).strip()
    if len(output) > _MAX_STDERR:
        output = output[:_MAX_STDERR] + f"\n... ({len(output) - _MAX_STDERR} more characters)"
    legend = "; ".join([f"inc/{i} = include_dirs[{i}]" for i in range(len(req.include_dirs))]
                       + [f"flagpath/{i} = {fp.option} path {i} of flags" for i, fp in enumerate(req.flags.paths)]
                       + ["cuda = the CUDA toolkit " + req.toolkit.version])
    return (f"nvcc failed (exit {result.returncode}) for JIT key {req.key} ({req.arch}); nothing was cached.\n"
            f"command: {shlex.join(argv)}\n({legend})\n{output}")


# -- entries --------------------------------------------------------------------------------------

def _check_entries(entries: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    if not isinstance(entries, Mapping) or not entries:
        raise BadArgumentError(f"entries: expected a non-empty mapping of symbol -> parameter types, got {show(entries)}")
    out: dict[str, tuple[str, ...]] = {}
    for name, types in entries.items():
        if not isinstance(name, str) or not name:
            raise BadArgumentError(f"entries: expected symbol names, got {show(name)}")
        if isinstance(types, str) or not isinstance(types, Sequence):
            raise BadArgumentError(f"entries[{name!r}]: expected a list of parameter types, got {show(types)}")
        for t in types:
            param_type(t)
        out[name] = tuple(types)
    return out


def _check_declared(kernels: Sequence[str], entries: Mapping[str, tuple[str, ...]] | None, k: JitKey,
                    image: CubinImage | None, arch: Arch | None) -> None:
    """Every declared entry is a kernel of the CUBIN; with the image, its parameters match the declared types."""
    for name, types in (entries or {}).items():
        if name not in kernels:
            raise BadArgumentError(
                f"JIT kernel {k}: entry {name!r} is not a __global__ function of the CUBIN; it has {', '.join(kernels) or 'none'}"
            )
        if image is not None and arch is not None:
            declared = param_layout([param_type(t) for t in types], arch)
            actual = image.param_layout(name)
            sizes = tuple(param_type(t).size for t in types)
            if tuple(o for o, _ in actual) != declared or tuple(s for _, s in actual) != sizes:
                raise BadArgumentError(
                    f"JIT kernel {k} entry {name!r}: declared {list(types)} (offsets {list(declared)}, sizes {list(sizes)}), "
                    f"the CUBIN has offsets {[o for o, _ in actual]}, sizes {[s for _, s in actual]}"
                )


def __getattr__(name: str) -> Any:
    # The family-template side lives in its own module; re-exported here as the public API.
    if name in ("FamilyTemplate", "compile_family_point", "resolve_miss"):
        from cubinstore import _jitfamily

        return getattr(_jitfamily, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
