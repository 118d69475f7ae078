"""What a store file may make a compile's checks read, defined once for the JIT and ``cubinstore-nvcc``.

A JIT dependency list (``v1/jit/deps/``), a call record (``v1/nvcc/calls/``, or a remote's) and
a toolchain record (``v1/nvcc/env/``) name files by path. Whoever can write the store (a
shared or foreign one, a remote) writes those paths, so each is checked against an allow-list
grammar before it is joined to a root or stat'ed, and a joined path must stay below its root:

- ``dep_rel_ok``: a path as nvcc's dependency list spells it below a root, which the JIT's
  direct check opens as spelled (a link in the root then leads where it led nvcc): words
  (``WORD_RE``), ``.`` and ``..`` between ``/``, never climbing above the root, ending in a
  word. nvcc spells the toolkit's headers ``bin/../targets/...``, and keeps a header's own
  ``#include "../x.h"`` (the toolkit's ``cooperative_groups/../cooperative_groups.h``).
- ``record_rel_ok``: what a call record names: nvcc's toolkit spelling ``bin/../`` at most once,
  first, then a ``REL_PATH_RE`` path (words only: no ``.``, ``..``, empty or absolute part).
- ``abs_path_ok``: an absolute path of words (the files a toolchain record's stats vouch for,
  and the toolkit root it names).

A TU named by path is read up to ``MAX_SOURCE_BYTES``, by the JIT and by ``cubinstore-nvcc``.

``join_below`` checks the join on the spelling (``os.path.normpath``), not on resolved links: a
link inside a root is the root owner's (a Bazel sandbox links every header, a symlinked tree is
one key), never a store file's. Standard library only: ``cubinstore-nvcc``'s hit path imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final

from cubinstore._core.grammar import REL_PATH_RE, WORD_RE

__all__ = ["MAX_PATH_CHARS", "MAX_SOURCE_BYTES", "TOOLKIT_SPELLING", "abs_path_ok", "dep_rel_ok", "join_below", "record_rel_ok"]

MAX_PATH_CHARS: Final = 4096  # PATH_MAX: no longer path is one the kernel opens
MAX_SOURCE_BYTES: Final = 64 << 20  # a TU read from a file (a generated one is a few hundred KiB)
TOOLKIT_SPELLING: Final = "bin/../"  # nvcc's -I of the toolkit's headers: <root>/bin/../targets/...


def dep_rel_ok(rel: object) -> bool:
    """Whether ``rel`` is a path below a root as nvcc's dependency list spells it (see above)."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH_CHARS:
        return False
    depth = 0
    parts = rel.split("/")
    for part in parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part != "." and not WORD_RE.fullmatch(part):
            return False
        elif part != ".":
            depth += 1
    return parts[-1] not in (".", "..")


def record_rel_ok(rel: object) -> bool:
    """Whether ``rel`` is a path a call record may name below a root (see above)."""
    return (isinstance(rel, str) and len(rel) <= MAX_PATH_CHARS
            and REL_PATH_RE.fullmatch(rel.removeprefix(TOOLKIT_SPELLING)) is not None)


def abs_path_ok(path: object) -> bool:
    """Whether ``path`` is an absolute path of words (``/`` then a ``REL_PATH_RE`` path)."""
    return (isinstance(path, str) and len(path) <= MAX_PATH_CHARS and path.startswith("/")
            and REL_PATH_RE.fullmatch(path[1:]) is not None)


def join_below(base: str, rel: object, ok: Callable[[object], bool] = dep_rel_ok) -> str | None:
    """``base/rel`` as spelled, if ``ok(rel)`` and the joined path stays below ``base``; else None."""
    if not ok(rel):
        return None
    path = f"{base}/{rel}"
    top = os.path.normpath(base).rstrip("/") + "/"
    return path if os.path.normpath(path).startswith(top) else None
