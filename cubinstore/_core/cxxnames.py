"""C++ entry names: which kernel of a CUBIN a declared entry names, defined once for the build's
manifest tool (``tools/manifest_tool.py``) and the JIT (``cubinstore._jit.demangle``).

An entry is declared as a symbol (an ``extern "C"`` name or a mangled name) or as the C++ name
of a function, ``ns::gemm<128, 256>``, qualified or, when unique, unqualified, in any spacing and
with or without integer suffixes (``128u``). Matching is token for token against the demangled
names of the CUBIN's kernels, never against a piece of their template arguments.

Pure: the demangled names come from the caller, which runs the demangler
(``cubinstore._jit.demangle``; ``_core`` runs no program).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Final

from cubinstore._core.grammar import IDENT_RE
from cubinstore.errors import BadArgumentError

__all__ = ["MAX_NAME_CHARS", "function_name", "name_problem", "names_entry", "normalize_name", "resolve_entries",
           "resolve_entry"]

# The limit on an entry's readable name: the manifest's too (cubinstore/manifest/schema.py imports it).
MAX_NAME_CHARS: Final = 1024

# A C-style cast of an integer literal: "(int)256", "(unsigned long)3", "(long long)-1".
_INT_CAST_RE: Final = re.compile(
    r"\((?:(?:un)?signed |const )*(?:char|short|int|long|long long|long int|__int128|unsigned|bool)\)\s*(-?[0-9]+)", re.ASCII)
_INT_SUFFIX_RE: Final = re.compile(r"\b(\d+)(?:u|l|ul|lu|ll|ull|llu)\b", re.IGNORECASE)
# A C++ name's tokens: words, numbers, '::', and single punctuation ('>>' is two closing brackets).
_TOKEN_RE: Final = re.compile(rf"{IDENT_RE.pattern}|[0-9]+|::|\S", re.ASCII)
_OPEN: Final = frozenset("<([")
_CLOSE: Final = frozenset(">)]")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be an entry's name (it must fit the manifest: printable ASCII,
    1..``MAX_NAME_CHARS``), or None."""
    if not isinstance(name, str) or not name:
        return "expected a non-empty string"
    if len(name) > MAX_NAME_CHARS:
        return f"expected at most {MAX_NAME_CHARS} characters, got {len(name)}"
    if not (name.isascii() and name.isprintable()):
        return "expected printable ASCII"
    return None


def normalize_name(name: str) -> str:
    """A C++ name in one spelling: no blanks except between words, no integer suffixes, no casts
    on integer template arguments (``cu++filt`` writes ``f<(int)256>`` where ``c++filt`` writes ``f<256>``)."""
    name = _INT_CAST_RE.sub(r"\1", name)
    name = _INT_SUFFIX_RE.sub(r"\1", name)
    name = re.sub(r"\s+", " ", name.strip())
    return re.sub(r"\s*([<>,:()*&\[\]])\s*", r"\1", name)


def function_name(demangled: str) -> str:
    """`void ns::f<1, 2>(int, float*)` -> `ns::f<1, 2>`: drop the return type and the parameters."""
    text = demangled.strip()
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i]
                break
    depth, start = 0, 0
    for i, c in enumerate(text):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == " " and depth == 0:
            start = i + 1
    return text[start:].strip()


def _tokens(name: str) -> list[str]:
    tokens = _TOKEN_RE.findall(normalize_name(name))
    return tokens[1:] if tokens[:1] == ["::"] else tokens  # `::ns::f` is `ns::f`


def _unqualified(tokens: list[str]) -> list[str] | None:
    """The tokens after the last '::' outside brackets (the unqualified name); None if unbalanced."""
    depth, start = 0, 0
    for i, token in enumerate(tokens):
        if token in _OPEN:
            depth += 1
        elif token in _CLOSE:
            depth -= 1
            if depth < 0:
                return None
        elif token == "::" and depth == 0:
            start = i + 1
    return tokens[start:] if depth == 0 else None


def names_entry(declared: str, readable: str) -> bool:
    """Whether ``declared`` names the function ``readable`` (a demangled function name): its whole
    qualified name, or its unqualified name, token for token; never a piece of its template arguments."""
    wanted, name = _tokens(declared), _tokens(readable)
    if not wanted:
        return False
    if wanted == name:
        return True
    unqualified = _unqualified(name)
    return unqualified == wanted and _unqualified(wanted) == wanted  # `wanted` has no '::' of its own


def resolve_entry(declared: str, kernels: Collection[str], readable: Mapping[str, str], *,
                  where: str) -> tuple[str, str]:
    """(symbol, readable name) of the declared entry among ``kernels`` (the CUBIN's symbols), whose
    demangled function names are ``readable`` (symbol -> name, for the mangled ones): its symbol,
    or its whole C++ name (qualified or, when unique, unqualified).

    Raises ``BadArgumentError``, prefixed with ``where``, naming the entry and the candidates."""
    if declared in kernels:
        return declared, readable.get(declared, declared)
    wanted = _tokens(declared)
    qualified = sorted(s for s, name in readable.items() if _tokens(name) == wanted)
    matches = qualified or sorted(s for s, name in readable.items() if names_entry(declared, name))
    if len(matches) == 1:
        return matches[0], declared
    if matches:
        raise BadArgumentError(f"{where}: entry '{declared}' matches {len(matches)} kernels of its CUBIN: "
                               f"{', '.join(matches)}; name it by its symbol or fully qualified")
    found = ", ".join(f"{readable.get(s, s)} ({s})" for s in sorted(kernels)) or "none"
    raise BadArgumentError(f"{where}: entry '{declared}' is not a kernel of its CUBIN; its kernels: {found}")


def resolve_entries(declared: Iterable[str], kernels: Collection[str], readable: Mapping[str, str], *,
                    where: str) -> dict[str, tuple[str, str]]:
    """Declared entry -> (symbol, readable name), each by ``resolve_entry``; two entries naming
    one kernel are a ``BadArgumentError`` (the kernel would have two declarations)."""
    out: dict[str, tuple[str, str]] = {}
    named: dict[str, str] = {}  # symbol -> the readable name of the entry that took it
    for entry in declared:
        symbol, name = resolve_entry(entry, kernels, readable, where=where)
        if symbol in named:
            raise BadArgumentError(f"{where}: entries '{named[symbol]}' and '{entry}' are one kernel, {symbol}")
        named[symbol] = name
        out[entry] = (symbol, name)
    return out

