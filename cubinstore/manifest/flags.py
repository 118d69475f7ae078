"""What a family JIT template may pass to nvcc: an allow-list of options, each matched whole.

A template is data from a release, yet its ``copts`` and ``defines`` reach nvcc's command line,
and nvcc hands them to the host compiler through ``sh -c`` inside double quotes. So an option
that names a file (``@file``, ``--options-file``, ``-include``, ``-I``, ``-MF``, ``-o``), hands
text to another program (``-Xcompiler``, ``-Xlinker``, ``-ccbin``) or keeps files
(``--keep``, ``-save-temps``) could read a host file, run a program or write outside the
compile directory. Only the behaviour flags of ``COPT_RULES`` pass; everything else is refused
when the manifest is opened, naming the option. ``-D`` values may hold any printable ASCII but
``$``, `````, ``\\`` (live inside the shell's double quotes) and ``,`` (nvcc splits a ``-D`` value
there into more defines).

``{param}`` placeholders are checked on the template text (each one standing for a word or a
number) and the filled flags once more before a compile (``cubinstore._jit.family``). Part of the
template schema (``cubinstore.manifest.family``), so it sits below the compiler. Standard library and
``cubinstore._core.abi`` (the name grammar) only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from cubinstore._core.abi import IDENT_RE

__all__ = ["COPT_RULES", "MAX_FLAG_CHARS", "allowed_summary", "copt_problem", "define_problem", "option_of"]

MAX_FLAG_CHARS: Final = 4096

_IDENT: Final = IDENT_RE.pattern
# A -D value: printable ASCII, less what the shell reads inside double quotes and nvcc's list comma.
_DEFINE_VALUE: Final = r"[ !#%&'()*+\-./0-9:;<=>?@A-Z\[\]^_a-z{|}~\"]*"
_DEFINE_RE: Final = re.compile(rf"{_IDENT}(={_DEFINE_VALUE})?", re.ASCII)
# What ptxas may be told through -Xptxas: report and warn, never a file.
_PTXAS_ITEM: Final = (r"(-v|--verbose|--warn-on-spills|-warn-spills|--warn-on-local-memory-usage|-warn-lmem-usage"
                      r"|--warn-on-double-precision-use|-warn-double-usage|-O[0-3])")

# (regex matched whole, how the error message shows it). One table: add a behaviour flag here.
COPT_RULES: Final[tuple[tuple[str, str], ...]] = (
    (r"--?std=c\+\+(14|17|20)", "-std=c++14|17|20"),
    (r"-O[0-3]", "-O0..-O3"),
    (r"--?expt-relaxed-constexpr", "--expt-relaxed-constexpr"),
    (r"--?expt-extended-lambda|--?extended-lambda", "--expt-extended-lambda"),
    (r"-lineinfo|--generate-line-info", "-lineinfo"),
    (r"--?use_fast_math", "--use_fast_math"),
    (r"--?(ftz|prec-div|prec-sqrt|fmad)=(true|false)", "-ftz|-prec-div|-prec-sqrt|-fmad=true|false"),
    (r"--?maxrregcount=[1-9][0-9]{0,2}", "-maxrregcount=<N>"),
    (r"--?extra-device-vectorization", "--extra-device-vectorization"),
    (r"--?restrict", "--restrict"),
    (r"--?resource-usage|-res-usage", "--resource-usage"),
    (r"-w|--disable-warnings", "-w"),
    (r"--?diag-suppress=[0-9]{1,5}(,[0-9]{1,5})*", "--diag-suppress=<N>[,<N>...]"),
    (r"-Wno-deprecated-gpu-targets|-Wno-deprecated-declarations", "-Wno-deprecated-gpu-targets|-declarations"),
    (rf"-D{_IDENT}(={_DEFINE_VALUE})?", "-D<name>[=<value>]"),
    (rf"-U{_IDENT}", "-U<name>"),
    (rf"(-Xptxas|--ptxas-options)={_PTXAS_ITEM}(,{_PTXAS_ITEM})*",
     "-Xptxas=<-v|--warn-on-spills|--warn-on-local-memory-usage|--warn-on-double-precision-use|-O<N>>[,...]"),
)
_COMPILED: Final = tuple((re.compile(pattern, re.ASCII), shown) for pattern, shown in COPT_RULES)
# The option part of a flag, for messages: "-Xcompiler=@x" -> "-Xcompiler", "-I/x" -> "-I".
_OPTION_RE: Final = re.compile(r"-{1,2}[A-Za-z][A-Za-z0-9_+]*(-[A-Za-z][A-Za-z0-9_+]*)*|@", re.ASCII)
_PLACEHOLDER_STANDINS: Final = ("1", "x")  # a placeholder is filled with a word or an int


def allowed_summary() -> str:
    """The allowed options, for error messages."""
    return ", ".join(shown for _, shown in COPT_RULES)


def option_of(flag: str) -> str:
    """The option a flag spells, for messages (``-Xcompiler=@f`` -> ``-Xcompiler``)."""
    match = _OPTION_RE.match(flag)
    return match.group(0) if match else flag.split("=", 1)[0]


def _path_like(flag: str) -> str | None:
    if "\0" in flag or "\n" in flag or "\r" in flag:
        return "holds NUL or a line break"
    if len(flag) > MAX_FLAG_CHARS:
        return f"is longer than {MAX_FLAG_CHARS} characters"
    return None


def _copt_value_problem(flag: str) -> str | None:
    """A copt never names a file: no '/', no '..', no value starting with '@'."""
    value = flag.split("=", 1)[1] if "=" in flag else flag
    if flag.startswith("@") or value.startswith("@") or "/" in flag or ".." in flag:
        return "names a path ('/', '..' or a leading '@'); a JIT template's options never name files"
    return None


def copt_problem(flag: str, grid_keys: Sequence[str] = ()) -> str | None:
    """Why ``flag`` may not be a template copt (None: allowed). ``{key}`` of ``grid_keys`` stands for a parameter."""
    if not isinstance(flag, str):
        return f"expected a string, got {type(flag).__name__}"
    why = _path_like(flag)
    if why is not None:
        return f"{flag[:80]!r} {why}"
    candidates = _with_standins(flag, grid_keys)
    if not any(_matches(c) for c in candidates):
        option = option_of(flag)
        spelled = "" if option == flag else f" ({flag!r})"
        return f"option {option!r}{spelled} is not allowed in a JIT template; allowed: {allowed_summary()}"
    if all(_copt_value_problem(c) for c in candidates if _matches(c)):
        return f"{flag!r} {_copt_value_problem(flag) or 'names a path'}"
    return None


def define_problem(define: str, grid_keys: Sequence[str] = ()) -> str | None:
    """Why ``define`` (``NAME`` or ``NAME=VALUE``, without ``-D``) may not be a template define (None: allowed)."""
    if not isinstance(define, str):
        return f"expected a string, got {type(define).__name__}"
    why = _path_like(define)
    if why is not None:
        return f"{define[:80]!r} {why}"
    if any(_DEFINE_RE.fullmatch(c) for c in _with_standins(define, grid_keys)):
        return None
    return (f"{define!r}: expected NAME or NAME=VALUE, NAME a C identifier and VALUE printable ASCII "
            "without $ ` \\ or ',' (nvcc passes -D through a shell and splits it at commas)")


def _with_standins(text: str, grid_keys: Sequence[str]) -> list[str]:
    placeholders = [k for k in grid_keys if "{" + k + "}" in text]
    if not placeholders:
        return [text]
    out = []
    for standin in _PLACEHOLDER_STANDINS:
        filled = text
        for k in placeholders:
            filled = filled.replace("{" + k + "}", standin)
        out.append(filled)
    return out


def _matches(flag: str) -> bool:
    return any(rx.fullmatch(flag) for rx, _ in _COMPILED)
