"""CubinScan: copy the declared headers a translation unit includes into a tree artifact.

    header_closure.py @PARAMS   (one argument a line: --out DIR --src FILE [--copy FILE]... [--root DIR]... HEADER...)

A family with `header_closure = True` compiles each TU from this tree instead of from every
declared header, so its key holds only the headers the TU can read (docs/header-closure.md).

From the source, every `#include` and `__has_include` line is followed through the declared
headers, whatever `#if` surrounds it (a superset of what the preprocessor reads: sound, since
the first match of every name is copied, so the preprocessor finds each file where it finds it
among all declared headers). A name is resolved as the preprocessor does: the includer's
directory for `"..."`, then the `--root`s in order (the compile's `-I` order); a name found in
none is a toolkit or system header, or a missing one, which the compile reports. Where text
cannot say what is read (`#include MACRO`, `#include_next`) every declared header is copied.
Each file lands at `<out>/<its path below the execution root>`, and so does each `--copy` file
(the module anchor the compile force-includes): nvcc runs inside the tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass

# Bounds on what one scan reads: the declared inputs are the build's, but a runaway glob or a
# binary file among the headers must fail with a clear message, not exhaust the worker.
MAX_FILES = 50_000
MAX_FILE_BYTES = 16 << 20

_DIRECTIVE = re.compile(rb"^[ \t]*#[ \t]*(include_next|include)\b[ \t]*(.*)$", re.MULTILINE)
_HAS_INCLUDE = re.compile(rb"__has_include(?:_next)?[ \t]*\([ \t]*([<\"][^>\"\n]+[>\"]|[A-Za-z_]\w*[ \t]*(?:\([^)\n]*\))?)")
_DEFINE = re.compile(rb"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(\([^)\n]*\))?[ \t]+([<\"][^>\"\n]+[>\"])[ \t]*$",
                     re.MULTILINE)
_NAME = re.compile(rb"^([<\"])([^>\"\n]+)[>\"]")
_MACRO = re.compile(rb"^([A-Za-z_]\w*)[ \t]*(?:\(([^)\n]*)\))?[ \t]*(?:/[/*].*)?$")


class ScanError(Exception):
    """The scan cannot go on (a file too large, too many files, an unreadable input)."""


def _read(path: str, max_file_bytes: int) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > max_file_bytes:
            raise ScanError(f"{path}: {size} bytes, more than the {max_file_bytes} a header may have")
        with open(path, "rb") as f:
            return f.read(max_file_bytes + 1)
    except OSError as exc:
        raise ScanError(f"cannot read {path}: {exc}") from exc


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _split_args(raw: bytes | None) -> tuple[str, ...] | None:
    return None if raw is None else tuple(a.strip() for a in _text(raw).split(","))


@dataclass(frozen=True)
class Refs:
    """What one file says about what it reads."""

    literal: list[tuple[bool, str]]  # (quoted, name) of `#include "x"`, `<x>`, `__has_include(...)`
    computed: list[tuple[str, tuple[str, ...] | None]]  # (macro, args or None) of `#include MACRO(args)`
    everything: str | None  # why the text cannot say what is read (`#include_next`, an odd line)


def _reference(raw: bytes, literal: list, computed: list) -> bool:
    """Adds what an include operand names; False where it is neither a name nor a macro."""
    name = _NAME.match(raw)
    if name is not None:
        literal.append((name.group(1) == b'"', _text(name.group(2))))
        return True
    macro = _MACRO.match(raw)
    if macro is not None:
        computed.append((_text(macro.group(1)), _split_args(macro.group(2))))
        return True
    return False


def references(text: bytes) -> Refs:
    literal: list[tuple[bool, str]] = []
    computed: list[tuple[str, tuple[str, ...] | None]] = []
    for match in _DIRECTIVE.finditer(text):
        directive, rest = match.group(1), match.group(2).strip()
        if directive == b"include_next":
            return Refs([], [], f"#include_next {_text(rest)}")
        if not _reference(rest, literal, computed):
            return Refs([], [], f"#include {_text(rest)}")
    if b"__has_include" in text:  # a substring test first: the regex costs more than most files' scan
        for match in _HAS_INCLUDE.finditer(text):
            _reference(match.group(1).strip(), literal, computed)
    return Refs(literal, computed, None)


def defines(text: bytes) -> list[tuple[str, tuple[str, ...] | None, str]]:
    """(macro, params or None, "<...>" or "\"...\"") of each `#define` of a header name in `text`."""
    return [(_text(m.group(1)), _split_args(m.group(2)[1:-1] if m.group(2) else None), _text(m.group(3)))
            for m in _DEFINE.finditer(text)]


def expand(body: str, params: tuple[str, ...] | None, args: tuple[str, ...] | None) -> str | None:
    """`body` with each parameter replaced by its argument; None where the call does not fit."""
    if (params is None) != (args is None) or (params is not None and args is not None and len(params) != len(args)):
        return None
    for param, arg in zip(params or (), args or ()):
        body = re.sub(rf"\b{re.escape(param)}\b", lambda _m, a=arg: a, body)
    return body


def resolve(name: str, includer: str, quoted: bool, roots: list[str], declared: set[str]) -> str | None:
    """The declared file the preprocessor would open for `name`, or None (toolkit, system, missing)."""
    directories = ([os.path.dirname(includer)] if quoted else []) + roots
    for directory in directories:
        candidate = os.path.normpath(os.path.join(directory, name))
        if candidate in declared:
            return candidate
    return None


def closure(src: str, roots: list[str], declared: set[str], *,
            max_file_bytes: int = MAX_FILE_BYTES) -> tuple[list[str], str | None]:
    """The source and the declared headers it reaches, in discovery order; all of them where a
    file says so (the second value: why). A file over ``max_file_bytes`` is a ``ScanError``.

    A computed include (`#include CUDA_STD_HEADER(tuple)`, as CUTLASS writes them) is expanded
    with every `#define` of its macro to a `<...>` or `"..."` in the files reached, whichever
    branch it sits in; a macro with no such definition there makes the scan copy everything.
    """
    order, todo, seen = [src], [src], {src}
    definitions: dict[str, list[tuple[tuple[str, ...] | None, str]]] = {}
    pending: dict[tuple[str, tuple[str, ...] | None, str], int] = {}  # call -> definitions expanded
    texts: list[bytes] = []  # of the files read, in order; their #defines are read once a computed include needs them
    defined = 0  # texts[:defined] have given their #defines

    def reach(name: str, includer: str, quoted: bool) -> None:
        found = resolve(name, includer, quoted, roots, declared)
        if found is not None and found not in seen:
            if len(seen) >= MAX_FILES:
                raise ScanError(f"{src} reaches more than {MAX_FILES} headers")
            seen.add(found)
            order.append(found)
            todo.append(found)

    while todo:
        while todo:
            path = todo.pop()
            text = _read(path, max_file_bytes)
            texts.append(text)
            refs = references(text)
            if refs.everything is not None:
                return [src, *sorted(declared - {src})], f"{path}: {refs.everything}"
            for macro, args in refs.computed:
                pending.setdefault((macro, args, path), 0)
            for quoted, name in refs.literal:
                reach(name, path, quoted)
        # Expand every computed include with the definitions found so far (more may come).
        if pending:
            for text in texts[defined:]:
                for macro, params, body in defines(text):
                    definitions.setdefault(macro, []).append((params, body))
            defined = len(texts)
        for call, done in list(pending.items()):
            macro, args, includer = call
            bodies = definitions.get(macro, [])
            if not bodies:
                continue
            for params, body in bodies[done:]:
                text = expand(body, params, args)
                if text is None:
                    return [src, *sorted(declared - {src})], f"{includer}: #include {macro}{args or ''} fits no definition"
                reach(text[1:-1], includer, text[0] == '"')
            pending[call] = len(bodies)
    unresolved = sorted({(m, i) for (m, _a, i), done in pending.items() if done == 0})
    if unresolved:
        macro, includer = unresolved[0]
        return [src, *sorted(declared - {src})], f"{includer}: #include {macro}: no #define of it in the headers reached"
    return order, None


def copy_tree(files: Iterable[str], out: str) -> None:
    for path in files:
        if os.path.isabs(path) or path.split("/")[0] == "..":
            raise ScanError(f"'{path}' is not below the execution root")
        dest = os.path.join(out, path)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(path, dest)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="header_closure", fromfile_prefix_chars="@")
    parser.add_argument("--out", required=True, help="the tree artifact's directory")
    parser.add_argument("--src", required=True, help="the translation unit")
    parser.add_argument("--copy", action="append", default=[], help="a file the compile reads besides the closure")
    parser.add_argument("--root", action="append", default=[], help="an -I root, in the compile's order")
    parser.add_argument("headers", nargs="*", help="every declared header")
    args = parser.parse_args(argv)
    declared = {os.path.normpath(h) for h in args.headers}
    if len(declared) > MAX_FILES:
        print(f"CubinScan {args.src}: {len(declared)} declared headers, more than {MAX_FILES}", file=sys.stderr)
        return 1
    roots = [os.path.normpath(r) for r in args.root]
    try:
        files, _everything = closure(os.path.normpath(args.src), roots, declared)
        copy_tree([*files, *(os.path.normpath(c) for c in args.copy)], args.out)
    except ScanError as exc:
        print(f"CubinScan {args.src}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
