"""The JIT compiler below the public ``cubinstore.jit``: one call's request and key, the per-key
lock and re-check, nvcc in a private directory, the index and its checks.

``compile`` returns a ``Compiled`` (the key, the index entry, whether nvcc ran); the facade
``cubinstore.jit`` wraps it in a launchable ``JitKernel`` and ``cubinstore._jit.family`` in a
``KernelSpec``, so this module never imports the launcher. What the key covers, the direct key,
the sealed compile, the outside files and the time limit are described in ``cubinstore.jit``.
Needs the ``jit`` extra (``xxhash``).
"""

from __future__ import annotations

import contextvars
import os
import shlex
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from cubinstore._core import knobs as _env
from cubinstore._core.abi import MAX_BLOB_SIZE, Arch, layout_mismatch, module_anchor, param_type
from cubinstore._core.nvcc import cubin_argv
from cubinstore._core.cubin import CubinImage
from cubinstore._core.cxxnames import name_problem
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore._core.userfile import open_regular
from cubinstore._jit import direct as _jitdirect
from cubinstore._jit import key as _jitkey
from cubinstore._jit.demangle import resolve_entries
from cubinstore._jit.direct import (
    DEPS_NAME,
    Deps,
    DirectRequest,
    classify,
    forget,
    hash_deps,
    lookup,
    observe,
    outside_match,
    put_deps,
    record,
    remember,
    shapes_of,
)
from cubinstore._jit.index import IndexEntry, JitIndex
from cubinstore._jit.inputs import MAX_SOURCE_BYTES
from cubinstore._jit.key import (
    ACTION_ENV,
    Flags,
    HostCompiler,
    JitKey,
    Toolkit,
    find_toolkit,
    hash_file,
    host_compiler,
    key_parts,
    make_key,
    normalize_flags,
    toolkit_unchanged,
    tree,
    unchanged,
)
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    IntegrityError,
    JitCompileError,
    JitTimeoutError,
    KernelNotFoundError,
    MissingBlobError,
    RemoteUnavailableError,
    StoreError,
)

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = ["ANCHOR_NAME", "LOG_NAME", "OUTPUT_NAME", "SOURCE_NAME", "Compiled", "Inputs", "Request", "check_entries",
           "clear_caches", "command", "compile", "default_store", "key", "run_nvcc"]

_log = get_logger("cubinstore.jit")  # the logger name users configure, as before the split

# The TU's name in the compile directory: part of the key (it salts anonymous-namespace
# symbols through --orig_src_path_name and names the module anchor).
SOURCE_NAME: Final = "cubinstore_jit.cu"
ANCHOR_NAME: Final = "cubinstore_jit.anchor.h"
OUTPUT_NAME: Final = "cubinstore_jit.cubin"
# What each output kind's compile writes (``KeyParts.kind``); "cubin" is every release's and family's.
OUTPUT_NAMES: Final[Mapping[str, str]] = {"cubin": OUTPUT_NAME, "ptx": "cubinstore_jit.ptx",
                                          "fatbin": "cubinstore_jit.fatbin"}
LOG_NAME: Final = "cubinstore_jit.log"  # nvcc's stdout, in the compile directory
ERR_NAME: Final = "cubinstore_jit.err"  # nvcc's stderr
_MAX_STDERR: Final = 16000
_MAX_LOG: Final = 1 << 20  # bytes of nvcc's output read back
_MAX_DEPS: Final = 16 << 20  # bytes of the dependency list read back
# The time limit of the compile in progress (a context variable, so ``run_nvcc(argv, work)``
# keeps the shape an ``nvcc=`` wrapper calls).
_limit: contextvars.ContextVar[float] = contextvars.ContextVar("cubinstore_jit_limit", default=600.0)


@dataclass(frozen=True)
class Compiled:
    """What ``compile`` found or made: the key the CUBIN is indexed under and its index entry."""

    key: JitKey
    entry: IndexEntry
    entries: dict[str, tuple[str, ...]] | None  # the declared entries, checked (None: none declared)
    compiled: bool  # this call ran nvcc (False: an index hit, or another process compiled it)
    store: Store
    seconds: float  # the compile's, 0.0 for a hit
    found_by: str  # "direct": the included files checked; "key": the full key; "compile": nvcc ran
    direct_seconds: float = 0.0  # the direct check's: its request and (unless ``direct=False``) its lookup

    @property
    def digest(self) -> Digest:
        return self.entry.digest

    @property
    def size(self) -> int:
        return self.entry.size


def read_source(source: str | os.PathLike[str]) -> str:
    """The TU's text: ``source`` itself, or the regular file it names (a FIFO or device is refused
    without blocking), at most ``MAX_SOURCE_BYTES`` of UTF-8."""
    if isinstance(source, str):
        return source
    if isinstance(source, os.PathLike):
        path = Path(source)
        with open_regular(path, "JIT source") as f:
            try:
                raw = f.read(MAX_SOURCE_BYTES + 1)
            except OSError as exc:
                raise BadArgumentError(f"cannot read JIT source {path}: {exc.strerror or exc}") from exc
        if len(raw) > MAX_SOURCE_BYTES:
            raise BadArgumentError(f"JIT source {path}: expected at most {MAX_SOURCE_BYTES} bytes, got more")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadArgumentError(f"JIT source {path}: cannot read it as UTF-8 text: {exc}") from exc
    raise BadArgumentError(f"source: expected the TU text (str) or a path (os.PathLike), got {show(source)}")


def device_arch() -> Arch:
    from cubinstore._driver import device  # the driver: only when no arch was given

    devices = device.current()
    ordinal = devices.check_ordinal(devices.driver.current_device())
    major, minor = devices.compute_capability(ordinal)
    # The arch-specific target from Hopper on: it has every feature (wgmma, setmaxnreg) and
    # loads on exactly this GPU, which is the GPU that asked.
    return Arch(major, minor, "a" if major >= 9 else "")


def local_store(store: Store) -> Any:
    local = store.local
    if local is None:
        raise StoreError(f"the JIT needs a local store layer to keep CUBINs and its index; {store!r} has none")
    return local


class Inputs:
    """One call's inputs, checked: the TU text, the arch, the include roots (absolute)."""

    def __init__(self, source: str | os.PathLike[str], include_dirs: Sequence[str | os.PathLike[str]],
                 arch: str | Arch | None) -> None:
        if isinstance(include_dirs, (str, bytes, os.PathLike)):
            raise BadArgumentError(f"include_dirs: expected a list of directories, got the single value {show(include_dirs)}")
        self.text = read_source(source)
        self.arch = arch if isinstance(arch, Arch) else (device_arch() if arch is None else Arch.parse(arch))
        self.include_dirs = [os.fspath(d) for d in include_dirs]
        for d in self.include_dirs:
            if not os.path.isabs(d):
                raise BadArgumentError(f"include_dirs: {show(d)} is relative; pass the absolute path of the installed tree")


class Request:
    """One call's inputs, resolved: text, trees, flags, toolkit, host, arch, and the full key."""

    def __init__(self, inputs: Inputs, flags: Sequence[str], local: Any, program: str | None = None,
                 kind: str = "cubin") -> None:
        self.text = inputs.text
        self.kind = kind
        self.arch = inputs.arch
        self.include_dirs = inputs.include_dirs
        self.trees = [tree(d, local=local) for d in self.include_dirs]
        self.flags: Flags = normalize_flags(flags, local=local)
        self.toolkit: Toolkit = find_toolkit(local=local)
        self.host: HostCompiler = host_compiler(local=local)
        self.key = make_key(key_parts(self.text, SOURCE_NAME, self.trees, self.flags, self.arch, self.toolkit, self.host,
                                      program, kind))


def key(source: str | os.PathLike[str], *, include_dirs: Sequence[str | os.PathLike[str]], flags: Sequence[str] = (),
        arch: str | Arch | None = None, store: Store | None = None, program: str | None = None,
        kind: str = "cubin") -> JitKey:
    """The key ``compile`` computes before compiling (its *base* key), with its parts; compiles nothing.

    ``compile`` reports this key unless the compile read files outside every root, flag path,
    the toolkit and the system include directories: then the key it reports also covers those
    files' paths and contents (``k.key.parts.base`` is this key's parts)."""
    store = store if store is not None else default_store()
    return Request(Inputs(source, include_dirs, arch), flags, local_store(store), program, kind).key


def default_store() -> Store:
    """``cubinstore.store.default_store()``, imported on first use (a key or a hit never needs more)."""
    from cubinstore.store import default_store as store_default

    return store_default()


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
    sealed: bool = False,
    timeout: float | None = None,
    nvcc: Callable[[list[str], Path], subprocess.CompletedProcess[str]] | None = None,
    program: str | None = None,
    kind: str = "cubin",
    direct: bool = True,
    make_index: Callable[[Any, float], JitIndex] = JitIndex,
) -> Compiled:
    """What ``cubinstore.jit.compile`` does (its docstring describes every argument), returning the
    index entry found or written and how; ``jit.compile`` wraps it in a ``JitKernel``.

    ``nvcc``: what runs nvcc's argv in the compile directory (default ``run_nvcc``; tests pass a
    wrapper to act while it runs). ``program``: the content key (xxh3) of the program ``nvcc``
    runs when it is not the toolkit's own nvcc (``cubinstore-nvcc`` under ``CUBINSTORE_NVCC``):
    part of the key, so another compiler program never shares one. ``kind``: what nvcc writes,
    ``"cubin"`` (default), ``"ptx"`` or ``"fatbin"`` (``cubinstore-nvcc``'s calls); only a CUBIN
    has kernels to declare ``entries`` of or to launch. ``direct``: try the direct key first
    (default); False: the full key alone finds it (a benchmark's comparison; its hit or compile
    still lists the key under the direct key). ``make_index``: what makes the index over the local layer and
    the lock timeout (default ``JitIndex``; a test passes a subclass that stops at one step).
    """
    if kind not in OUTPUT_NAMES:
        raise BadArgumentError(f"kind: expected one of {', '.join(OUTPUT_NAMES)}, got {show(kind)}")
    if kind != "cubin" and entries is not None:
        raise BadArgumentError(f"entries: a {kind} has no kernels to declare; only a cubin does")
    if not isinstance(sealed, bool):
        raise BadArgumentError(f"sealed: expected True or False, got {show(sealed)}")
    if not isinstance(direct, bool):
        raise BadArgumentError(f"direct: expected True or False, got {show(direct)}")
    limit = _time_limit(timeout)
    store = store if store is not None else default_store()
    local = local_store(store)
    index = make_index(local, _env.lock_timeout())
    if entries is not None:
        entries = check_entries(entries)
    inputs = Inputs(source, include_dirs, arch)
    # The direct key first: only the files this TU included are checked (``_jitdirect``).
    checking = time.perf_counter()
    dreq = DirectRequest(inputs.text, SOURCE_NAME, inputs.include_dirs, flags, inputs.arch, local, program, kind)
    known = _direct_hit(index, store, dreq, entries, sealed) if direct else None
    checked = time.perf_counter() - checking
    if known is not None:
        k, found = known
        _log.debug("JIT %s: direct hit, %s", k, found.digest)
        return Compiled(k, found, entries, False, store, 0.0, "direct", checked)
    req = Request(inputs, flags, local, program, kind)
    base = req.key
    hit = _hit(index, store, base, entries, sealed)
    if hit is not None:
        k, found = hit
        _log.debug("JIT %s: index hit, %s", k, found.digest)
        remember(index, dreq, k.hex)
        return Compiled(k, found, entries, False, store, 0.0, "key", checked)
    if not (_env.jit() if jit is None else jit):
        index.put_parts(base.hex, base.parts)  # so `cubinstore explain` can say why it missed
        _record(local, base, req.arch, None, family, params, kind="miss")  # so CI can build it ahead
        raise KernelNotFoundError(
            f"JIT key {base} (arch {req.arch}{_named(family, params)}) is not in the index of {local.root} "
            f"and run-time compilation is off (CUBINSTORE_JIT=0 or jit=False); `cubinstore explain {base}` says why"
        )
    # One lock per base key: every key compiled under it (other outside files) is written under it.
    with index.lock(base.hex):
        # Another process may have compiled it while we waited for the lock.
        hit = _hit(index, store, base, entries, sealed)
        if hit is not None:
            k, found = hit
            remember(index, dreq, k.hex)
            return Compiled(k, found, entries, False, store, 0.0, "key", checked)
        index.put_parts(base.hex, base.parts)
        started = time.perf_counter()
        token = _limit.set(limit)
        try:
            data, deps, outside, result = _compile(req, index, dreq, sealed, nvcc or run_nvcc)
        finally:
            _limit.reset(token)
        seconds = time.perf_counter() - started
        if kind == "cubin":
            image = CubinImage(data, f"JIT kernel {base}")
            kernels = tuple(sorted(image.kernels))
            _check_declared(kernels, entries, base, image, req.arch)
        else:
            kernels = ()
            problem = _artifact_problem(data, kind)
            if problem is not None:
                raise JitCompileError(f"nvcc exited 0 for JIT {base} but its {kind} output {problem}")
        # What the compile read from outside the roots is part of the key it is stored and reported under.
        k = make_key(replace(base.parts, outside=tuple(outside))) if outside else base
        digest = Digest.of(data)
        local.write(digest, data)
        found = IndexEntry(k.hex, digest, len(data), str(req.arch), kernels, k.parts)
        if outside:
            index.put_parts(k.hex, k.parts)
        if deps is not None:  # before the index entry, so a kill after it still leaves them to re-list
            put_deps(index, k.hex, *deps)
        # nvcc's messages (the compile directory's names), for a caller that replays them (cubinstore-nvcc).
        index.put_output(k.hex, result.stdout, result.stderr)
        # An index entry exists only once its CUBIN is in the CAS; the direct entry (and the
        # base key's list of outside-file keys) only once the index entry does.
        index.put(found)
        if outside:
            index.add_outside(base.hex, k.hex)
        if deps is not None:
            record(index, dreq, k.hex, *deps)
    _log.info("JIT %s: compiled %s in %.2f s (%d bytes, %s)", k, req.arch, seconds, len(data), digest.short)
    _record(local, k, req.arch, digest, family, params)
    return Compiled(k, found, entries, True, store, seconds, "compile", checked)


def _time_limit(timeout: float | None) -> float:
    if timeout is None:
        return _env.jit_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise BadArgumentError(f"timeout: expected a positive number of seconds or None, got {show(timeout)}")
    return float(timeout)


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
    _jitdirect.clear()
    _parts_read.clear()
    _verified_ok.clear()


def _direct_hit(index: JitIndex, store: Store, dreq: DirectRequest, entries: Mapping[str, tuple[str, ...]] | None,
                sealed: bool) -> tuple[JitKey, IndexEntry] | None:
    taken: dict[str, tuple[JitKey, IndexEntry]] = {}

    def accept(hex_: str) -> bool:
        k = _parts_read.get(hex_)
        if k is None:
            parts = index.get_parts(hex_)
            # The parts must still make the key (a damaged file reads as a miss, never as another key).
            if parts is None or make_key(parts).hex != hex_:
                return False
            k = _parts_read.setdefault(hex_, JitKey(hex_, parts))
        if k.parts.outside and (sealed or not outside_match(k.parts.outside)):
            return False  # an outside file changed (or a sealed call, which may read none)
        found = _verified(index, store, k, entries)
        if found is None:
            return False
        taken[hex_] = (k, found)
        return True

    hex_ = lookup(dreq, index, accept)
    if hex_ is None:
        forget(dreq)
        return None
    return taken.get(hex_)


def _hit(index: JitIndex, store: Store, base: JitKey, entries: Mapping[str, tuple[str, ...]] | None,
         sealed: bool) -> tuple[JitKey, IndexEntry] | None:
    """The key and entry the base key finds: a key compiled under it whose outside files all still
    have their recorded content (newest first), else the base key's own entry."""
    if not sealed:
        for hex_ in index.get_outside(base.hex):
            entry = index.get(hex_)
            parts = entry.parts if entry is not None else None
            # Its parts must make it, be this call's plus outside files, and those must be unchanged.
            if parts is None or make_key(parts).hex != hex_ or parts.base != base.parts or not parts.outside:
                continue
            if not outside_match(parts.outside):
                continue
            k = JitKey(hex_, parts)
            found = _verified(index, store, k, entries)
            if found is not None:
                return k, found
    found = _verified(index, store, base, entries)
    return None if found is None else (base, found)


# (key, digest, size, arch, kernels, entries) that passed ``_verified`` in this process.
_verified_ok: set[tuple[Any, ...]] = set()


def _verified(index: JitIndex, store: Store, k: JitKey, entries: Mapping[str, tuple[str, ...]] | None) -> IndexEntry | None:
    """``k``'s index entry if it holds: its key and parts make ``k``, its CUBIN verifies (sha256,
    size), is for its arch and has exactly its kernels, and the declared entries match the CUBIN
    (each names one of its kernels, by symbol or C++ name, whose parameters have the declared layout).

    An entry that does not hold is removed (quarantined) with a warning naming key and digest,
    so the caller compiles again. A CUBIN that cannot be read (evicted) is a plain miss; declared
    entries the CUBIN lacks are a miss that keeps the entry (the compile decides whose fault).
    No demangler for a C++ name raises ``DemanglerError`` (compiling again would not help)."""
    entry = index.get(k.hex)
    if entry is None:
        return None
    fact = (k.hex, entry.digest, entry.size, entry.arch, entry.kernels, tuple(sorted((entries or {}).items())))
    if fact in _verified_ok:
        try:  # still in the store (the memory layer, usually): a hit never names a blob gone since
            store.get(entry.digest, entry.size, name=f"JIT {k}")
            return entry
        except CubinstoreError:
            _verified_ok.discard(fact)
    problem = _entry_problem(entry, k)
    if problem is None:
        try:
            # Verified now (and kept in memory), so a later load cannot find it gone.
            data = store.get(entry.digest, entry.size, name=f"JIT {k}")
        except (MissingBlobError, RemoteUnavailableError, IntegrityError, StoreError) as exc:
            # Evicted by gc, or only bad bytes found: the sources are here, so compile it again.
            _log.warning("JIT %s: the index names %s, which cannot be read (%s); compiling again", k, entry.digest, exc)
            return None
        if k.parts.kind != "cubin":
            problem = _artifact_problem(data, k.parts.kind) or (None if not entry.kernels else "it lists kernels")
            image = None
        else:
            try:
                image = CubinImage(data, f"JIT kernel {k} ({entry.digest})")  # parsed once, for both checks
                problem = _cubin_problem(image, entry)
            except CubinstoreError as exc:
                problem = f"not a CUBIN: {exc}"
    if problem is not None:
        _log.warning("JIT %s: the index entry naming %s does not hold (%s); removed, compiling again",
                     k, entry.digest, problem)
        try:
            index.remove(k.hex)
        except CubinstoreError as exc:
            _log.warning("JIT %s: cannot remove its index entry: %s", k, exc)
        return None
    try:
        if image is not None:
            _check_declared(entry.kernels, entries, k, image, Arch.parse(entry.arch))
    except BadArgumentError as exc:
        _log.warning("JIT %s: %s; compiling again", k, exc)
        return None
    _verified_ok.add(fact)
    return entry


def _entry_problem(entry: IndexEntry, k: JitKey) -> str | None:
    if entry.key != k.hex:
        return f"its key is {entry.key}"
    if entry.parts is None:
        return "its key parts are not kept"
    if make_key(entry.parts).hex != k.hex or entry.parts != k.parts:
        return "its key parts do not make its key"
    if entry.arch != k.parts.arch:
        return f"the key is for {k.parts.arch}, the entry says {entry.arch}"
    return None


# A fatbin's magic number (little-endian 0xBA55ED50), and PTX's first directive.
_FATBIN_MAGIC: Final = b"\x50\xed\x55\xba"


def _artifact_problem(data: bytes, kind: str) -> str | None:
    """How a PTX or fatbin output is not one (None: it looks like one)."""
    if kind == "fatbin":
        return None if data[:4] == _FATBIN_MAGIC else "does not start with the fatbin magic number"
    if kind == "ptx":
        return None if data.isascii() and b".version" in data[:4096] else "is not PTX text (no .version directive)"
    return f"is of an unknown kind {kind!r}"


def _cubin_problem(image: CubinImage, entry: IndexEntry) -> str | None:
    """How the CUBIN differs from what its index entry claims (arch, kernels); None if it does not."""
    arch = Arch.parse(entry.arch)
    sm = image.sm
    kernels = tuple(sorted(image.kernels))
    if sm is not None and sm != arch.sm:
        return f"the entry says {entry.arch}, the CUBIN's ELF header says sm_{sm}"
    if kernels != tuple(sorted(entry.kernels)):
        return f"the entry lists kernels {', '.join(entry.kernels) or 'none'}, the CUBIN has {', '.join(kernels) or 'none'}"
    return None


def _record(local: Any, k: JitKey, arch: Arch, digest: Digest | None, family: str | None,
            params: Mapping[str, str | int] | None, kind: str = "jit") -> None:
    from cubinstore._release import warmset as _warmset

    try:
        _warmset.record(local, kind=kind, family=family, params=params, arch=str(arch), key=k.hex, digest=digest)
    except CubinstoreError as exc:  # the warm set is advice; the kernel is compiled and stored
        _log.warning("JIT %s: cannot record it in the warm set: %s", k, exc)


# -- the compile ----------------------------------------------------------------------------------

def command(req: Request) -> list[str]:
    """nvcc's argv, relative to the compile directory: the Bazel rule's shape (``_core.nvcc``)."""
    argv = cubin_argv({
        "nvcc": "cuda/bin/nvcc", "arch": str(req.arch), "host_cc": req.host.name,
        # The JIT's defines are among its flags (already merged with the defaults).
        "flags": list(req.flags.command), "includes": [f"inc/{i}" for i in range(len(req.include_dirs))], "defines": [],
        "anchor": ANCHOR_NAME, "source_name": SOURCE_NAME,
        # -MD: the files the TU read, for the direct key (it does not change the CUBIN's bytes).
        "extra": ["-MD", "-MF", DEPS_NAME], "output": OUTPUT_NAMES[req.kind], "source": SOURCE_NAME,
    })
    if req.kind != "cubin":  # the same command, asking nvcc for another output kind
        argv[argv.index("-cubin")] = f"-{req.kind}"
    return argv


def _lay_out(req: Request, work: Path) -> None:
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


def _compile(req: Request, index: JitIndex, dreq: DirectRequest, sealed: bool,
             nvcc: Callable[[list[str], Path], subprocess.CompletedProcess[str]],
             ) -> tuple[bytes, tuple[Any, Any, Any] | None, list[tuple[str, str]], subprocess.CompletedProcess[str]]:
    """The CUBIN's bytes, what the direct entry records (None: write none), the (path, xxh3)
    of each file read from outside every root (``Deps.outside``), and nvcc's result."""
    work = index.compile_dir(req.key.hex, 0)
    try:
        try:
            _lay_out(req, work)
        except OSError as exc:
            raise StoreError(f"cannot prepare the compile directory {work} for JIT {req.key}: {exc.strerror or exc}") from exc
        argv = command(req)
        started_ns = time.time_ns()
        result = nvcc(argv, work)
        # Read even after a failure: a sealed compile must not quote a file it should not have read.
        deps = _read_deps(req, dreq, work)
        if sealed:
            _check_sealed(req, deps, result)
        if result.returncode != 0:
            raise JitCompileError(_failure(req, argv, result))
        # Read before the check below: the trees are then known to be what nvcc read and the key hashed.
        direct = _direct_deps(req, dreq, deps, index)
        _check_unchanged(req)
        if direct is not None and not toolkit_unchanged(req.toolkit):
            _log.warning("JIT %s: the CUDA toolkit changed while compiling; no direct entry written", req.key)
            direct = None
        outside = _hash_outside(req, deps, started_ns)
        return _read_output(req, work, argv, result), direct, outside, result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_output(req: Request, work: Path, argv: list[str], result: subprocess.CompletedProcess[str]) -> bytes:
    """What nvcc wrote: a regular file of at most ``MAX_BLOB_SIZE`` bytes (no larger blob is stored)."""
    name = OUTPUT_NAMES[req.kind]
    try:
        fd = os.open(work / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise JitCompileError(
            f"nvcc exited 0 for JIT {req.key} but wrote no {name}: {shlex.join(argv)}\n{result.stderr}"
        ) from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JitCompileError(f"nvcc's output {name} for JIT {req.key} is not a regular file: {shlex.join(argv)}")
        data = f.read(MAX_BLOB_SIZE + 1)
    if len(data) > MAX_BLOB_SIZE:
        raise JitCompileError(f"nvcc's output {name} for JIT {req.key} is over the {MAX_BLOB_SIZE}-byte limit of a "
                              f"stored blob; nothing was cached: {shlex.join(argv)}")
    return data


def _read_deps(req: Request, dreq: DirectRequest, work: Path) -> Deps | None:
    """nvcc's dependency list, sorted (``classify``); None when it wrote none or it cannot be read."""
    try:
        fd = os.open(work / DEPS_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        _log.warning("JIT %s: nvcc wrote no dependency list (%s)", req.key, exc)
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_DEPS + 1)
    if len(raw) > _MAX_DEPS:
        _log.warning("JIT %s: its dependency list is over %d bytes; not read", req.key, _MAX_DEPS)
        return None
    text = raw.decode("utf-8", errors="surrogateescape")
    skip = [SOURCE_NAME, ANCHOR_NAME, *(f"flagpath/{i}" for i, fp in enumerate(req.flags.paths) if not fp.is_dir)]
    deps = classify(text, dreq.roots, skip, work, req.host.system_dirs)
    if deps is None:
        _log.warning("JIT %s: cannot read nvcc's dependency list", req.key)
    return deps


def _check_sealed(req: Request, deps: Deps | None, result: subprocess.CompletedProcess[str]) -> None:
    """A sealed compile read only its roots, flag paths, the toolkit and system headers; else
    fail naming the files (never nvcc's output, which could quote them)."""
    if deps is None:
        raise JitCompileError(
            f"sealed JIT compile of key {req.key} ({req.arch}) (nvcc exit {result.returncode}): its dependency list "
            "is missing or unreadable, so what it read cannot be checked; nothing was cached and nvcc's output is withheld"
        )
    if deps.foreign:
        shown = ", ".join(deps.foreign[:8]) + (f" and {len(deps.foreign) - 8} more" if len(deps.foreign) > 8 else "")
        raise JitCompileError(
            f"sealed JIT compile of key {req.key} ({req.arch}) read {shown}: expected only files under its include "
            "roots, flag paths, the CUDA toolkit and the host compiler's system include directories; "
            "nothing was cached (nvcc's output is withheld: it could quote the file)"
        )


def _hash_outside(req: Request, deps: Deps | None, started_ns: int) -> list[tuple[str, str]]:
    """(path, xxh3) of each outside file, which must be as nvcc read it: not modified since the
    compile started (git's racy rule, by ctime and mtime) nor while it is hashed."""
    if deps is None:
        # Unknown what it read: a key that may lack a file would be a key naming two CUBINs.
        raise JitCompileError(f"JIT {req.key}: nvcc's dependency list is missing or unreadable; nothing was cached")
    out = []
    for path in deps.outside:
        try:
            before = os.stat(path)
            digest = hash_file(path, "xxh3", what="JIT outside file")
            after = os.stat(path)
        except (OSError, CubinstoreError) as exc:
            raise JitCompileError(f"JIT {req.key}: cannot read back {path}, which nvcc read: {exc}; nothing was cached") from exc
        facts = [(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in (before, after)]
        if facts[0] != facts[1] or max(after.st_mtime_ns, after.st_ctime_ns) > started_ns:
            raise JitCompileError(
                f"{path}, which JIT {req.key} read, changed while compiling; nothing was cached: compile again"
            )
        out.append((path, digest))
    return out


def _direct_deps(req: Request, dreq: DirectRequest, deps: Deps | None, index: JitIndex) -> tuple[Any, Any, Any] | None:
    if deps is None:
        return None
    placed = deps.placed
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
        return hash_file(path, "xxh3")
    except CubinstoreError:
        return ""


def _check_unchanged(req: Request) -> None:
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


def run_nvcc(argv: list[str], work: Path) -> subprocess.CompletedProcess[str]:
    """Run nvcc in its own process group, stdin closed, output to a file of the compile directory,
    within the current compile's time limit; past it, kill the whole group (nvcc, gcc, cicc...)."""
    limit = _limit.get()
    # nvcc's intermediates go to TMPDIR: inside the compile directory, under the store's root.
    env = dict(ACTION_ENV, TMPDIR=str(work / "tmp"))
    log, err = work / LOG_NAME, work / ERR_NAME
    try:
        # Two files, not pipes: nothing to drain while waiting, and a replay keeps the streams apart.
        with open(log, "wb") as out, open(err, "wb") as errors:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=errors, start_new_session=True)
    except OSError as exc:
        raise JitCompileError(f"cannot run nvcc ({shlex.join(argv)}): {exc.strerror or exc}") from exc
    try:
        returncode = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        key = work.name.split(".", 1)[0]
        raise JitTimeoutError(
            f"JIT key xxh3:{key}: nvcc ran past its time limit of {limit:g} s and was killed with every process "
            "it started; nothing was cached (the limit is CUBINSTORE_JIT_TIMEOUT or compile(timeout=))"
        ) from None
    except BaseException:  # interrupted: never leave the group running
        _kill_group(proc)
        raise
    if _group_members(proc.pid):  # nvcc exited, a child of it did not: it goes too
        _kill_group(proc, wait_for_leader=False)
    return subprocess.CompletedProcess(argv, returncode, _read_log(log), _read_log(err))


def _read_log(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            output = f.read(_MAX_LOG + 1)
    except OSError:
        output = b""
    text = output[:_MAX_LOG].decode("utf-8", errors="surrogateescape")
    if len(output) > _MAX_LOG:
        text += f"\n... (output over {_MAX_LOG} bytes not read)"
    return text


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid`` (a /proc scan; Linux)."""
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read(4096).rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the name: state, ppid, pgrp.
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def _kill_group(proc: subprocess.Popen[bytes], wait_for_leader: bool = True) -> None:
    """SIGKILL nvcc's whole process group and wait until none of it runs (bounded)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except OSError as exc:
        _log.warning("cannot kill nvcc's process group %d: %s", proc.pid, exc)
    if wait_for_leader:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _log.warning("nvcc (pid %d) did not exit 30 s after SIGKILL", proc.pid)
    deadline = time.monotonic() + 10
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # SIGKILL is delivered; the kernel tears the processes down


def _failure(req: Request, argv: list[str], result: subprocess.CompletedProcess[str]) -> str:
    # Printable whatever bytes nvcc wrote (the streams are read with surrogateescape, for replays).
    output = (result.stderr + result.stdout).strip().encode("utf-8", "replace").decode("utf-8")
    if len(output) > _MAX_STDERR:
        output = output[:_MAX_STDERR] + f"\n... ({len(output) - _MAX_STDERR} more characters)"
    legend = "; ".join([f"inc/{i} = include_dirs[{i}]" for i in range(len(req.include_dirs))]
                       + [f"flagpath/{i} = {fp.option} path {i} of flags" for i, fp in enumerate(req.flags.paths)]
                       + ["cuda = the CUDA toolkit " + req.toolkit.version])
    return (f"nvcc failed (exit {result.returncode}) for JIT key {req.key} ({req.arch}); nothing was cached.\n"
            f"command: {shlex.join(argv)}\n({legend})\n{output}")


# -- entries --------------------------------------------------------------------------------------

def check_entries(entries: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """The declared entries, checked: each a symbol or a C++ name (``_core.cxxnames``) with parameter types."""
    if not isinstance(entries, Mapping) or not entries:
        raise BadArgumentError(f"entries: expected a non-empty mapping of symbol or C++ name -> parameter types, "
                               f"got {show(entries)}")
    out: dict[str, tuple[str, ...]] = {}
    for name, types in entries.items():
        why = name_problem(name)
        if why is not None:
            raise BadArgumentError(f"entries: expected symbols or C++ names, got {show(name)}: {why}")
        if isinstance(types, str) or not isinstance(types, Sequence):
            raise BadArgumentError(f"entries[{name!r}]: expected a list of parameter types, got {show(types)}")
        for t in types:
            param_type(t)
        out[name] = tuple(types)
    return out


def _check_declared(kernels: Sequence[str], entries: Mapping[str, tuple[str, ...]] | None, k: JitKey,
                    image: CubinImage | None, arch: Arch | None) -> None:
    """Every declared entry names one kernel of the CUBIN, by symbol or C++ name (``_jit.demangle``);
    with the image, that kernel's parameters match the declared types."""
    if not entries:
        return
    resolved = resolve_entries(entries, kernels, where=f"JIT kernel {k}")
    if image is None or arch is None:
        return
    for name, types in entries.items():
        symbol = resolved[name][0]
        m = layout_mismatch([param_type(t) for t in types], arch, image.param_layout(symbol))
        if m is not None:
            kernel = "the CUBIN" if symbol == name else f"the CUBIN's {symbol}"
            raise BadArgumentError(
                f"JIT kernel {k} entry {name!r}: declared {list(types)} (offsets {[o for o, _ in m.expected]}, "
                f"sizes {[s for _, s in m.expected]}), {kernel} has offsets {[o for o, _ in m.actual]}, "
                f"sizes {[s for _, s in m.actual]}"
            )
