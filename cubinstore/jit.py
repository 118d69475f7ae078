"""Run-time compilation under a content key: a kernel library's generated TU, compiled once.

    from cubinstore import jit
    k = jit.compile(tu_text, include_dirs=[f"{site}/deep_gemm/include"], flags=["-DN=4096"],
                    entries={"axpy_f32": ["i32", "f32", "ptr", "ptr"]})
    k.compiled, k.key, k.digest        # whether this call ran nvcc; xxh3:<key>; sha256:<CUBIN>
    k.launch("axpy_f32", grid=..., block=..., args=...)   # like lib.kernel(...).launch

The key (``cubinstore._jit.key``) covers content only, so a second install of the same
library at another prefix, a relocated container or a fresh process hits. A warm call first
tries the direct key (``cubinstore._jit.direct``): only the files an earlier compile of the
same TU included, and the shape of each root, are checked, so it needs no walk of the trees;
``k.found_by`` says whether the direct key, the full key or a compile found it. The CUBIN is an
ordinary blob of the local CAS (by sha256); ``<store>/v1/jit/index`` maps key -> digest.
nvcc runs with the Bazel rule's command shape and environment in a private directory under
the store's root in which every path is relative, so nvcc's messages and the CUBIN carry no
absolute path. N processes missing one key compile it once (a per-key lock and a re-check);
a compile killed at any point leaves no index entry. Every compile is recorded in the warm
set (``cubinstore warmset export`` turns it into Bazel targets for the next release).

The key covers every file the compile read. A file from outside every include root, flag path,
the toolkit and the host compiler's system include directories (``#include "/abs/cfg.h"``) is
known only from nvcc's dependency list: its path and content join the parts of the key the call
reports (``KeyParts.outside``), and the base key (``jit.key``'s) lists that key under
``v1/jit/outside/`` so a later call takes it only while each such file still has its content.
``sealed=True`` refuses such files instead (a compile of data that must not read the host).
Every index entry is a claim re-checked before use (key, parts, CUBIN digest, size, arch and
kernels; ``_verified``); one that does not hold is removed and compiled again, never loaded.
nvcc runs in its own process group with stdin closed and a time limit (``CUBINSTORE_JIT_TIMEOUT``,
``timeout=``); past it the whole group is killed and ``JitTimeoutError`` raised.

This module is the public face (``JitKernel``, ``compile``, ``key``, ``clear_caches``); the
compiler is ``cubinstore._jit.compiler``, the family templates ``cubinstore._jit.family``.
Needs the ``jit`` extra (``xxhash``); ``import cubinstore`` does not import this module.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cubinstore._core.abi import Arch
from cubinstore._core.digest import Digest
from cubinstore._jit import compiler as _compiler
from cubinstore._jit.compiler import clear_caches
from cubinstore._jit.demangle import resolve_entries
from cubinstore._jit.index import IndexEntry
from cubinstore._jit.key import JitKey
from cubinstore.errors import BadArgumentError
if TYPE_CHECKING:
    from cubinstore._jit.family import compile_family_point, resolve_miss
    from cubinstore.manifest import KernelSpec
    from cubinstore.manifest.family import FamilyTemplate
    from cubinstore.launch import Kernel, Library
    from cubinstore.store import Store

__all__ = ["FamilyTemplate", "JitKernel", "clear_caches", "compile", "compile_family_point", "key", "resolve_miss"]


class JitKernel:
    """The result of ``compile``: a CUBIN in the store, launchable like ``Library.kernel``'s ``Kernel``."""

    def __init__(self, key: JitKey, entry: IndexEntry, entries: Mapping[str, Sequence[str]] | None,
                 compiled: bool, store: Store, compile_seconds: float, found_by: str = "compile",
                 names: Mapping[str, str] | None = None) -> None:
        self.key = key
        self.digest: Digest = entry.digest
        self.size = entry.size
        self.arch = entry.arch
        self.kernels: tuple[str, ...] = entry.kernels  # every __global__ symbol of the CUBIN
        # Symbol -> parameter types, as a manifest keys its entries; ``names``: symbol -> the name
        # it was declared by (a C++ name, or the symbol itself), which ``launch`` takes too.
        self.entries: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (entries or {}).items()}
        self.names: dict[str, str] = {s: (names or {}).get(s, s) for s in self.entries}
        self.compiled = compiled  # this call ran nvcc (False: an index hit, or another process compiled it)
        self.compile_seconds = compile_seconds
        # "direct": the included files checked (``cubinstore._jit.direct``); "key": the full key; "compile": nvcc ran.
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
        with self._lock:
            if self._library is None:
                if not self.entries:
                    raise BadArgumentError(
                        f"JIT kernel {self.key} ({', '.join(self.kernels)}): pass entries={{symbol or C++ name: "
                        "[types]}} to compile() to launch it"
                    )
                # The manifest and the launcher (and the driver behind it) load with the first
                # launch, not with `import cubinstore.jit`: a process that only compiles never pays for them.
                from cubinstore.launch import Library
                from cubinstore.manifest import EntrySpec, KernelSpec, Manifest
                from cubinstore.manifest.toolkit import facts

                spec = KernelSpec(
                    id=f"jit/{self.key.hex}/{self.arch}", family="jit", params={"key": self.key.hex},
                    arch=self.arch, digest=self.digest, size=self.size, entries=self.entries,
                    target=f"//jit:k{self.key.hex}",
                    entry_specs={s: EntrySpec(s, self.names[s], types, None) for s, types in self.entries.items()},
                    # The local toolkit that compiled it (its key names the version): the loader checks the driver.
                    **facts(self.key.parts.toolkit.get("version")),  # type: ignore[arg-type]
                )

                self._library = Library(Manifest.build([spec], source=f"JIT {self.key}"), self._store)
            return self._library

    def kernel(self, device: Any = None) -> Kernel:
        """The loaded ``Kernel`` on ``device`` (an ordinal, torch/cuda.core device, or None: current)."""
        return self.library().kernel(f"jit/{self.key.hex}/{self.arch}", device=device)

    def launch(self, entry: str, *, device: Any = None, **kwargs: Any) -> None:
        """``Kernel.launch`` of ``entry`` (its symbol or the name it was declared by) on ``device``:
        ``grid``, ``block``, ``args``, ``shared_mem``, ``cluster``, ``stream``."""
        self.kernel(device).launch(entry, **kwargs)


def key(source: str | os.PathLike[str], *, include_dirs: Sequence[str | os.PathLike[str]], flags: Sequence[str] = (),
        arch: str | Arch | None = None, store: Store | None = None) -> JitKey:
    """The key ``compile`` computes before compiling (its *base* key), with its parts; compiles nothing.

    ``compile`` reports this key unless the compile read files outside every root, flag path,
    the toolkit and the system include directories: then the key it reports also covers those
    files' paths and contents (``k.key.parts.base`` is this key's parts)."""
    return _compiler.key(source, include_dirs=include_dirs, flags=flags, arch=arch, store=store)


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
) -> JitKernel:
    """Compile ``source`` (TU text, or a path to it) for ``arch``, or find it compiled under the same key.

    ``include_dirs``: the library's include roots, absolute, wherever it is installed.
    ``flags``: extra nvcc flags (``-D``, ``-std=``...; absolute ``-I`` paths are keyed by
    content). ``arch``: default the current device's (``sm_XYa`` from Hopper on).
    ``entries``: entry -> parameter types, checked against the CUBIN and needed to launch. An
    entry is named as the Bazel macro names it: an ``extern "C"`` name, a mangled symbol, or the
    C++ name of the function, ``"mylib::scale<128, float>"``, qualified or (when unique)
    unqualified, in any spacing. A C++ name is matched against the CUBIN's kernels demangled by
    the toolkit's ``cu++filt``, else ``c++filt`` on ``$PATH`` (run only for such a name; none is a
    ``DemanglerError`` naming what was tried); an unknown or ambiguous name is a
    ``BadArgumentError`` naming the kernels. ``k.entries`` is keyed by symbol and ``k.names`` maps
    each symbol to its declared name; ``k.launch`` takes either.
    ``family``/``params``: how the warm set names this point (for ``warmset export``).
    ``jit``: may this call run nvcc (default ``CUBINSTORE_JIT``); off, a miss raises
    ``KernelNotFoundError``. A failing compile raises ``JitCompileError`` with nvcc's command
    and output, and caches nothing.
    ``sealed``: the compile may read only files under ``include_dirs``, the flags' paths, the
    toolkit and the host compiler's system include directories; any other file it read fails it
    (``JitCompileError`` naming the path, not quoting nvcc) and nothing is cached.
    ``timeout``: seconds the compile may run (default ``CUBINSTORE_JIT_TIMEOUT``, 600); past it
    nvcc's process group is killed and ``JitTimeoutError`` raised.
    """
    found = _compiler.compile(source, include_dirs=include_dirs, flags=flags, arch=arch, entries=entries, family=family,
                              params=params, store=store, jit=jit, sealed=sealed, timeout=timeout)
    # The compile or the hit checked the declared entries against the CUBIN: this is that match again, memoised.
    declared = found.entries or {}
    resolved = resolve_entries(declared, found.entry.kernels, where=f"JIT kernel {found.key}") if declared else {}
    by_symbol = {symbol: declared[name] for name, (symbol, _) in resolved.items()}
    names = dict(resolved.values())
    return JitKernel(found.key, found.entry, by_symbol, found.compiled, found.store, found.seconds, found.found_by, names)


def __getattr__(name: str) -> Any:
    # The family side (and the manifest it needs) loads on first use, as the launcher does.
    if name in ("compile_family_point", "resolve_miss"):
        from cubinstore._jit import family

        return getattr(family, name)
    if name == "FamilyTemplate":
        from cubinstore.manifest.family import FamilyTemplate

        return FamilyTemplate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
