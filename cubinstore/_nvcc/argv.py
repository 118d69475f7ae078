"""Which nvcc calls ``cubinstore-nvcc`` caches, and what they ask for.

A call is cached only when every word of it is modelled here: one ``.cu`` source compiled with
``-cubin``, ``-ptx`` or ``-fatbin`` to the file ``-o`` names, for one real architecture (``-arch=sm_90a``), with include
directories and behaviour flags from ``_FLAG_RULES``. Anything else (``--version``, ``-c``,
linking, several inputs, ``-gencode``, ``-M*``, ``--keep``, an option this table does not know)
is a ``PassThrough``: the real nvcc runs it unchanged. So is a call under environment variables
that change what nvcc or the host compiler does without appearing on the command line
(``knobs.NVCC_OVERRIDES``: ``NVCC_PREPEND_FLAGS``, ``CPATH``...). Misreading a call can only make it uncached, never
cached wrongly: an option is modelled only when its whole effect is on the CUBIN's bytes (which
the key covers) and the files it reads (which nvcc's dependency list names).

Standard library and the name grammar (``_core.grammar``): this runs on every call, hits included.
"""

from __future__ import annotations

import os
import re

from cubinstore._core.grammar import IDENT_RE, decimal

__all__ = ["Call", "PassThrough", "parse"]

_ARCH_RE = re.compile(r"sm_[1-9][0-9]{1,2}[af]?", re.ASCII)


def _spellings(*names: str) -> set[str]:
    """Each option as nvcc takes it, with one dash and with two."""
    return {spelled for name in names for spelled in (f"-{name}", f"--{name}")}


_STDS = ("c++11", "c++14", "c++17", "c++20", "c++23")
_BOOLS = ("true", "false")
# Behaviour flags, spelled whole: each changes only the CUBIN (and the messages), reads no file
# the dependency list would not name, and writes none. Sets, not patterns: the hit path runs
# this on every call, and compiling a table of patterns costs more than the whole check.
_FLAGS = frozenset({
    *_spellings(*(f"std={s}" for s in _STDS), "expt-relaxed-constexpr", "expt-extended-lambda", "extended-lambda",
                "use_fast_math", "extra-device-vectorization", "restrict", "resource-usage", "x=cu",
                *(f"{o}={b}" for o in ("ftz", "prec-div", "prec-sqrt", "fmad", "relocatable-device-code") for b in _BOOLS),
                *(f"default-stream={m}" for m in ("legacy", "null", "per-thread"))),
    "-O0", "-O1", "-O2", "-O3", "-lineinfo", "--generate-line-info", "-G", "--device-debug", "-res-usage", "-w",
    "--disable-warnings", "-rdc=true", "-rdc=false", "-Wno-deprecated-gpu-targets", "-Wno-deprecated-declarations",
    "-Werror=all-warnings", "-Wreorder",
})
# Behaviour flags with a number or a list of numbers: option -> (most items, most digits an item).
_NUMBERED = {**{o: (64, 5) for o in _spellings("diag-suppress", "diag-warn", "diag-error")},
             **{o: (1, 3) for o in _spellings("maxrregcount")}}
# What ptxas may be told: optimisation and reporting, never a file.
_PTXAS_ITEMS = frozenset({
    "-v", "--verbose", "-O0", "-O1", "-O2", "-O3", "--warn-on-spills", "-warn-spills", "--warn-on-local-memory-usage",
    "-warn-lmem-usage", "--warn-on-double-precision-use", "-warn-double-usage", "--disable-optimizer-constants",
    "--extensible-whole-program", "-lineinfo", "--generate-line-info",
    *_spellings(*(f"allow-expensive-optimizations={b}" for b in _BOOLS)),
})
_PTXAS_NUMBERED = {**{o: (1, 2) for o in _spellings("register-usage-level")}, **{o: (1, 3) for o in _spellings("maxrregcount")}}
# What the host compiler may be told: code generation and warnings, never a file or a program.
_HOST_ITEMS = frozenset({
    "-fPIC", "-fpic", "-fPIE", "-fpie", "-O0", "-O1", "-O2", "-O3", "-Os", "-Og", "-g", "-w", "-Werror", "-pthread",
    "-fvisibility=default", "-fvisibility=hidden",
    *(f"-std={d}{s[1:]}" for d in ("c", "gnu") for s in _STDS),
    *(f"-f{no}{name}" for no in ("", "no-") for name in (
        "concepts", "exceptions", "rtti", "strict-aliasing", "permissive", "fast-math", "openmp", "omit-frame-pointer",
        "visibility-inlines-hidden", "math-errno", "trapping-math", "inline-functions", "unroll-loops", "tree-vectorize")),
})
_LOWER_WORD = frozenset("abcdefghijklmnopqrstuvwxyz0123456789+-")


def _numbered(value: str, items: int, digits: int) -> bool:
    parts = value.split(",")
    return len(parts) <= items and all(decimal(p, digits) is not None for p in parts)


def _with_number(item: str, table: dict[str, tuple[int, int]]) -> bool:
    option, eq, value = item.partition("=")
    return bool(eq) and option in table and _numbered(value, *table[option])


def _flag_ok(flag: str) -> bool:
    return flag in _FLAGS or _with_number(flag, _NUMBERED)


def _ptxas_ok(item: str) -> bool:
    return item in _PTXAS_ITEMS or _with_number(item, _PTXAS_NUMBERED)


def _host_ok(item: str) -> bool:
    """A host compiler option that only changes code generation or warnings."""
    if item in _HOST_ITEMS:
        return True
    if item.startswith(("-D", "-U")):
        name, eq, value = item[2:].partition("=")
        return bool(IDENT_RE.fullmatch(name)) and (item[1] == "D" or not eq) and all(
            c.isascii() and (c.isalnum() or c in "_.+-") for c in value)
    if item.startswith(("-march=", "-mtune=")):
        value = item.split("=", 1)[1]
        return 0 < len(value) <= 32 and _LOWER_WORD.issuperset(value)
    if item.startswith("-W") and not item.startswith(("-Wl,", "-Wa,", "-Wp,")):
        # -W[no-]<name>[=<n>]: a warning switch (-Wl/-Wa/-Wp hand text to other programs).
        name, eq, level = item[2:].removeprefix("no-").partition("=")
        return (0 < len(name) <= 64 and name[0].isalpha() and _LOWER_WORD.issuperset(name)
                and (not eq or _numbered(level, 1, 3)))
    return False


def _define_ok(value: str) -> bool:
    """``NAME`` or ``NAME=VALUE``: VALUE printable ASCII but what nvcc's shell reads (``$ ` \\``) and
    its list comma (nvcc splits a -D value there)."""
    name, _, rest = value.partition("=")
    return bool(IDENT_RE.fullmatch(name)) and all(" " <= c <= "~" and c not in "$`\\," for c in rest)


# Options whose value is a separate word, and how a value is checked.
_VALUE_OPTIONS = {
    "-o": "output", "--output-file": "output",
    "-arch": "arch", "--gpu-architecture": "arch",
    "-I": "include", "--include-path": "include",
    "-isystem": "system", "--system-include": "system",
    "-D": "define", "--define-macro": "define",
    "-U": "undefine", "--undefine-macro": "undefine",
    "-Xptxas": "ptxas", "--ptxas-options": "ptxas",
    "-Xcompiler": "host", "--compiler-options": "host",
    "-std": "std", "--std": "std",
    "-x": "lang", "--x": "lang",
    "-diag-suppress": "diag", "--diag-suppress": "diag",
}
_GLUED = ("-I", "-D", "-U", "-o")  # also spelled with the value attached: -I/x, -DN=1
_KIND_OPTIONS = {"-cubin": "cubin", "--cubin": "cubin", "-ptx": "ptx", "--ptx": "ptx", "-fatbin": "fatbin",
                 "--fatbin": "fatbin"}
_MAX_WORDS = 4096


class PassThrough:
    """A call the real nvcc runs as it is; ``why`` says which word made it so (for the debug log)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"PassThrough({self.why!r})"


class Call:
    """A cacheable call: its source and output (as spelled, and absolute), arch, include roots and flags.

    ``include_dirs`` are the ``-I`` directories, absolute, in order; ``flags`` everything else the
    JIT passes on (``-isystem`` with absolute paths, which the JIT keys by content)."""

    __slots__ = ("source", "source_arg", "output", "output_arg", "arch", "include_dirs", "include_args", "flags", "kind")

    def __init__(self, source: str, source_arg: str, output: str, output_arg: str, arch: str,
                 include_dirs: tuple[str, ...], include_args: tuple[str, ...], flags: tuple[str, ...], kind: str) -> None:
        self.source = source
        self.source_arg = source_arg
        self.output = output
        self.output_arg = output_arg
        self.arch = arch
        self.include_dirs = include_dirs
        self.include_args = include_args  # each -I as spelled: what the replayed messages name
        self.flags = flags
        self.kind = kind

    def __repr__(self) -> str:
        return f"Call({self.source_arg!r} -> {self.output_arg!r}, {self.arch}, {len(self.include_dirs)} roots, {self.flags})"


def _absolute(path: str, cwd: str) -> str:
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(cwd, path))


def _split_value(word: str) -> tuple[str, str | None] | None:
    """(option, value) for an option of ``_VALUE_OPTIONS`` spelled ``opt``, ``opt=v`` or glued ``-Iv``."""
    if word in _VALUE_OPTIONS:
        return word, None
    if word.startswith("-") and "=" in word:
        opt, value = word.split("=", 1)
        if opt in _VALUE_OPTIONS:
            return opt, value
    for opt in _GLUED:
        if word.startswith(opt) and len(word) > len(opt) and not word.startswith("--"):
            return opt, word[len(opt):]
    return None


def parse(args: list[str], cwd: str, overrides: list[str]) -> Call | PassThrough:
    """Read nvcc's arguments (without argv[0]); ``cwd`` resolves relative paths. ``overrides``:
    the variables of ``knobs.NVCC_OVERRIDES`` that are set (any makes the call a pass-through)."""
    if overrides:
        return PassThrough(f"${overrides[0]} is set")
    if len(args) > _MAX_WORDS:
        return PassThrough("too many words")
    sources: list[str] = []
    output = arch = kind = None
    includes: list[str] = []
    flags: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if not word or "\0" in word or "\n" in word:
            return PassThrough("an empty word or one holding NUL or a line break")
        if not word.startswith("-"):
            sources.append(word)
            continue
        if word.startswith("-odir") or word.startswith("--output-directory"):
            return PassThrough(f"option {word!r} is not modelled")
        if word in _KIND_OPTIONS:
            if kind is not None:
                return PassThrough("two output kinds")
            kind = _KIND_OPTIONS[word]
            continue
        if _flag_ok(word):
            flags.append(word)
            continue
        split = _split_value(word)
        if split is None:
            return PassThrough(f"option {word!r} is not modelled")
        opt, value = split
        if value is None:
            if i >= len(args):
                return PassThrough(f"{opt} without a value")
            value = args[i]
            i += 1
        what = _VALUE_OPTIONS[opt]
        if what == "output":
            if output is not None:
                return PassThrough("two -o")
            output = value
        elif what == "arch":
            if arch is not None or not _ARCH_RE.fullmatch(value):
                return PassThrough(f"{opt} {value!r}: only one real architecture (sm_XY[a|f]) is cached")
            arch = value
        elif what == "include":
            if not value:
                return PassThrough(f"{opt} without a directory")
            includes.append(value)
        elif what == "system":
            if not value:
                return PassThrough(f"{opt} without a directory")
            flags.extend(["-isystem", _absolute(value, cwd)])
        elif what == "define":
            if not _define_ok(value):
                return PassThrough(f"-D{value!r} is not modelled")
            flags.append("-D" + value)
        elif what == "undefine":
            if not IDENT_RE.fullmatch(value):
                return PassThrough(f"-U{value!r} is not modelled")
            flags.append("-U" + value)
        elif what == "ptxas":
            if not all(_ptxas_ok(item) for item in value.split(",")):
                return PassThrough(f"ptxas option {value!r} is not modelled")
            flags.append("--ptxas-options=" + value)
        elif what == "host":
            if not all(_host_ok(item) for item in value.split(",")):
                return PassThrough(f"host compiler option {value!r} is not modelled")
            flags.append("--compiler-options=" + value)
        elif what == "std":
            if value not in _STDS:
                return PassThrough(f"-std {value!r} is not modelled")
            flags.append("-std=" + value)
        elif what == "lang":
            if value != "cu":
                return PassThrough(f"-x {value!r}")
        elif what == "diag":
            if not _numbered(value, 64, 5):
                return PassThrough(f"--diag-suppress {value!r} is not modelled")
            flags.append("--diag-suppress=" + value)
    if kind is None:
        return PassThrough("no -cubin, -ptx or -fatbin")
    if len(sources) != 1 or not sources[0].endswith(".cu"):
        return PassThrough(f"expected one .cu input, got {len(sources)} inputs")
    if output is None:
        return PassThrough("no -o")
    if arch is None:
        return PassThrough("no -arch")
    source = _absolute(sources[0], cwd)
    return Call(source, sources[0], _absolute(output, cwd), output, arch,
                tuple(_absolute(d, cwd) for d in includes), tuple(includes), tuple(flags), kind)
