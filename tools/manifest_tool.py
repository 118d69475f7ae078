#!/usr/bin/env python3
"""Writes a manifest (schema cubinstore/manifest/v2) from the CUBINs a build produced.

Run by the CubinManifest action (`//tools:manifest_tool`). Everything in the manifest comes
from the produced bytes and the ABI contract in `cubinstore._core` (abi, cubin, geometry), which
the runtime imports too:
- digests and sizes are computed here;
- each declared entry is resolved to a kernel of its CUBIN: by symbol (an extern "C" name or
  a mangled name) or by its C++ name (`ns::gemm<128, 256>`), demangling the CUBIN's kernels;
  a kernel is what carries CUDA's entry mark, local (`__global__ static`) or global;
- each entry's parameters must have the sizes and offsets the ABI's layout rule gives the
  declared types (checked against the CUBIN's .nv.info), or the build fails naming the
  kernel, entry and parameter: a layout the runtime would refuse never ships;
- launch geometry is evaluated (integer arithmetic) and its grid rules checked.

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
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

# Under Bazel the package's sources are inputs at their workspace paths below the working
# directory (the execution root); run by hand, they are beside this script's directory.
for _root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.realpath(__file__)))):
    if os.path.isfile(os.path.join(_root, "cubinstore", "_core", "abi.py")):
        sys.path.insert(0, _root)
        break

from cubinstore._core import abi  # noqa: E402
from cubinstore._core.cubin import CubinImage  # noqa: E402
from cubinstore._core.geometry import LaunchGeometry, eval_rule  # noqa: E402
from cubinstore.errors import CubinstoreError  # noqa: E402
from cubinstore.manifest import Manifest  # noqa: E402

_INT_SUFFIX_RE = re.compile(r"\b(\d+)(?:u|l|ul|lu|ll|ull|llu)\b", re.IGNORECASE)
# A C++ name's tokens: words, numbers, '::', and single punctuation ('>>' is two closing brackets).
_TOKEN_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|::|\S", re.ASCII)
_OPEN, _CLOSE = frozenset("<(["), frozenset(">)]")

DEMANGLE_TIMEOUT = 120.0  # seconds, unless the spec says "demangle_timeout"
MAX_DEMANGLE_TIMEOUT = 3600.0
# c++filt prints one name per symbol: a few KiB each at most. More is not a demangler's output.
MAX_DEMANGLED_LINE = 16 * 1024


class BuildError(Exception):
    pass


def _where(kernel: dict[str, Any]) -> str:
    return f"kernel '{kernel['id']}' ({kernel['target']})"


def normalize_name(name: str) -> str:
    """A C++ name in one spelling: no blanks except between words, no integer suffixes."""
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
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        elif c == " " and depth == 0:
            start = i + 1
    return text[start:].strip()


def _run_bounded(argv: list[str], data: bytes, timeout: float, limit: int) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of ``argv`` fed ``data``; raises ``TimeoutError`` after ``timeout``
    seconds and ``OverflowError`` past ``limit`` bytes of output, the process group killed either way."""
    with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: a child that never reads cannot block us
        stdin.write(data)
        stdin.seek(0)
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    finished = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in out:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                    out[key.fd] += chunk
                    if len(out[key.fd]) > limit:
                        raise OverflowError
        try:
            status = proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
        finished = True
    finally:
        if not finished:  # its whole session: a child it started may hold the pipes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return status, bytes(out[out_fd]), bytes(out[err_fd])


def demangle(command: str, symbols: list[str], *, timeout: float = DEMANGLE_TIMEOUT) -> dict[str, str]:
    """Symbol -> readable function name, for the mangled ones, through the build's demangler.

    The demangler runs at most ``timeout`` seconds and may print at most one bounded line per
    name; a demangler that hangs, cannot start or prints anything else is a ``BuildError``."""
    mangled = [s for s in symbols if s.startswith("_Z")]
    if not mangled:
        return {}
    data = ("\n".join(mangled) + "\n").encode("ascii", "replace")
    try:
        status, stdout, stderr = _run_bounded([command], data, timeout, MAX_DEMANGLED_LINE * len(mangled))
    except TimeoutError:
        raise BuildError(f"demangler {command!r} did not finish within {timeout:g} s for {len(mangled)} names; "
                         f"killed") from None
    except OverflowError:
        raise BuildError(f"demangler {command!r} printed more than {MAX_DEMANGLED_LINE} bytes per name for "
                         f"{len(mangled)} names; not a demangler's output") from None
    except OSError as exc:
        raise BuildError(f"cannot run the demangler {command!r}: {exc.strerror or exc}") from None
    try:
        lines = stdout.decode("ascii").splitlines()
    except UnicodeDecodeError as exc:
        raise BuildError(f"demangler {command!r} printed a byte that is not ASCII at offset {exc.start}; "
                         f"C++ names are ASCII") from None
    if status != 0 or len(lines) != len(mangled):
        why = stderr.decode("utf-8", "replace").strip().splitlines()
        raise BuildError(f"demangler {command!r} exited {status} with {len(lines)} lines for "
                         f"{len(mangled)} names: {why[-1][:200] if why else ''}")
    for symbol, line in zip(mangled, lines):
        if not line.strip() or not line.isprintable() or len(line) > MAX_DEMANGLED_LINE:
            raise BuildError(f"demangler {command!r} gave {line[:80]!r} for {symbol}: expected a printable C++ name")
    return {s: function_name(line) for s, line in zip(mangled, lines)}


def demangle_timeout(spec: dict[str, Any]) -> float:
    """The spec's "demangle_timeout" (seconds), or the default."""
    value = spec.get("demangle_timeout", DEMANGLE_TIMEOUT)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_DEMANGLE_TIMEOUT):
        raise BuildError(f"spec: demangle_timeout: expected seconds in (0, {MAX_DEMANGLE_TIMEOUT:g}], got {value!r}")
    return float(value)


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


def resolve_entry(kernel: dict[str, Any], declared: str, cubin: CubinImage,
                  readable: dict[str, str]) -> tuple[str, str]:
    """(symbol, readable name) of the declared entry: its symbol, or its whole C++ name (qualified or,
    when unique, unqualified)."""
    kernels = cubin.kernels
    if declared in kernels:
        return declared, readable.get(declared, declared)
    qualified = sorted(s for s, name in readable.items() if _tokens(name) == _tokens(declared))
    matches = qualified or sorted(s for s, name in readable.items() if names_entry(declared, name))
    if len(matches) == 1:
        return matches[0], declared
    found = ", ".join(f"{readable.get(s, s)} ({s})" for s in sorted(kernels)) or "none"
    if matches:
        raise BuildError(f"{_where(kernel)}: entry '{declared}' matches {len(matches)} kernels of its CUBIN: "
                         f"{', '.join(matches)}; name it by its symbol or fully qualified")
    raise BuildError(f"{_where(kernel)}: entry '{declared}' is not a kernel of its CUBIN; its kernels: {found}")


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


def launch_geometry(kernel: dict[str, Any], declared: str) -> dict[str, Any] | None:
    geometry = kernel.get("launch", {}).get(declared)
    if geometry is None:
        return None
    out = {k: _const(kernel, f"{declared}.{k}", v) for k, v in geometry.items() if k != "grid"}
    if "grid" in geometry:
        grid = []
        for item in geometry["grid"] if isinstance(geometry["grid"], list) else [geometry["grid"]]:
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
    arch = abi.Arch.parse(kernel["arch"])
    try:
        cubin = CubinImage(data, _where(kernel))
        readable = demangle(demangler, sorted(cubin.kernels), timeout=timeout)
        entries = {}
        for declared, types in kernel["entries"].items():
            symbol, name = resolve_entry(kernel, declared, cubin, readable)
            if symbol in entries:
                raise BuildError(f"{_where(kernel)}: entries '{entries[symbol]['name']}' and '{declared}' "
                                 f"are one kernel, {symbol}")
            entry = {"name": name, "params": types, "offsets": check_layout(kernel, declared, symbol, types, cubin, arch)}
            geometry = launch_geometry(kernel, declared)
            if geometry is not None:
                entry["launch"] = geometry
            entries[symbol] = entry
    except CubinstoreError as exc:  # a malformed CUBIN
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
