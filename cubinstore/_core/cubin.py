"""The CUBIN ELF reader: the facts of a CUBIN that cubinstore checks, read from untrusted bytes.

A CUBIN is a CUDA ELF file. ``CubinImage`` reads its target SM (header flags), its
``__global__`` functions (``KernelSymbol``: CUDA's entry mark on a function symbol) and each
kernel's parameter layout (``.nv.info.<kernel>``), bounds-checking every offset. The build's
manifest tool, the loader and the JIT read CUBINs only through it. Standard library only.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from cubinstore.errors import CubinFormatError

__all__ = ["CubinImage", "KernelSymbol", "header_is", "header_problem", "header_sm"]

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


def header_problem(data: bytes) -> str | None:
    """What makes ``data``'s ELF header not a CUDA ELF's (the start of a ``CubinFormatError``), or None.

    The loader's check of every first load: three compares and one unpack, no object."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        return "not an ELF file (bad magic), so not a CUBIN"
    if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
        return f"expected a 64-bit little-endian ELF, got class {data[4]}, data {data[5]}"
    (machine,) = struct.unpack_from("<H", data, 0x12)
    if machine != _EM_CUDA:
        return f"expected ELF machine {_EM_CUDA} (CUDA), got {machine}"
    return None


def header_sm(data: bytes) -> int | None:
    """The SM number in the flags of a CUDA ELF header (``header_problem`` passed); None for an
    unknown ELF ABI version."""
    if data[8] != _CUDA_ELF_ABI_V8:
        return None
    (flags,) = struct.unpack_from("<I", data, 0x30)
    return (flags >> 8) & 0xFF


_START: Final = _ELF_MAGIC + bytes((_ELFCLASS64, _ELFDATA2LSB))


def header_is(data: bytes, sm: int) -> bool:
    """Whether ``header_problem(data)`` is None and ``header_sm(data) == sm``, in one expression: the
    loader's accepting case on every first load (anything else takes those two, which word why)."""
    return (len(data) >= 64 and data.startswith(_START) and data[8] == _CUDA_ELF_ABI_V8
            and data[0x12] == _EM_CUDA & 0xFF and data[0x13] == _EM_CUDA >> 8 and data[0x31] == sm)


class CubinImage:
    """The facts of a CUBIN that cubinstore checks, read from untrusted bytes.

    Every offset is bounds-checked: a malformed file raises ``CubinFormatError`` naming
    ``what`` (a kernel id or path), never IndexError or struct.error.
    """

    def __init__(self, data: bytes, what: str) -> None:
        self._data = bytes(data) if not isinstance(data, bytes) else data
        self._what = what
        problem = header_problem(self._data)
        if problem is not None:
            raise CubinFormatError(f"{what}: {problem}")
        self._sections: list[tuple[int, ...]] | None = None
        self._by_name: dict[str, tuple[int, ...]] = {}

    @property
    def sm(self) -> int | None:
        """The SM number from the ELF header flags; None for an unknown ELF ABI version."""
        return header_sm(self._data)

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

    def section(self, name: str) -> bytes | None:
        """The bytes of section ``name`` (bounds-checked), or None when the CUBIN has none."""
        self._load_sections()
        sec = self._by_name.get(name)
        return None if sec is None or sec[1] == 8 else self._body(sec)  # 8: SHT_NOBITS holds no bytes

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
