"""The ABI contract between the build and the runtime, defined once.

Both sides import this module: the runtime (``manifest``, ``_args``, ``launch``) and the
build's manifest tool (``//tools:manifest_tool``, run by the ``CubinManifest`` action), so
what the build checks is what the runtime relies on. It defines:

- size limits, and the names that become ids, keys and paths;
- parameter types: size and alignment, and ``struct:<size>:<align>`` for structs by value;
- the compiler's parameter-layout rule (offsets from the parameter bank, per arch), and the
  one comparison of a declared layout with a CUBIN's (``layout_mismatch``);
- ``Arch``: the one arch grammar and what runs where;
- kernel ids (``kernel_id`` renders, ``parse_kernel_id`` reads), canonical and strict JSON;
- nvcc's default flags and the module anchor that makes CUBIN bytes reproducible.

The CUBIN ELF reader is ``cubinstore._core.cubin``; launch geometry ``cubinstore._core.geometry``.
Starlark cannot import Python: ``tools/private/types.bzl`` mirrors the type table, the arch
grammar, the default flags and the anchor; ``tests/core/test_abi.py`` checks the mirror.
Standard library only.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cubinstore._core.grammar import IDENT_RE, REL_PATH_RE, WORD_RE
from cubinstore.errors import BadArgumentError

__all__ = [
    "Arch",
    "DEFAULT_NVCC_FLAGS",
    "IDENT_RE",
    "LayoutMismatch",
    "MAX_BLOB_SIZE",
    "MAX_MANIFEST_BYTES",
    "MAX_PARAMS",
    "MAX_POINT_PARAMS",
    "MAX_STRUCT_BYTES",
    "ParamType",
    "REL_PATH_RE",
    "WORD_RE",
    "dumps_canonical",
    "kernel_id",
    "layout_mismatch",
    "loads_strict",
    "merge_flags",
    "module_anchor",
    "param_layout",
    "param_type",
    "parse_kernel_id",
    "render_param",
]

# -- size limits ------------------------------------------------------------------------------
# Bounds so a hostile manifest or blob cannot make either side allocate without limit.
MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
MAX_BLOB_SIZE: Final = 1024 * 1024 * 1024
# 32 KiB of parameter space (sm_70+) holds at most this many 1-byte parameters.
MAX_PARAMS: Final = 32764
# Parameters of one grid point (a key of its family's grid each): bounds the id-order check's work.
MAX_POINT_PARAMS: Final = 64

# -- names: the grammar (``grammar``), re-exported -----------------------------------------------

# -- parameter types --------------------------------------------------------------------------
# (size, alignment) in the kernel's parameter space; the same rules a C++ compiler applies.
SCALAR_TYPES: Final[Mapping[str, tuple[int, int]]] = {
    "i8": (1, 1),
    "u8": (1, 1),
    "i16": (2, 2),
    "u16": (2, 2),
    "i32": (4, 4),
    "u32": (4, 4),
    "i64": (8, 8),
    "u64": (8, 8),
    "f16": (2, 2),
    "bf16": (2, 2),
    "f32": (4, 4),
    "f64": (8, 8),
    "ptr": (8, 8),
    # CUtensorMap: 128 opaque bytes, alignas(128) in CUDA 13's cuda.h (64 before).
    "tensormap": (128, 128),
}
_STRUCT_RE: Final = re.compile(r"struct:([1-9][0-9]{0,4}):(1|2|4|8|16|32|64|128|256)", re.ASCII)
MAX_STRUCT_BYTES: Final = 4096


@dataclass(frozen=True)
class ParamType:
    """One declared parameter type: ``i32`` ... ``tensormap``, or ``struct:<size>:<align>``."""

    name: str
    size: int
    align: int

    @property
    def is_struct(self) -> bool:
        return self.name.startswith("struct:")

    def __str__(self) -> str:
        return self.name


def type_grammar() -> str:
    """The allowed spellings, for error messages."""
    return " ".join(SCALAR_TYPES) + " struct:<size>:<align>"


@functools.lru_cache(maxsize=1024)
def param_type(name: object) -> ParamType:
    """Parse a declared parameter type; raises ``BadArgumentError`` naming the bad spelling."""
    if isinstance(name, str):
        if name in SCALAR_TYPES:
            size, align = SCALAR_TYPES[name]
            return ParamType(name, size, align)
        match = _STRUCT_RE.fullmatch(name)
        if match:
            size, align = int(match.group(1)), int(match.group(2))
            if size > MAX_STRUCT_BYTES or size % align:
                raise BadArgumentError(
                    f"invalid parameter type {name!r}: a struct's size must be a multiple of its "
                    f"alignment and at most {MAX_STRUCT_BYTES} bytes"
                )
            return ParamType(name, size, align)
    shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
    raise BadArgumentError(f"invalid parameter type {shown}: expected one of {type_grammar()}")


# -- the layout rule --------------------------------------------------------------------------
# Kernel parameters live in constant bank 0 from a fixed offset, and the compiler aligns each
# parameter in the bank, not in the parameter block: offsets in .nv.info (and from
# cuFuncGetParamInfo) are `align_up(bank + cursor, align) - bank`. With a 128-byte aligned
# CUtensorMap that is why `k(int, CUtensorMap)` has its map at 112 on sm_90 (bank 0x210) and
# at 32 on sm_80 (bank 0x160). Measured on nvcc 13.0 CUBINs (EIATTR_PARAM_CBANK); tests
# compile a table of parameter lists for every major here and compare.
PARAM_BANK_OFFSET: Final[Mapping[int, int]] = {7: 0x160, 8: 0x160, 9: 0x210, 10: 0x380, 11: 0x380, 12: 0x380}


def param_bank_offset(arch: Arch) -> int:
    try:
        return PARAM_BANK_OFFSET[arch.major]
    except KeyError:
        raise BadArgumentError(
            f"no parameter-layout rule for {arch}: known majors {sorted(PARAM_BANK_OFFSET)}"
        ) from None


def param_layout(types: Sequence[ParamType], arch: Arch) -> tuple[int, ...]:
    """The offset of each parameter, as the compiler lays them out for ``arch``."""
    bank = param_bank_offset(arch)
    offsets = []
    cursor = bank
    for t in types:
        cursor += -cursor % t.align
        offsets.append(cursor - bank)
        cursor += t.size
    return tuple(offsets)


@dataclass(frozen=True)
class LayoutMismatch:
    """How a declared parameter list differs from a CUBIN's: the (offset, size) lists and the first difference."""

    expected: tuple[tuple[int, int], ...]  # what the declared types get
    actual: tuple[tuple[int, int], ...]  # what the CUBIN has
    index: int | None  # the first parameter that differs; None when the counts differ

    def __str__(self) -> str:
        if self.index is None:
            return f"declares {len(self.expected)} parameters, the CUBIN's function takes {len(self.actual)}"
        (want, size), (offset, got) = self.expected[self.index], self.actual[self.index]
        return (f"parameter {self.index} is declared {size} bytes at offset {want}, "
                f"the CUBIN's function has {got} bytes at offset {offset}")


def layout_mismatch(
    types: Sequence[ParamType],
    arch: Arch | None,
    actual: Sequence[tuple[int, int]],
    *,
    offsets: Sequence[int] | None = None,
) -> LayoutMismatch | None:
    """THE comparison of a declared layout with a CUBIN's: None when they agree.

    ``actual`` is the CUBIN's (offset, size) per parameter (``.nv.info``, or the driver's
    ``cuFuncGetParamInfo``, which reads it); ``offsets`` are the declared offsets (a manifest's,
    which its build checked), else the layout rule's for ``arch``. Layout cannot tell i32 from
    f32 or ptr from i64 (same size and alignment); it does catch a wrong count, a wrong size,
    and a parameter the compiler placed elsewhere.
    """
    if offsets is None:
        if arch is None:
            raise BadArgumentError("layout_mismatch: expected an arch or the declared offsets")
        offsets = param_layout(types, arch)
    expected = tuple((o, t.size) for o, t in zip(offsets, types))
    actual = tuple((int(o), int(s)) for o, s in actual)
    if len(actual) != len(expected):
        return LayoutMismatch(expected, actual, None)
    for index, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            return LayoutMismatch(expected, actual, index)
    return None


# -- archs ------------------------------------------------------------------------------------
# sm_<major><minor><suffix>: major 1..99 (no leading zero), minor one digit; `a` is
# arch-specific (runs on exactly that compute capability), `f` family-specific (that major,
# minor at least the given one), none is portable within the major.
_ARCH_RE: Final = re.compile(r"sm_([1-9][0-9]?)([0-9])([af]?)", re.ASCII)


@dataclass(frozen=True, order=True)
class Arch:
    """A CUBIN target, ``sm_90a``: parse once with ``Arch.parse``."""

    major: int
    minor: int
    suffix: str  # "", "a" or "f"

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(text: object) -> Arch:
        match = _ARCH_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:37] + "..."
            raise BadArgumentError(
                f"invalid arch {shown}: expected 'sm_<major><minor>' with optional 'a' or 'f', e.g. 'sm_90a'"
            )
        return Arch(int(match.group(1)), int(match.group(2)), match.group(3))

    def __str__(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"

    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.major, self.minor

    @property
    def sm(self) -> int:
        """The SM number a CUBIN of this arch names in its ELF header (``sm_90a``: 90)."""
        return self.major * 10 + self.minor

    def runs_on(self, cc: tuple[int, int]) -> bool:
        """Whether a CUBIN for this arch loads on a GPU of compute capability ``cc``."""
        if self.suffix == "a":
            return (self.major, self.minor) == cc
        return self.major == cc[0] and cc[1] >= self.minor

    @property
    def preference(self) -> tuple[int, int]:
        """Sort key among archs that run on one GPU: the most specific, then the newest minor."""
        return {"a": 2, "f": 1, "": 0}[self.suffix], self.minor


# -- ids and canonical JSON -------------------------------------------------------------------
def render_param(key: str, value: str | int) -> str:
    """A parameter value as an id segment: a string as itself, an int as ``<key><value>``."""
    return value if isinstance(value, str) else f"{key}{value}"


def kernel_id(family: str, params: Mapping[str, str | int], arch: str | Arch) -> str:
    """``<family>/<values in the grid's order>/<arch>``, e.g. ``axpy/f32/vec4/sm_90a``."""
    return "/".join([family, *(render_param(k, v) for k, v in params.items()), str(arch)])


# An int as ``render_param`` writes it after its key: canonical decimal, so parse and render agree.
_INT_RE: Final = re.compile(r"-?(?:0|[1-9][0-9]*)", re.ASCII)


def parse_kernel_id(text: object, family: str, keys: Sequence[str]) -> tuple[dict[str, str | int], Arch]:
    """The params (in the grid's order ``keys``) and arch that an id of ``family`` renders.

    The inverse of ``kernel_id``: a segment ``<key><int>`` reads as that int, any other as a
    string value (a string spelled like ``<key><int>`` reads as the int: the rendering cannot
    tell them apart). Raises ``BadArgumentError`` unless ``kernel_id(family, params, arch)``
    gives ``text`` back.
    """
    parts = text.split("/") if isinstance(text, str) else []
    if len(parts) != len(keys) + 2 or parts[0] != family:
        shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:77] + "..."
        raise BadArgumentError(
            f"invalid {family} kernel id {shown}: expected '{family}/{'/'.join(f'<{k}>' for k in keys)}/<arch>'"
        )
    params: dict[str, str | int] = {}
    for key, segment in zip(keys, parts[1:-1]):
        rest = segment[len(key):] if segment.startswith(key) else None
        if rest is not None and _INT_RE.fullmatch(rest):
            params[key] = int(rest)
        elif WORD_RE.fullmatch(segment):
            params[key] = segment
        else:
            raise BadArgumentError(f"invalid {family} kernel id {text!r}: segment {segment!r} of {key!r} is no value")
    return params, Arch.parse(parts[-1])


def dumps_canonical(doc: Mapping[str, Any]) -> bytes:
    """Canonical manifest JSON: kernels sorted by id, sorted keys, compact, UTF-8, one newline."""
    doc = dict(doc)
    if isinstance(doc.get("kernels"), list):
        doc["kernels"] = sorted(doc["kernels"], key=lambda k: str(k.get("id", "")) if isinstance(k, Mapping) else "")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8") + b"\n"


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (``json.loads`` would keep the last silently)."""


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for every parser of untrusted JSON: a repeated key is an error."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def loads_strict(raw: bytes | str, where: str, error: type[Exception]) -> Any:
    """Parse untrusted JSON the one way: no duplicate keys, no NaN/Infinity, no deep nesting.

    Raises ``error`` (a ``CubinstoreError`` subclass) as ``<where>: <why>``."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=reject_constant)
    except DuplicateKeyError as exc:
        raise error(f"{where}: duplicate key {exc.args[0]!r}") from None
    except UnicodeDecodeError:
        raise error(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # NaN/Infinity, integers too long to convert
        raise error(f"{where}: not valid JSON: {exc}") from None


# -- nvcc defaults ----------------------------------------------------------------------------
# Every instantiation gets these unless its copts set the same option (`-std=c++20` replaces
# `-std=c++17`, `-O2` replaces `-O3`), so a family never passes an option twice.
DEFAULT_NVCC_FLAGS: Final[tuple[str, ...]] = ("-std=c++17", "-O3", "--expt-relaxed-constexpr")


def flag_option(flag: str) -> str:
    """The option a flag sets: ``-std=c++20`` -> ``std``, ``-O2`` -> ``O``."""
    name = flag.lstrip("-")
    if name.startswith("O"):
        return "O"
    return name.split("=", 1)[0]


def merge_flags(copts: Sequence[str]) -> list[str]:
    """The defaults a family's ``copts`` do not override, then the copts."""
    overridden = {flag_option(f) for f in copts}
    return [f for f in DEFAULT_NVCC_FLAGS if flag_option(f) not in overridden] + list(copts)


def module_anchor(source_path: str) -> str:
    """Text of the header force-included before a TU, so its CUBIN's bytes are reproducible.

    A TU with no definition of external linkage (one that only instantiates `static`
    kernels from a `static` function, as JIT libraries generate) gets a front-end module id
    that includes nvcc's process id, and that id prefixes the names of its internal
    symbols. With one external host function defined the id is derived from its name
    instead. The function is host code, so it never reaches the CUBIN.
    """
    name = "".join(c if c.isascii() and c.isalnum() else "_" for c in source_path)
    return f"// cubinstore: pins the module id of {source_path}\nvoid __cubinstore_module_anchor_{name}(void) {{}}\n"
