"""The shape of nvcc's command line for one CUBIN, defined once for the build and the JIT.

``CUBIN_ARGV`` lists the command's words in order; a word in braces is a slot the caller
fills (``{flags}``, ``{includes}``, ``{defines}`` and ``{extra}`` with any number of words).
The Bazel rule (``tools/private/actions/compile.bzl``) expands the same table, mirrored in
Starlark and checked equal by ``tests/core/test_nvcc_argv.py``; ``cubin_argv`` is the JIT's
expansion. An action's command line is its cache key, so this order is part of every CUBIN's
key: change it only with a new key (and a rebuild) in mind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["CUBIN_ARGV", "LIST_SLOTS", "cubin_argv"]

CUBIN_ARGV: Final[tuple[str, ...]] = (
    "{nvcc}", "-cubin", "-arch={arch}", "-ccbin", "{host_cc}", "{flags}", "-I.", "{includes}", "{defines}",
    "-include", "{anchor}",
    # nvcc hands cicc the source's absolute path, which salts anonymous-namespace symbols: pin it
    # to the TU's relative name so the CUBIN's bytes do not depend on where the tree lives.
    "-Xcicc", "--orig_src_path_name", "-Xcicc", "{source_name}",
    "{extra}", "-o", "{output}", "{source}",
)
# Slots that take a list: includes become -I<dir>, defines -D<define>; flags and extra as given.
LIST_SLOTS: Final[Mapping[str, str]] = {"flags": "{}", "includes": "-I{}", "defines": "-D{}", "extra": "{}"}


def cubin_argv(values: Mapping[str, str | Sequence[str]]) -> list[str]:
    """``CUBIN_ARGV`` with every slot filled from ``values`` (each slot must be given)."""
    argv: list[str] = []
    for word in CUBIN_ARGV:
        if word.startswith("{") and word.endswith("}") and word[1:-1] in LIST_SLOTS:
            fmt = LIST_SLOTS[word[1:-1]]
            items = values[word[1:-1]]
            if isinstance(items, str):
                raise TypeError(f"nvcc slot {word}: expected a list of words, got a string")
            argv.extend(fmt.format(item) for item in items)
        else:
            argv.append(word.format(**{k: v for k, v in values.items() if isinstance(v, str)}))
    return argv
