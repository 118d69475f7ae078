"""The demangler: runs ``cu++filt``/``c++filt`` over a CUBIN's kernel symbols, so an entry declared
by its C++ name (``mylib::scale<128, float>``) finds its symbol (``cubinstore._core.cxxnames``
holds the matching rule).

Used by the build's manifest tool (``demangle`` with the build's demangler command) and by the JIT
(``resolve_entries``), which looks for the toolkit's ``bin/cu++filt``, then ``c++filt`` (binutils)
on ``$PATH``, only when a declared name is not a symbol of the CUBIN: symbols and ``extern "C"``
names need no demangler. The demangler's output is hostile data: it runs with a time limit, its
output is bounded per name and must be one printable ASCII line per name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Final

from cubinstore._core import knobs as _env
from cubinstore._core.cxxnames import function_name
from cubinstore._core.cxxnames import resolve_entries as _resolve
from cubinstore._jit.bounded import run_bounded
from cubinstore.errors import BadArgumentError, DemanglerError

__all__ = ["DEMANGLE_TIMEOUT", "MAX_DEMANGLED_LINE", "DemanglerError", "demangle", "find_demangler",
           "readable_names", "resolve_entries", "run_bounded"]

DEMANGLE_TIMEOUT: Final = 120.0  # seconds
# c++filt prints one name per symbol: a few KiB each at most. More is not a demangler's output.
MAX_DEMANGLED_LINE: Final = 16 * 1024


def demangle(command: str, symbols: Iterable[str], *, timeout: float = DEMANGLE_TIMEOUT) -> dict[str, str]:
    """Symbol -> readable function name, for the mangled ones, through the demangler ``command``.

    The demangler runs at most ``timeout`` seconds and may print at most one bounded line per
    name; a demangler that hangs, cannot start or prints anything else is a ``DemanglerError``."""
    mangled = [s for s in symbols if s.startswith("_Z")]
    if not mangled:
        return {}
    data = ("\n".join(mangled) + "\n").encode("ascii", "replace")
    try:
        status, stdout, stderr = run_bounded([command], data, timeout, MAX_DEMANGLED_LINE * len(mangled))
    except TimeoutError:
        raise DemanglerError(f"demangler {command!r} did not finish within {timeout:g} s for {len(mangled)} names; "
                             f"killed") from None
    except OverflowError:
        raise DemanglerError(f"demangler {command!r} printed more than {MAX_DEMANGLED_LINE} bytes per name for "
                             f"{len(mangled)} names; not a demangler's output") from None
    except OSError as exc:
        raise DemanglerError(f"cannot run the demangler {command!r}: {exc.strerror or exc}") from None
    try:
        lines = stdout.decode("ascii").splitlines()
    except UnicodeDecodeError as exc:
        raise DemanglerError(f"demangler {command!r} printed a byte that is not ASCII at offset {exc.start}; "
                             f"C++ names are ASCII") from None
    if status != 0 or len(lines) != len(mangled):
        why = stderr.decode("utf-8", "replace").strip().splitlines()
        raise DemanglerError(f"demangler {command!r} exited {status} with {len(lines)} lines for "
                             f"{len(mangled)} names: {why[-1][:200] if why else ''}")
    for symbol, line in zip(mangled, lines):
        if not line.strip() or not line.isprintable() or len(line) > MAX_DEMANGLED_LINE:
            raise DemanglerError(f"demangler {command!r} gave {line[:80]!r} for {symbol}: expected a printable C++ name")
    return {s: function_name(line) for s, line in zip(mangled, lines)}


def find_demangler() -> tuple[str | None, list[str]]:
    """The JIT's demangler: the toolkit's ``bin/cu++filt``, else ``c++filt`` on ``$PATH`` (binutils),
    searched as the Bazel repository rule does (``third_party/cuda/cuda_toolkit.bzl``); with what
    was tried, for the error when neither is there."""
    from cubinstore._jit.key import locate_toolkit  # xxhash and the toolkit search: only when a name needs them

    tried = []
    try:
        root, _ = locate_toolkit()
    except BadArgumentError:
        tried.append("the CUDA toolkit's bin/cu++filt (no toolkit found)")
    else:
        cufilt = root / "bin" / "cu++filt"
        if cufilt.is_file() and os.access(cufilt, os.X_OK):
            return str(cufilt), tried
        tried.append(f"{cufilt} (absent)")
    host = _env.which("c++filt")
    if host:
        return host, tried
    tried.append("c++filt on $PATH (not found; binutils has it)")
    return None, tried


# Symbol -> demangled function name, kept for the process: a symbol's demangling never changes.
_readable: dict[str, str] = {}
# (declared names, kernels) -> what ``resolve_entries`` found: a warm hit resolves without re-matching.
_resolved: dict[tuple[tuple[str, ...], tuple[str, ...]], dict[str, tuple[str, str]]] = {}
_MAX_RESOLVED: Final = 4096
_MAX_READABLE: Final = 1 << 16  # symbols; the cache starts over past it
_lock = threading.Lock()


def readable_names(symbols: Collection[str], *, where: str, wanted: Sequence[str]) -> dict[str, str]:
    """Symbol -> demangled function name of each mangled one of ``symbols``, through ``find_demangler``'s
    demangler (once per symbol and process). ``where`` and ``wanted`` (the names that need it) are for
    the error when there is no demangler."""
    with _lock:
        known = {s: _readable[s] for s in symbols if s in _readable}
    missing = sorted(s for s in symbols if s.startswith("_Z") and s not in known)
    if not missing:
        return known
    command, tried = find_demangler()
    if command is None:
        raise DemanglerError(
            f"{where}: entry '{wanted[0]}' is a C++ name, and matching it to a kernel needs a demangler; "
            f"tried {'; '.join(tried)}. Install binutils, or declare the entry by its symbol: "
            f"{', '.join(sorted(symbols))}"
        )
    try:
        found = demangle(command, missing)
    except DemanglerError as exc:
        raise DemanglerError(f"{where}: {exc}") from None
    with _lock:
        if len(_readable) + len(found) > _MAX_READABLE:
            _readable.clear()
        _readable.update(found)
    return {**known, **found}


def resolve_entries(declared: Iterable[str], kernels: Collection[str], *, where: str) -> dict[str, tuple[str, str]]:
    """The JIT's entries: declared name -> (symbol, readable name), by ``cxxnames.resolve_entries``,
    demangling ``kernels`` only when a declared name is not one of them. An entry declared by its
    symbol keeps the symbol as its readable name (no demangler runs for it). Raises
    ``BadArgumentError`` for an unknown or ambiguous name, ``DemanglerError`` without a demangler."""
    names = tuple(declared)
    memo = (names, tuple(sorted(kernels)))
    with _lock:
        hit = _resolved.get(memo)
    if hit is not None:
        return dict(hit)
    wanted = [n for n in names if n not in kernels]
    readable = readable_names(kernels, where=where, wanted=wanted) if wanted else {}
    resolved = _resolve(names, kernels, readable, where=where)
    out = {entry: (symbol, entry if entry in kernels else name) for entry, (symbol, name) in resolved.items()}
    with _lock:
        if len(_resolved) >= _MAX_RESOLVED:
            _resolved.clear()
        _resolved[memo] = out
    return dict(out)
