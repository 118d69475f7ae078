"""Which files could change what a TU's ``#include`` lookups find: the names of a call record's probes.

nvcc's dependency list names the files a compile read. What it cannot name is a file that is
*not there* but would be found if it appeared: a header placed earlier in the search path than
the one the TU read (it would shadow it), or one a ``__has_include`` asked for. So for every
include name the TU and the headers it read spell, and for every header it read, each place a
lookup of that name could find it (the including file's directory for a quoted name, every
include root) is recorded as present or absent; a later call is a hit only while every such
place is as recorded and every file read has its recorded content.

Any other file is invisible to the compile: a README, a ``.py`` or ``__pycache__/`` added inside
an include root changes no probe, so the call still hits.

A ``__has_include`` whose argument is a macro cannot be enumerated: ``names`` then says so and
the caller keeps no record (the call is compiled through the full key instead). A computed
``#include MACRO`` needs nothing more: the file it found is among those read, and that file's
path is probed in every root.

Standard library only.
"""

from __future__ import annotations

import os
import re

__all__ = ["Incomplete", "names", "places"]

# A directive's name, spelled literally: #include / #include_next, and __has_include(_next), with
# <> or "". Each pattern starts with a literal, which the regex engine skips to (one alternation
# anchored at line starts scans every byte: ten times slower on CUTLASS's headers). A directive
# word in the middle of a line is counted too: that only adds probes.
_INCLUDE_RE = re.compile(rb'#[ \t]*include(?:_next)?[ \t]*(?:<([^<>\r\n]{1,1024})>|"([^"\r\n]{1,1024})")')
_HAS_INCLUDE_RE = re.compile(rb'__has_include(?:_next)?[ \t]*\([ \t]*(?:<([^<>\r\n]{1,1024})>|"([^"\r\n]{1,1024})")')
# A __has_include whose argument is not a literal name (a macro): what its lookup is cannot be read here.
_COMPUTED_HAS_INCLUDE_RE = re.compile(rb'__has_include(?:_next)?[ \t]*\([ \t]*[^<"\s]')


class Incomplete(Exception):
    """A file asks a lookup that cannot be read from its text (``__has_include(MACRO)``)."""


def names(text: bytes, where: str) -> tuple[set[str], set[str]]:
    """(angle names, quoted names) the text of one file spells in its include directives.

    Lines in disabled ``#if`` branches count too (a change of the condition comes from a file the
    record already covers, so counting them only adds probes). Raises ``Incomplete`` naming
    ``where`` for a computed ``__has_include``."""
    has = b"__has_include" in text
    if has and _COMPUTED_HAS_INCLUDE_RE.search(text):
        raise Incomplete(f"{where} has a __has_include of a macro")
    angle: set[str] = set()
    quoted: set[str] = set()
    found = list(_INCLUDE_RE.finditer(text)) + (list(_HAS_INCLUDE_RE.finditer(text)) if has else [])
    for m in found:
        if m.group(1) is not None:
            angle.add(m.group(1).decode("utf-8", "surrogateescape").strip())
        else:
            quoted.add(m.group(2).decode("utf-8", "surrogateescape").strip())
    return angle, quoted


def _inside(rel: str) -> str | None:
    """``rel`` normalised, if it stays inside its root (no absolute name, no climb out)."""
    if not rel or rel.startswith("/"):
        return None
    norm = os.path.normpath(rel)
    if norm == "." or norm.startswith("../") or norm == "..":
        return None
    return norm


def places(files: list[tuple[str, str, bytes]], roots: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Every (root label, relative path) a lookup of the compile could find a file at.

    ``files``: (label, relative path, content) of each file read inside a root, the TU included
    under the label ``"."`` (its quoted names are looked up in the roots only: its directory is
    a private one). ``roots``: (label, prefix) of each directory searched, in any order (all are
    probed): a name N is looked for at ``prefix + N`` below the label's base (the toolkit's
    headers are ``include/`` below its root)."""
    out: set[tuple[str, str]] = set()

    def everywhere(name: str) -> None:
        inside = _inside(name)
        if inside is not None:
            for label, prefix in roots:
                out.add((label, prefix + inside))

    for label, rel, text in files:
        where = rel if label == "." else f"{label}/{rel}"
        angle, quoted = names(text, where)
        for name in angle | quoted:
            everywhere(name)
        if label == ".":
            continue
        here = os.path.dirname(rel)
        for name in quoted:
            inside = _inside(os.path.join(here, name))
            if inside is not None:
                out.add((label, inside))
        # The file itself, under the name a search of its root finds it by: any root could shadow it.
        for root_label, prefix in roots:
            if root_label == label and rel.startswith(prefix):
                everywhere(rel[len(prefix):])
    return out
