"""The parameter types an Itanium-mangled kernel symbol carries, as cubinstore's types.

A kernel's declared types (``i32``, ``f32``, ``ptr`` ...) are checked by layout against its
CUBIN (``abi.layout_mismatch``), which cannot tell ``i32`` from ``f32`` or ``ptr`` from ``u64``.
A mangled name (``_Z4axpyIfEviT_PS0_S1_``) says more: ``decode_params`` reads its parameter
list far enough to map builtin types, pointers and ``CUtensorMap`` to cubinstore's types; any
other parameter (a class, an enum, a reference) is unknown and left to the layout check. An
``extern "C"`` symbol carries no types.

The decoder follows the Itanium C++ ABI's grammar for what kernels use: nested and template
names, template arguments and literals, substitutions (``S_``, ``S0_``, ``St``) and template
parameters (``T_``), which it resolves so that ``float*`` repeated as ``S1_`` is still a
pointer. Anything outside that subset (function types, expressions, lambdas, packs) makes the
whole symbol undecodable: ``decode_params`` returns None and nothing is checked, never a guess.

Pure and bounded: the symbol comes from a CUBIN, so its length and nesting are limited and a
malformed one is "undecodable", not an exception. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_SYMBOL_CHARS", "MangledParam", "decode_params", "type_problem"]

# Longer symbols (CUTLASS's run to a few thousand characters) are not decoded.
MAX_SYMBOL_CHARS: Final = 64 * 1024
# Nesting of types and template arguments the decoder follows before giving up.
_MAX_DEPTH: Final = 128

# Builtin type codes -> (C++ spelling, the cubinstore types that declare it). `char` and `bool`
# are one byte of either signedness to cubinstore, which has no char or bool type.
_BUILTINS: Final[dict[str, tuple[str, frozenset[str]]]] = {
    "v": ("void", frozenset()),
    "b": ("bool", frozenset({"u8", "i8"})),
    "c": ("char", frozenset({"i8", "u8"})),
    "a": ("signed char", frozenset({"i8"})),
    "h": ("unsigned char", frozenset({"u8"})),
    "s": ("short", frozenset({"i16"})),
    "t": ("unsigned short", frozenset({"u16"})),
    "i": ("int", frozenset({"i32"})),
    "j": ("unsigned int", frozenset({"u32"})),
    "l": ("long", frozenset({"i64"})),
    "m": ("unsigned long", frozenset({"u64"})),
    "x": ("long long", frozenset({"i64"})),
    "y": ("unsigned long long", frozenset({"u64"})),
    "f": ("float", frozenset({"f32"})),
    "d": ("double", frozenset({"f64"})),
    "Dh": ("__fp16", frozenset({"f16"})),
    "DF16_": ("_Float16", frozenset({"f16"})),
    "DF16b": ("std::bfloat16_t", frozenset({"bf16"})),
    # Builtins cubinstore has no type for: known, so they parse, but never checked.
    "w": ("wchar_t", frozenset()),
    "n": ("__int128", frozenset()),
    "o": ("unsigned __int128", frozenset()),
    "e": ("long double", frozenset()),
    "g": ("__float128", frozenset()),
    "z": ("...", frozenset()),
    "Dd": ("decimal64", frozenset()),
    "De": ("decimal128", frozenset()),
    "Df": ("decimal32", frozenset()),
    "Di": ("char32_t", frozenset()),
    "Ds": ("char16_t", frozenset()),
    "Du": ("char8_t", frozenset()),
    "Da": ("auto", frozenset()),
    "Dc": ("decltype(auto)", frozenset()),
    "Dn": ("std::nullptr_t", frozenset()),
}
# CUtensorMap is `typedef struct CUtensorMap_st {...} CUtensorMap` at global scope (cuda.h).
_TENSOR_MAP_CLASS: Final = "CUtensorMap_st"
_QUALIFIERS: Final = {"r": "restrict", "V": "volatile", "K": "const"}
_SUBSTITUTION_ABBREVIATIONS: Final = frozenset("absiod")  # Sa (std::allocator) ... Sd (std::iostream)
_BASE36: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class MangledParam:
    """One parameter as its symbol spells it: the mangled text, a C++ description, and the
    cubinstore types that declare it (empty: unknown, not checked)."""

    mangled: str
    spelling: str
    allowed: frozenset[str]


class _Undecodable(Exception):
    pass


@dataclass(frozen=True)
class _Type:
    """What the decoder keeps of a type: how to describe it and which cubinstore types declare it."""

    spelling: str
    allowed: frozenset[str] = frozenset()


_UNKNOWN_CLASS: Final = _Type("a class or enum")
_POINTER_ALLOWED: Final = frozenset({"ptr"})


class _Decoder:
    def __init__(self, symbol: str) -> None:
        self.text = symbol
        self.pos = 0
        self.subs: list[_Type] = []
        self.function_args: list[_Type] = []  # of the function's own name, for T_
        self.depth = 0

    # -- reading ------------------------------------------------------------------------------
    def peek(self, n: int = 1) -> str:
        return self.text[self.pos:self.pos + n]

    def take(self, prefix: str) -> bool:
        if self.text.startswith(prefix, self.pos):
            self.pos += len(prefix)
            return True
        return False

    def expect(self, prefix: str) -> None:
        if not self.take(prefix):
            raise _Undecodable(f"expected {prefix!r} at {self.pos}")

    def number(self) -> int:
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos or self.pos - start > 6:
            raise _Undecodable(f"expected a length at {start}")
        return int(self.text[start:self.pos])

    def enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Undecodable("nested too deeply")

    # -- names --------------------------------------------------------------------------------
    def source_name(self) -> str:
        length = self.number()
        name = self.text[self.pos:self.pos + length]
        if len(name) != length:
            raise _Undecodable("a name runs past the end")
        self.pos += length
        return name

    def unqualified_name(self) -> str:
        self.take("L")  # internal linkage (GCC's `_ZL`)
        if not self.peek().isdigit():
            raise _Undecodable(f"unsupported name at {self.pos}")  # operators, lambdas, ctors
        name = self.source_name()
        while self.take("B"):  # ABI tags
            self.source_name()
        return name

    def substitution(self) -> _Type:
        """After 'S': a back reference (S_, S<base-36>_) or an abbreviation (Sa ... Sd)."""
        if self.peek() in _SUBSTITUTION_ABBREVIATIONS and self.peek():
            self.pos += 1
            return _UNKNOWN_CLASS
        index = 0
        if not self.take("_"):
            start = self.pos
            while self.peek() and self.peek() in _BASE36:
                self.pos += 1
            if start == self.pos or self.pos - start > 4:
                raise _Undecodable(f"bad substitution at {start}")
            index = int(self.text[start:self.pos], 36) + 1
            self.expect("_")
        if index >= len(self.subs):
            raise _Undecodable(f"substitution {index} of {len(self.subs)}")
        return self.subs[index]

    def template_param(self) -> _Type:
        """After 'T': T_ or T<n>_, the function's n-th template argument."""
        index = 0 if self.take("_") else self.number() + 1
        if index and not self.take("_"):
            raise _Undecodable(f"bad template parameter at {self.pos}")
        if index >= len(self.function_args):
            raise _Undecodable(f"template parameter {index} of {len(self.function_args)}")
        return self.function_args[index]

    def template_args(self, record: bool) -> None:
        """'I', arguments, 'E'; ``record``: they are the function's own (for T_)."""
        self.expect("I")
        self.enter()
        args: list[_Type] = []
        while not self.take("E"):
            args.append(self.template_arg())
        if record:
            self.function_args = args
        self.depth -= 1

    def template_arg(self) -> _Type:
        if self.take("L"):  # a literal: L <type> <value> E
            if self.peek() == "_":
                raise _Undecodable("an external name as a template argument")
            self.type()
            start = self.pos
            while self.peek() and self.peek() != "E":
                self.pos += 1
            if self.pos - start > 64:
                raise _Undecodable("a literal too long")
            self.expect("E")
            return _Type("a value")
        if self.take("J"):  # a pack
            self.enter()
            while not self.take("E"):
                self.template_arg()
            self.depth -= 1
            return _Type("a pack")
        if self.peek() == "X":
            raise _Undecodable("an expression as a template argument")
        return self.type()

    def nested_name(self, record: bool) -> bool:
        """After 'N': a qualified name; adds its prefixes as substitutions (not the whole name,
        which the caller adds where it is a type). Returns whether it ends with template arguments."""
        while self.peek() and self.peek() in "rVKRO":
            self.pos += 1
        pushed = 0
        named = False  # template arguments need a name before them
        ends_with_args = False
        while not self.take("E"):
            if not self.peek():
                raise _Undecodable("a nested name runs past the end")
            if self.peek() == "I":
                if not named:
                    raise _Undecodable("template arguments without a name")
                self.template_args(record)
                ends_with_args = True
            elif self.take("St"):
                continue  # `std::`, not a substitution of its own
            elif self.peek() == "S":
                self.pos += 1
                self.substitution()
                named, ends_with_args = True, False
                continue  # the prefix it names is one already
            elif self.peek() == "T":
                self.pos += 1
                self.template_param()
                ends_with_args = False
            else:
                self.unqualified_name()
                ends_with_args = False
            named = True
            self.subs.append(_UNKNOWN_CLASS)
            pushed += 1
        if not pushed:
            raise _Undecodable("an empty nested name")
        self.subs.pop()  # the whole name is no prefix
        return ends_with_args

    def unscoped_type(self) -> _Type:
        """A class or enum named at global scope, perhaps a template specialization."""
        name = self.unqualified_name()
        if self.peek() == "I":
            self.subs.append(_UNKNOWN_CLASS)  # the template's name
            self.template_args(record=False)
            return _UNKNOWN_CLASS
        if name == _TENSOR_MAP_CLASS:
            return _Type("CUtensorMap", frozenset({"tensormap"}))
        return _UNKNOWN_CLASS

    # -- types --------------------------------------------------------------------------------
    def builtin(self) -> _Type | None:
        for code in (self.peek(5), self.peek(2), self.peek(1)):
            if code in _BUILTINS:
                self.pos += len(code)
                spelling, allowed = _BUILTINS[code]
                return _Type(spelling, allowed)
        return None

    def type(self) -> _Type:
        self.enter()
        try:
            found = self.builtin()
            if found is not None:
                return found  # builtins are never substitutions
            c = self.peek()
            if c in ("r", "V", "K"):
                words = []
                while self.peek() and self.peek() in _QUALIFIERS:
                    words.append(_QUALIFIERS[self.peek()])
                    self.pos += 1
                inner = self.type()
                found = _Type(f"{' '.join(words)} {inner.spelling}", inner.allowed)
            elif c == "P":
                self.pos += 1
                found = _Type(f"pointer to {self.type().spelling}", _POINTER_ALLOWED)
            elif c in ("R", "O"):
                self.pos += 1
                found = _Type(f"reference to {self.type().spelling}")
            elif c == "T" and self.peek(2)[1:] in ("_", *"0123456789"):
                self.pos += 1
                found = self.template_param()
                if self.peek() == "I":
                    self.subs.append(found)
                    self.template_args(record=False)
                    found = _UNKNOWN_CLASS
            elif self.take("St"):
                self.unqualified_name()
                if self.peek() == "I":
                    self.subs.append(_UNKNOWN_CLASS)
                    self.template_args(record=False)
                found = _UNKNOWN_CLASS
            elif c == "S":
                self.pos += 1
                found = self.substitution()
                if self.peek() != "I":
                    return found  # already a substitution: not added again
                self.template_args(record=False)
                found = _UNKNOWN_CLASS
            elif c == "N":
                self.pos += 1
                self.nested_name(record=False)
                found = _UNKNOWN_CLASS
            elif c.isdigit() or c == "L":
                found = self.unscoped_type()
            else:
                raise _Undecodable(f"unsupported type {c!r} at {self.pos}")
            self.subs.append(found)
            return found
        finally:
            self.depth -= 1

    # -- the encoding -------------------------------------------------------------------------
    def function_name(self) -> bool:
        """The encoding's name; returns whether it is a template specialization (whose
        parameter list starts with the return type)."""
        if self.take("N"):
            return self.nested_name(record=True)
        if self.peek() in ("Z", "S"):
            raise _Undecodable("a local or substituted function name")
        self.unqualified_name()
        if self.peek() == "I":
            self.subs.append(_UNKNOWN_CLASS)
            self.template_args(record=True)
            return True
        return False

    def params(self) -> list[MangledParam]:
        self.expect("_Z")
        is_template = self.function_name()
        if not self.peek():
            raise _Undecodable("no parameter list (not a function)")
        if is_template:
            self.type()  # the return type
            if not self.peek():
                raise _Undecodable("no parameter list after the return type")
        params = []
        while self.peek():
            start = self.pos
            found = self.type()
            params.append(MangledParam(self.text[start:self.pos], found.spelling, found.allowed))
        if len(params) == 1 and params[0].mangled == "v":
            return []  # f(void)
        if any(p.mangled in ("v", "z") for p in params):
            raise _Undecodable("void or ... in a parameter list")
        return params


def decode_params(symbol: str) -> list[MangledParam] | None:
    """The parameters a mangled function symbol carries, or None when it carries none that this
    decoder can read (an ``extern "C"`` name, a construct outside its subset, a malformed name)."""
    if not isinstance(symbol, str) or not symbol.startswith("_Z") or len(symbol) > MAX_SYMBOL_CHARS:
        return None
    if not symbol.isascii() or "." in symbol:  # a clone suffix (`.constprop.0`) or worse
        return None
    try:
        return _Decoder(symbol).params()
    except (_Undecodable, RecursionError):
        return None


def type_problem(declared: Sequence[str], params: Sequence[MangledParam]) -> tuple[int, str] | None:
    """The first declared type that its mangled parameter contradicts, as (index, why), or None.

    A parameter whose mangled type maps to no cubinstore type is not checked; a count that
    differs is the layout check's to report."""
    if len(declared) != len(params):
        return None
    for index, (name, param) in enumerate(zip(declared, params)):
        if param.allowed and name not in param.allowed:
            want = " or ".join(f"'{t}'" for t in sorted(param.allowed))
            return index, (f"is declared '{name}', but the kernel's mangled name gives '{param.mangled}' "
                           f"({param.spelling}): declare {want}")
    return None
