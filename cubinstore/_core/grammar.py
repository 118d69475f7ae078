"""The name grammar, defined once: identifiers, words and relative paths of words.

``abi`` re-exports these (``from cubinstore._core.abi import IDENT_RE`` keeps working); they live
in their own module, with nothing but ``re`` imported, so ``cubinstore-nvcc``'s hit path can
check a ``-D`` name without loading the ABI's dataclasses.
"""

from __future__ import annotations

import re

__all__ = ["IDENT_RE", "REL_PATH_RE", "WORD_RE", "decimal"]

# A parameter key, a grid key, a placeholder, a macro name: a C identifier.
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# Family names and string parameter values become id segments (and target names): no '/', no spaces.
WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", re.ASCII)
# A relative path of words. '..' is a word: a caller that resolves the path refuses it itself.
REL_PATH_RE = re.compile(rf"{WORD_RE.pattern}(?:/{WORD_RE.pattern})*", re.ASCII)


def decimal(text: str, max_digits: int) -> int | None:
    """``text`` as a number when it is 1 to ``max_digits`` ASCII digits (a port, a Content-Length,
    a Retry-After, an nvcc flag's number), else None. ``str.isdigit`` alone is not enough: it takes
    ``'²'`` and other Unicode digits that ``int`` refuses, and ``int`` refuses more than 4300 digits."""
    if not 0 < len(text) <= max_digits or not (text.isascii() and text.isdigit()):
        return None
    return int(text)
