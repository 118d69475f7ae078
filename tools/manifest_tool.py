#!/usr/bin/env python3
"""Writes a manifest (schema cubinstore/manifest/v2) from the CUBINs a build produced.

Run by the CubinManifest action (`//tools:manifest_tool`). Everything in the manifest comes
from the produced bytes and the ABI contract in `cubinstore._core` (abi, cubin, geometry), which
the runtime imports too:
- digests and sizes are computed here;
- each declared entry is resolved to a kernel of its CUBIN: by symbol (an extern "C" name or
  a mangled name) or by its C++ name (`ns::gemm<128, 256>`), demangling the CUBIN's kernels;
  a kernel is what carries CUDA's entry mark, local (`__global__ static`) or global. The rule is
  `cubinstore._core.cxxnames` and the demangler runs through `cubinstore._jit.demangle`: the
  JIT's `entries=` resolves names the same way;
- each entry's parameters must have the sizes and offsets the ABI's layout rule gives the
  declared types (checked against the CUBIN's .nv.info), or the build fails naming the
  kernel, entry and parameter: a layout the runtime would refuse never ships;
- where the entry's symbol is a mangled name, its parameter types must be the declared ones
  (``cubinstore._core.mangled``): layout cannot tell `f32` from `i32` or `ptr` from `u64`, the
  mangled name can; an extern "C" symbol carries no types;
- launch geometry is evaluated (integer arithmetic) and its grid rules checked, each `args[i]`
  against the entry's parameters (it must exist and be declared an integer type);
- each kernel records the toolkit that built it, read from its bytes (a CUBIN's tool note, a PTX
  file's header), and the oldest driver that loads it (``cubinstore.manifest.toolkit``'s rule);
- a kernel whose arch is ``compute_<XY>`` is PTX text (``cubinstore.manifest.ptx``): checked as PTX
  for that target, its entries resolved among its ``.entry`` kernels and each parameter's size
  checked against the declared type's (the driver lays PTX out at load, where the runtime checks
  the offsets against the device's rule).

Usage: manifest_tool.py SPEC.json OUT.json
SPEC.json: {"demangler": CMD, "demangle_timeout": SECONDS (optional, default 120),
            "jit_templates": [PATH], "kernels": [{"id", "family", "params", "arch", "entries",
            "launch", "target", "cubin"}]}
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Collection
from typing import Any

# Under Bazel the package's sources are inputs at their workspace paths below the working
# directory (the execution root); run by hand, they are beside this script's directory.
for _root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.realpath(__file__)))):
    if os.path.isfile(os.path.join(_root, "cubinstore", "_core", "abi.py")):
        sys.path.insert(0, _root)
        break

# The private modules below directly, not through cubinstore.internals (the tests' and benchmarks'
# door): this action runs under the host's python3, without the xxhash that internals imports
# with the JIT and cubinstore-nvcc, and loads only what it checks with (tests/project/test_internals.py
# lists these imports).
from cubinstore._core import abi  # noqa: E402
from cubinstore._core.cubin import CubinImage  # noqa: E402
from cubinstore._core.cxxnames import resolve_entries  # noqa: E402
from cubinstore._core.geometry import LaunchGeometry, eval_rule, rule_arg_indices  # noqa: E402
from cubinstore._core.mangled import decode_params, type_problem  # noqa: E402
from cubinstore._jit.demangle import DEMANGLE_TIMEOUT, demangle  # noqa: E402
from cubinstore.errors import CubinstoreError  # noqa: E402
from cubinstore.manifest import Manifest  # noqa: E402
from cubinstore.manifest import ptx as _ptx  # noqa: E402
from cubinstore.manifest.toolkit import min_driver, toolkit_of  # noqa: E402

# The demangler runs DEMANGLE_TIMEOUT seconds at most (cubinstore/_jit/demangle.py), unless the
# spec says "demangle_timeout".
MAX_DEMANGLE_TIMEOUT = 3600.0


class BuildError(Exception):
    pass


def _where(kernel: dict[str, Any]) -> str:
    return f"kernel '{kernel['id']}' ({kernel['target']})"


def demangle_timeout(spec: dict[str, Any]) -> float:
    """The spec's "demangle_timeout" (seconds), or the default."""
    value = spec.get("demangle_timeout", DEMANGLE_TIMEOUT)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_DEMANGLE_TIMEOUT):
        raise BuildError(f"spec: demangle_timeout: expected seconds in (0, {MAX_DEMANGLE_TIMEOUT:g}], got {value!r}")
    return float(value)


def resolve_entry(kernel: dict[str, Any], declared: str, cubin: CubinImage,
                  readable: dict[str, str]) -> tuple[str, str]:
    """(symbol, readable name) of the declared entry: its symbol, or its whole C++ name (qualified or,
    when unique, unqualified); the rule is ``cubinstore._core.cxxnames``'s, which the JIT uses too."""
    try:
        (resolved,) = resolve_entries([declared], cubin.kernels, readable, where=_where(kernel)).values()
    except CubinstoreError as exc:
        raise BuildError(str(exc)) from None
    return resolved


def check_layout(kernel: dict[str, Any], declared: str, symbol: str, types: list[str],
                 cubin: CubinImage, arch: abi.Arch) -> list[int]:
    """The offsets of the entry's parameters; fails unless the CUBIN has exactly them (``abi.layout_mismatch``)."""
    try:
        parsed = [abi.param_type(t) for t in types]
    except CubinstoreError as exc:
        raise BuildError(f"{_where(kernel)}: entry '{declared}': {exc}") from None
    expected = abi.param_layout(parsed, arch)
    mismatch = abi.layout_mismatch(parsed, arch, cubin.param_layout(symbol), offsets=expected)
    if mismatch is not None and mismatch.index is None:
        raise BuildError(f"{_where(kernel)}: entry '{declared}' takes {len(mismatch.actual)} parameters, "
                         f"declared {len(parsed)}: {types}")
    if mismatch is not None:
        i = mismatch.index
        (want, size), (offset, got) = mismatch.expected[i], mismatch.actual[i]
        raise BuildError(
            f"{_where(kernel)}: entry '{declared}' parameter {i} is {got} bytes at offset {offset}, "
            f"but declared '{parsed[i]}' is {size} bytes at offset {want} by the layout rule for {arch} "
            f"(cubinstore/_core/abi.py); the declaration does not match the kernel's signature")
    return list(expected)


def check_ptx_sizes(kernel: dict[str, Any], declared: str, types: list[str], sizes: tuple[int, ...],
                    arch: abi.Arch) -> list[int]:
    """The rule's offsets of a PTX entry's parameters; fails unless the PTX declares as many
    parameters as ``types``, each of the declared type's size."""
    try:
        parsed = [abi.param_type(t) for t in types]
    except CubinstoreError as exc:
        raise BuildError(f"{_where(kernel)}: entry '{declared}': {exc}") from None
    if len(parsed) != len(sizes):
        raise BuildError(f"{_where(kernel)}: entry '{declared}' takes {len(sizes)} parameters in the PTX, "
                         f"declared {len(parsed)}: {types}")
    for i, (param, size) in enumerate(zip(parsed, sizes)):
        if param.size != size:
            raise BuildError(f"{_where(kernel)}: entry '{declared}' parameter {i} is {size} bytes in the PTX, "
                             f"but declared '{param}' is {param.size} bytes; the declaration does not match "
                             "the kernel's signature")
    return list(abi.param_layout(parsed, arch))


def check_types(kernel: dict[str, Any], declared: str, symbol: str, types: list[str]) -> None:
    """Fails unless each declared type is one the entry's mangled name allows (where it says)."""
    params = decode_params(symbol)
    problem = None if params is None else type_problem(types, params)
    if problem is not None:
        index, why = problem
        raise BuildError(f"{_where(kernel)}: entry '{declared}' parameter {index} {why} ({symbol})")


# What a grid rule's `args[i]` may read: the launch evaluates it as an int (i8 .. u64).
_INTEGER_TYPES = frozenset(t for t in abi.SCALAR_TYPES if t[0] in "iu")


def check_rule_args(kernel: dict[str, Any], declared: str, types: list[str], where: str, rule: str) -> None:
    """Fails unless every `args[i]` of a grid rule is an integer parameter of the entry, so a rule
    that would raise at every launch fails the build instead."""
    try:
        indices = rule_arg_indices(rule)
    except CubinstoreError as exc:
        raise BuildError(f"{_where(kernel)}: launch {where}: {exc}") from None
    for i in indices:
        if i >= len(types):
            raise BuildError(f"{_where(kernel)}: launch {where}: rule {rule!r} reads args[{i}], but entry "
                             f"'{declared}' takes {len(types)} parameters (args[0] .. args[{len(types) - 1}])")
        if types[i] not in _INTEGER_TYPES:
            raise BuildError(f"{_where(kernel)}: launch {where}: rule {rule!r} reads args[{i}], which entry "
                             f"'{declared}' declares '{types[i]}'; a rule reads integer parameters "
                             f"({', '.join(sorted(_INTEGER_TYPES))})")


def _const(kernel: dict[str, Any], where: str, value: Any) -> Any:
    """A geometry value with placeholders filled: an int, or integer arithmetic to evaluate."""
    if isinstance(value, list):
        return [_const(kernel, f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, str):
        try:
            return eval_rule(value)
        except CubinstoreError as exc:
            raise BuildError(f"{_where(kernel)}: launch {where}: {exc}") from None
    return value


def launch_geometry(kernel: dict[str, Any], declared: str, types: list[str]) -> dict[str, Any] | None:
    geometry = kernel.get("launch", {}).get(declared)
    if geometry is None:
        return None
    out = {k: _const(kernel, f"{declared}.{k}", v) for k, v in geometry.items() if k != "grid"}
    if "grid" in geometry:
        grid = []
        items = geometry["grid"] if isinstance(geometry["grid"], list) else [geometry["grid"]]
        for i, item in enumerate(items):
            if isinstance(item, str):
                check_rule_args(kernel, declared, types, f"{declared}.grid[{i}]", item)
            try:  # constant arithmetic becomes a number; a rule over args/sm_count stays
                grid.append(eval_rule(item) if isinstance(item, str) else item)
            except CubinstoreError:
                grid.append(item)
        out["grid"] = grid
    try:
        return LaunchGeometry.from_json(out, f"{_where(kernel)}: launch of entry '{declared}'").to_json()
    except CubinstoreError as exc:
        raise BuildError(str(exc)) from None


def manifest_entry(kernel: dict[str, Any], demangler: str, timeout: float = DEMANGLE_TIMEOUT) -> dict[str, Any]:
    with open(kernel["cubin"], "rb") as f:
        data = f.read()
    ptx = _ptx.is_ptx(kernel["arch"])
    try:
        arch = _ptx.layout_arch(kernel["arch"])
        if ptx:
            _ptx.check_text(data, kernel["arch"], _where(kernel))
            ptx_entries = _ptx.entries(data.decode("ascii"))
            kernels: Collection[str] = list(ptx_entries)  # local or not, an entry is a kernel
        else:
            cubin = CubinImage(data, _where(kernel))
            kernels = cubin.kernels
        toolkit = toolkit_of(data, _where(kernel))  # the bytes' own word: a CUBIN's tool note, PTX's header
        readable = demangle(demangler, sorted(kernels), timeout=timeout)
        resolved = resolve_entries(kernel["entries"], kernels, readable, where=_where(kernel))
        entries = {}
        for declared, types in kernel["entries"].items():
            symbol, name = resolved[declared]
            offsets = (check_ptx_sizes(kernel, declared, types, ptx_entries[symbol][1], arch) if ptx
                       else check_layout(kernel, declared, symbol, types, cubin, arch))
            entry = {"name": name, "params": types, "offsets": offsets}
            check_types(kernel, declared, symbol, types)
            geometry = launch_geometry(kernel, declared, types)
            if geometry is not None:
                entry["launch"] = geometry
            entries[symbol] = entry
    except CubinstoreError as exc:  # a malformed CUBIN or PTX, an entry no kernel or two kernels match, the demangler
        raise BuildError(str(exc)) from None
    unknown = sorted(set(kernel.get("launch", {})) - set(kernel["entries"]))
    if unknown:
        raise BuildError(f"{_where(kernel)}: launch geometry for '{unknown[0]}', which is not a declared entry")
    return {
        "id": kernel["id"],
        "family": kernel["family"],
        "params": kernel["params"],
        "arch": kernel["arch"],
        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "entries": entries,
        "target": kernel["target"],
        "toolkit": toolkit,
        "min_driver": min_driver(toolkit, ptx=ptx),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    timeout = demangle_timeout(spec)
    kernels = [manifest_entry(k, spec["demangler"], timeout) for k in spec["kernels"]]
    templates = {}
    for path in spec.get("jit_templates", []):
        with open(path, encoding="utf-8") as f:
            template = json.load(f)
        templates[template.get("family")] = template
    try:
        # The runtime's own validation, JIT templates included.
        manifest = Manifest.build(kernels, source="the built manifest", jit_templates=templates)
    except CubinstoreError as exc:
        raise BuildError(str(exc)) from None
    with open(argv[2], "wb") as f:
        f.write(manifest.raw)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BuildError as exc:
        print(f"cubin_manifest: {exc}", file=sys.stderr)
        sys.exit(1)
