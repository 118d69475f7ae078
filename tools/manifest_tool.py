#!/usr/bin/env python3
"""Writes manifest.json (schema cubinstore/manifest/v1) from the CUBINs a build produced.

Run by the CubinManifest action. Digests and sizes come from the produced bytes. Each
declared entry must be a global function in its CUBIN whose parameter layout (from the
CUBIN's .nv.info section) matches the declared parameter types; otherwise the build fails
naming the kernel, entry and parameter.

Usage: manifest_tool.py SPEC.json OUT.json
SPEC.json: {"kernels": [{"id", "family", "params", "arch", "entries", "target", "cubin"}]}
"""

import hashlib
import json
import struct
import sys

SCHEMA = "cubinstore/manifest/v1"
PARAM_TYPES = {  # type -> (size, alignment) in bytes
    "i32": (4, 4), "u32": (4, 4), "i64": (8, 8), "u64": (8, 8),
    "f32": (4, 4), "f64": (8, 8), "ptr": (8, 8), "tensormap": (128, 64),
}
_SHT_SYMTAB = 2
_STT_FUNC = 2
_STB_GLOBAL = 1
_EIFMT_SVAL = 4
_EIATTR_KPARAM_INFO = 0x17


class BuildError(Exception):
    pass


class Cubin:
    """The few ELF facts the checks need: global functions and kernel parameter layouts."""

    def __init__(self, data: bytes, name: str):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise BuildError(f"{name}: not a 64-bit little-endian ELF file, so not a CUBIN")
        self._data = data
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        self._sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = self._sections[shstrndx]
        self._by_name = {self._str(names, s[0]): s for s in self._sections}

    def _str(self, table, offset: int) -> str:
        start = table[4] + offset
        return self._data[start:self._data.index(b"\0", start)].decode()

    def _bytes(self, section) -> bytes:
        return self._data[section[4]:section[4] + section[5]]

    def global_functions(self) -> set[str]:
        names = set()
        for sec in self._sections:
            if sec[1] != _SHT_SYMTAB:
                continue
            strtab = self._sections[sec[6]]
            body = self._bytes(sec)
            for off in range(0, len(body), 24):
                st_name, st_info = struct.unpack_from("<IB", body, off)
                if st_info & 0xF == _STT_FUNC and st_info >> 4 == _STB_GLOBAL:
                    names.add(self._str(strtab, st_name))
        return names

    def param_layout(self, entry: str) -> list[tuple[int, int]]:
        """(offset, size) of each parameter, in ordinal order."""
        sec = self._by_name.get(".nv.info." + entry)
        if sec is None:
            return []
        body, pos, params = self._bytes(sec), 0, {}
        while pos + 4 <= len(body):
            fmt, attr, value = struct.unpack_from("<BBH", body, pos)
            pos += 4
            if fmt != _EIFMT_SVAL:
                continue
            if attr == _EIATTR_KPARAM_INFO:
                _, ordinal, offset, bits = struct.unpack_from("<IHHI", body, pos)
                params[ordinal] = (offset, (bits >> 18) & 0x3FFF)
            pos += value
        return [params[i] for i in sorted(params)]


def check_entries(kernel: dict, cubin: Cubin) -> None:
    functions = cubin.global_functions()
    for entry, types in kernel["entries"].items():
        if entry not in functions:
            raise BuildError(
                f"kernel '{kernel['id']}' ({kernel['target']}): entry '{entry}' is not a global function "
                f"of its CUBIN; found: {', '.join(sorted(functions)) or 'none'}")
        # Offsets are not compared: the compiler pads the parameter block so that 64-byte
        # aligned parameters (tensor maps) are aligned in the constant bank, not in the block.
        actual = cubin.param_layout(entry)
        if len(actual) != len(types):
            raise BuildError(
                f"kernel '{kernel['id']}' ({kernel['target']}): entry '{entry}' takes {len(actual)} "
                f"parameters, declared {len(types)}: {types}")
        for i, ((offset, size), declared) in enumerate(zip(actual, types)):
            if size != PARAM_TYPES[declared][0]:
                raise BuildError(
                    f"kernel '{kernel['id']}' ({kernel['target']}): entry '{entry}' parameter {i} is "
                    f"{size} bytes (at offset {offset}), but declared '{declared}' is "
                    f"{PARAM_TYPES[declared][0]} bytes")


def manifest_entry(kernel: dict) -> dict:
    with open(kernel["cubin"], "rb") as f:
        data = f.read()
    check_entries(kernel, Cubin(data, kernel["id"]))
    return {
        "id": kernel["id"],
        "family": kernel["family"],
        "params": kernel["params"],
        "arch": kernel["arch"],
        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "entries": kernel["entries"],
        "target": kernel["target"],
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    kernels = [manifest_entry(k) for k in spec["kernels"]]
    ids = [k["id"] for k in kernels]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise BuildError(f"duplicate kernel ids in the manifest: {', '.join(duplicates)}")
    manifest = {"schema": SCHEMA, "kernels": sorted(kernels, key=lambda k: k["id"])}
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
    with open(argv[2], "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BuildError as exc:
        print(f"cubin_manifest: {exc}", file=sys.stderr)
        sys.exit(1)
