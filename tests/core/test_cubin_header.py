"""The loader's one-expression header check (``header_is``) accepts exactly what ``header_problem``
and ``header_sm`` accept: every byte of a real header changed, one at a time, and short files."""

from __future__ import annotations

import struct

import pytest

from cubinstore.internals import header_is, header_problem, header_sm


def _header(sm: int = 90) -> bytes:
    head = bytearray(64)
    head[:9] = b"\x7fELF\x02\x01\x01\x00\x08"  # 64-bit, little-endian, CUDA ELF ABI v8
    struct.pack_into("<H", head, 0x12, 190)  # EM_CUDA
    struct.pack_into("<I", head, 0x30, sm << 8 | 0x02)
    return bytes(head) + b"\x00" * 64


def _full(data: bytes, sm: int) -> bool:
    return header_problem(data) is None and header_sm(data) == sm


@pytest.mark.parametrize("sm", [80, 90, 100])
def test_agrees_with_the_full_check_on_every_one_byte_change(sm: int) -> None:
    base = _header(90)
    assert header_is(base, 90) and _full(base, 90)
    for i in range(64):
        for value in (0, 1, 2, 8, 90, 100, 190, 255):
            data = base[:i] + bytes((value,)) + base[i + 1:]
            assert header_is(data, sm) == _full(data, sm), (i, value, sm)


def test_short_and_empty_files_are_refused() -> None:
    for n in (0, 4, 63):
        assert not header_is(_header()[:n], 90)
