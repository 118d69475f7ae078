"""The ABI contract between the build and the runtime, defined once.

Both sides import this module: the runtime (``manifest``, ``_args``, ``launch``) and the
build's manifest tool (``//tools:manifest_tool``, run by the ``CubinManifest`` action), so
what the build checks is what the runtime relies on. It defines:

- parameter types: size and alignment, and ``struct:<size>:<align>`` for structs by value;
- the compiler's parameter-layout rule (offsets from the parameter bank, per arch);
- ``Arch``: the one arch grammar and what runs where;
- kernel-id rendering, canonical JSON, size limits;
- the CUBIN ELF reader (kernel symbols, parameter layouts, target SM);
- nvcc's default flags and the module anchor that makes CUBIN bytes reproducible.

Starlark cannot import Python: ``tools/private/types.bzl`` mirrors the type table, the arch
grammar, the default flags and the anchor; ``tests/test_abi.py`` checks the mirror.
Standard library only.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cubinstore.errors import BadArgumentError, CubinFormatError

__all__ = [
    "Arch",
    "CubinImage",
    "DEFAULT_NVCC_FLAGS",
    "MAX_BLOB_SIZE",
    "MAX_MANIFEST_BYTES",
    "ParamType",
    "dumps_canonical",
    "kernel_id",
    "loads_strict",
    "merge_flags",
    "module_anchor",
    "param_layout",
    "param_type",
    "render_param",
]

# -- size limits ------------------------------------------------------------------------------
# Bounds so a hostile manifest or blob cannot make either side allocate without limit.
MAX_MANIFEST_BYTES: Final = 64 * 1024 * 1024
MAX_BLOB_SIZE: Final = 1024 * 1024 * 1024
# 32 KiB of parameter space (sm_70+) holds at most this many 1-byte parameters.
MAX_PARAMS: Final = 32764

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


# -- the CUBIN ELF reader ---------------------------------------------------------------------
_ELF_MAGIC: Final = b"\x7fELF"
_ELFCLASS64: Final = 2
_ELFDATA2LSB: Final = 1
_EM_CUDA: Final = 190
_CUDA_ELF_ABI_V8: Final = 8
_SHT_SYMTAB: Final = 2
_STT_FUNC: Final = 2
_STB_LOCAL: Final = 0
_STO_CUDA_ENTRY: Final = 0x10  # st_other bit nvcc sets on __global__ functions
_EIFMT_SVAL: Final = 4  # a record with a 2-byte size and that many bytes
_EIATTR_PARAM_CBANK: Final = 0x0A
_EIATTR_KPARAM_INFO: Final = 0x17


@dataclass(frozen=True)
class KernelSymbol:
    """A ``__global__`` function of a CUBIN."""

    name: str  # the (mangled) symbol
    local: bool  # STB_LOCAL (e.g. `__global__ static`, CUTLASS_GLOBAL) rather than STB_GLOBAL


class CubinImage:
    """The facts of a CUBIN that cubinstore checks, read from untrusted bytes.

    Every offset is bounds-checked: a malformed file raises ``CubinFormatError`` naming
    ``what`` (a kernel id or path), never IndexError or struct.error.
    """

    def __init__(self, data: bytes, what: str) -> None:
        self._data = bytes(data) if not isinstance(data, bytes) else data
        self._what = what
        if len(data) < 64 or data[:4] != _ELF_MAGIC:
            raise CubinFormatError(f"{what}: not an ELF file (bad magic), so not a CUBIN")
        if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
            raise CubinFormatError(f"{what}: expected a 64-bit little-endian ELF, got class {data[4]}, data {data[5]}")
        (machine,) = struct.unpack_from("<H", data, 0x12)
        if machine != _EM_CUDA:
            raise CubinFormatError(f"{what}: expected ELF machine {_EM_CUDA} (CUDA), got {machine}")
        self._sections: list[tuple[int, ...]] | None = None
        self._by_name: dict[str, tuple[int, ...]] = {}

    @property
    def sm(self) -> int | None:
        """The SM number from the ELF header flags; None for an unknown ELF ABI version."""
        if self._data[8] != _CUDA_ELF_ABI_V8:
            return None
        (flags,) = struct.unpack_from("<I", self._data, 0x30)
        return (flags >> 8) & 0xFF

    def _fail(self, why: str) -> CubinFormatError:
        return CubinFormatError(f"{self._what}: malformed CUBIN: {why}")

    def _unpack(self, fmt: str, offset: int) -> tuple[Any, ...]:
        if offset < 0 or offset + struct.calcsize(fmt) > len(self._data):
            raise self._fail(f"read of {struct.calcsize(fmt)} bytes at offset {offset} is past the end")
        return struct.unpack_from(fmt, self._data, offset)

    def _load_sections(self) -> list[tuple[int, ...]]:
        if self._sections is None:
            shoff, = self._unpack("<Q", 0x28)
            shentsize, shnum, shstrndx = self._unpack("<HHH", 0x3A)
            if shentsize != 64 or shnum > 65535 or shstrndx >= max(shnum, 1):
                raise self._fail(f"section table: entry size {shentsize}, {shnum} sections, names in {shstrndx}")
            sections = [self._unpack("<IIQQQQIIQQ", shoff + i * 64) for i in range(shnum)]
            for sec in sections:
                if sec[1] != 8 and sec[4] + sec[5] > len(self._data):  # SHT_NOBITS has no bytes
                    raise self._fail(f"a section of {sec[5]} bytes at {sec[4]} is past the end")
            self._sections = sections
            names = sections[shstrndx] if sections else None
            if names is not None:
                self._by_name = {self._str(names, s[0]): s for s in sections}
        return self._sections

    def _str(self, table: tuple[int, ...], offset: int) -> str:
        start = table[4] + offset
        end = self._data.find(b"\0", start, table[4] + table[5])
        if offset >= table[5] or end < 0:
            raise self._fail(f"string at {offset} is outside its table")
        return self._data[start:end].decode("utf-8", "replace")

    def _body(self, section: tuple[int, ...]) -> bytes:
        return self._data[section[4] : section[4] + section[5]]

    @functools.cached_property
    def kernels(self) -> Mapping[str, KernelSymbol]:
        """Every ``__global__`` function, by symbol: CUDA's entry mark, not its binding, decides."""
        found: dict[str, KernelSymbol] = {}
        sections = self._load_sections()
        for sec in sections:
            if sec[1] != _SHT_SYMTAB:
                continue
            if sec[6] >= len(sections):
                raise self._fail(f"symbol table links to section {sec[6]}")
            strtab = sections[sec[6]]
            body = self._body(sec)
            for off in range(0, len(body) - len(body) % 24, 24):
                st_name, st_info, st_other = struct.unpack_from("<IBB", body, off)
                if st_info & 0xF == _STT_FUNC and st_other & _STO_CUDA_ENTRY:
                    name = self._str(strtab, st_name)
                    found[name] = KernelSymbol(name, st_info >> 4 == _STB_LOCAL)
        return found

    def _attributes(self, symbol: str) -> list[tuple[int, bytes]]:
        """The (attribute, value) records of ``.nv.info.<symbol>``."""
        self._load_sections()
        sec = self._by_name.get(".nv.info." + symbol)
        if sec is None:
            return []
        body, pos, out = self._body(sec), 0, []
        while pos + 2 <= len(body):
            fmt, attr = body[pos], body[pos + 1]
            pos += 2
            if fmt == _EIFMT_SVAL:
                if pos + 2 > len(body):
                    raise self._fail(f".nv.info.{symbol}: truncated attribute {attr:#x}")
                (size,) = struct.unpack_from("<H", body, pos)
                pos += 2
                if pos + size > len(body):
                    raise self._fail(f".nv.info.{symbol}: attribute {attr:#x} of {size} bytes is past the end")
                out.append((attr, body[pos : pos + size]))
                pos += size
            else:  # every other format is a 2-byte value (or padding) after the header
                out.append((attr, body[pos : pos + 2]))
                pos += 2
        return out

    def param_layout(self, symbol: str) -> tuple[tuple[int, int], ...]:
        """(offset, size) of each parameter of kernel ``symbol``, in order."""
        params: dict[int, tuple[int, int]] = {}
        for attr, value in self._attributes(symbol):
            if attr == _EIATTR_KPARAM_INFO and len(value) >= 12:
                _, ordinal, offset, bits = struct.unpack_from("<IHHI", value, 0)
                params[ordinal] = (offset, (bits >> 18) & 0x3FFF)
        if sorted(params) != list(range(len(params))):
            raise self._fail(f"kernel {symbol!r}: parameter ordinals {sorted(params)} are not 0..{len(params) - 1}")
        return tuple(params[i] for i in range(len(params)))

    def param_bank(self, symbol: str) -> int | None:
        """The constant-bank offset where ``symbol``'s parameters start (EIATTR_PARAM_CBANK)."""
        for attr, value in self._attributes(symbol):
            if attr == _EIATTR_PARAM_CBANK and len(value) >= 8:
                return struct.unpack_from("<IHH", value, 0)[1]
        return None


# -- launch geometry --------------------------------------------------------------------------
# A family declares how its entries are launched; the manifest carries it per entry, with the
# grid point's values filled in. `block`, `shared_mem` and `cluster` are integers (the build
# evaluates integer arithmetic such as "({bm} + {bn}) * {bk} * 2"); `grid` items may stay
# rules evaluated at launch over the call's integer arguments `args[i]` and the device's
# `sm_count`, with + - * // % min max cdiv.
_RULE_FUNCS: Final[Mapping[str, Any]] = {"min": min, "max": max, "cdiv": lambda a, b: -(-a // b)}
# (fewest, most) arguments of each function: checked when a rule is compiled, so a manifest with
# `cdiv(x)` is refused when it is opened, not with a TypeError at launch.
_RULE_ARITY: Final[Mapping[str, tuple[int, int | None]]] = {"min": (2, None), "max": (2, None), "cdiv": (2, 2)}
MAX_RULE_CHARS: Final = 256
# Integers a rule reads (its constants, args[i], sm_count) fit in 64 bits: with at most
# MAX_RULE_CHARS characters of + - * // %, no value it computes exceeds a few thousand bits.
_RULE_INT_MIN: Final = -(2**63)
_RULE_INT_END: Final = 2**64


class _RuleError(Exception):
    pass


def _compile_rule(text: str) -> Any:
    import ast  # only the build and a manifest with rules need it

    if type(text) is not str:
        raise _RuleError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_RULE_CHARS:
        raise _RuleError(f"longer than {MAX_RULE_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _RuleError(f"not an expression ({exc.msg})") from None
    except (RecursionError, MemoryError):
        raise _RuleError("nested too deeply") from None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}

    def build(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
            if not _RULE_INT_MIN <= value < _RULE_INT_END:
                raise _RuleError(f"a constant of {value.bit_length()} bits does not fit in 64 bits")
            return lambda env: value
        if isinstance(node, ast.Name) and node.id == "sm_count":
            return lambda env: env["sm_count"]
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "args"
                and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int):
            index = node.slice.value
            return lambda env: env["arg"](index)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            op, left, right = ops[type(node.op)], build(node.left), build(node.right)
            return lambda env: op(left(env), right(env))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = build(node.operand)
            return lambda env: -inner(env)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _RULE_FUNCS
                and not node.keywords):
            name = node.func.id
            fewest, most = _RULE_ARITY[name]
            if len(node.args) < fewest or (most is not None and len(node.args) > most):
                takes = f"exactly {fewest}" if most == fewest else f"at least {fewest}"
                call = "" if node is tree.body else f" in {ast.unparse(node)!r}"
                raise _RuleError(f"{name} takes {takes} arguments, got {len(node.args)}{call}")
            func, items = _RULE_FUNCS[name], [build(a) for a in node.args]
            return lambda env: func(*(f(env) for f in items))
        raise _RuleError(
            f"{ast.unparse(node)!r} is not allowed; use integers, args[<i>], sm_count, + - * // %, "
            f"min, max, cdiv"
        )

    try:
        return build(tree.body)
    except RecursionError:
        raise _RuleError("nested too deeply") from None


def _short_int(value: int) -> str:
    """An int for a message: a huge one by its size (str() of one past 4300 digits raises)."""
    return str(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"


def _rule_int(value: object, what: str) -> int:
    if type(value) is not int:
        raise _RuleError(f"{what} is {type(value).__name__}, expected an int")
    if not _RULE_INT_MIN <= value < _RULE_INT_END:
        raise _RuleError(f"{what} is {_short_int(value)}, which does not fit in 64 bits")
    return value


@functools.lru_cache(maxsize=4096)
def _rule(text: str) -> Any:
    return _compile_rule(text)


def _no_args(index: int) -> int:
    raise _RuleError(f"uses args[{index}], which only a launch has")


def eval_rule(text: str, *, args: Sequence[Any] | None = None, sm_count: int | None = None) -> int:
    """Evaluate one geometry rule; raises ``BadArgumentError`` naming the rule."""
    def arg(index: int) -> int:
        if args is None:
            return _no_args(index)
        if not 0 <= index < len(args):
            raise _RuleError(f"args[{index}] does not exist: the launch has {len(args)} arguments")
        value = args[index]
        if isinstance(value, int) and not isinstance(value, bool) and type(value) is not int:
            value = int(value)  # an IntEnum, say: its value
        return _rule_int(value, f"args[{index}]")

    def count() -> int:
        if sm_count is None:
            raise _RuleError("uses sm_count, which only a launch has")
        return _rule_int(sm_count, "sm_count")

    class _Env(dict):  # sm_count is looked up lazily so a constant rule never needs a device
        def __missing__(self, key: str) -> int:
            return count()

    if type(text) is not str:
        raise BadArgumentError(f"launch rule: expected a string, got {type(text).__name__}")
    try:
        value = _rule(text)(_Env(arg=arg))
    except _RuleError as exc:
        raise BadArgumentError(f"launch rule {text!r}: {exc}") from None
    except ZeroDivisionError:
        raise BadArgumentError(f"launch rule {text!r}: division by zero") from None
    except (TypeError, OverflowError, RecursionError, MemoryError) as exc:  # a bound above missed: still typed
        raise BadArgumentError(f"launch rule {text!r}: cannot be evaluated ({type(exc).__name__})") from None
    return value


def check_rule(text: str) -> None:
    """Raise ``BadArgumentError`` unless ``text`` is a well-formed rule (its functions' arities included)."""
    if type(text) is not str:
        raise BadArgumentError(f"launch rule: expected a string, got {type(text).__name__}")
    try:
        _rule(text)
    except _RuleError as exc:
        raise BadArgumentError(f"launch rule {text!r}: {exc}") from None


def _dims3(value: Any, where: str, *, limit: int) -> tuple[int, int, int]:
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(items, (list, tuple)) or not 1 <= len(items) <= 3
            or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in items)):
        raise BadArgumentError(f"{where}: expected 1 to 3 integers in [1, {limit}], got {value!r}")
    padded = [*items, 1, 1][:3]
    return padded[0], padded[1], padded[2]


@dataclass(frozen=True)
class LaunchGeometry:
    """How an entry is launched when the caller gives no geometry (manifest v2 ``launch``)."""

    block: tuple[int, int, int]
    shared_mem: int = 0
    cluster: tuple[int, int, int] | None = None
    grid: tuple[int | str, ...] | None = None  # ints, or rules over args[i] and sm_count

    @classmethod
    def from_json(cls, obj: Any, where: str) -> LaunchGeometry:
        if not isinstance(obj, dict):
            raise BadArgumentError(f"{where}: expected an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"block", "shared_mem", "cluster", "grid"})
        if unknown:
            raise BadArgumentError(f"{where}: unknown key {unknown[0]!r}; allowed: block, cluster, grid, shared_mem")
        if "block" not in obj:
            raise BadArgumentError(f"{where}: missing key 'block'")
        block = _dims3(obj["block"], f"{where}.block", limit=1024)
        smem = obj.get("shared_mem", 0)
        if isinstance(smem, bool) or not isinstance(smem, int) or not 0 <= smem <= 1 << 20:
            raise BadArgumentError(f"{where}.shared_mem: expected an integer in [0, {1 << 20}], got {smem!r}")
        cluster = None if obj.get("cluster") is None else _dims3(obj["cluster"], f"{where}.cluster", limit=16)
        grid = obj.get("grid")
        if grid is not None:
            if not isinstance(grid, list) or not 1 <= len(grid) <= 3:
                raise BadArgumentError(f"{where}.grid: expected a list of 1 to 3 integers or rules, got {grid!r}")
            for i, item in enumerate(grid):
                if isinstance(item, str):
                    try:
                        check_rule(item)
                    except BadArgumentError as exc:
                        raise BadArgumentError(f"{where}.grid[{i}]: {exc}") from None
                elif isinstance(item, bool) or not isinstance(item, int) or not 1 <= item < 2**31:
                    raise BadArgumentError(f"{where}.grid[{i}]: expected a positive integer or a rule, got {item!r}")
            grid = tuple(grid)
        return cls(block, smem, cluster, grid)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block": list(self.block), "shared_mem": self.shared_mem}
        if self.cluster is not None:
            out["cluster"] = list(self.cluster)
        if self.grid is not None:
            out["grid"] = list(self.grid)
        return out

    def grid_for(self, args: Sequence[Any], sm_count: int | None) -> tuple[int, int, int] | None:
        """The grid for one launch, or None when the family declares no grid rule."""
        if self.grid is None:
            return None
        dims = [item if isinstance(item, int) else eval_rule(item, args=args, sm_count=sm_count) for item in self.grid]
        for d, item in zip(dims, self.grid):
            if not 1 <= d < 2**31:
                raise BadArgumentError(f"launch rule {item!r} gave grid dimension {d}, expected 1 .. 2**31-1")
        padded = [*dims, 1, 1][:3]
        return padded[0], padded[1], padded[2]
