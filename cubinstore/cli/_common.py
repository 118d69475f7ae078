"""What several command groups share: the progress bar, byte counts for people, the local store a
command works on (checked once, in one line), and ``--arch`` parsing."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from cubinstore._core import knobs
from cubinstore.errors import BadArgumentError
from cubinstore.store import LocalLayer

__all__ = ["Progress", "archs", "human", "local_store", "parse_bytes", "usable"]


class Progress:
    """A one-line progress bar on stderr (blobs, bytes, rate), only when stderr is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.shown = False
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - self.drawn < 0.1:  # at most 10 redraws a second
            return
        self.drawn = now
        width = 30
        filled = width * done // total
        rate = nbytes / max(now - self.started, 1e-6)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                          f"{human(nbytes)} {human(int(rate))}/s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def parse_bytes(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = raw[-1:] if raw[-1:] in units and raw[-1:] else ""
    number = raw[: len(raw) - len(suffix)]
    if not number.isdigit():
        raise BadArgumentError(f"--max-bytes: expected a non-negative integer with optional K/M/G/T suffix, got {text!r}")
    return int(number) * units[suffix]


def local_store() -> LocalLayer:
    """The local store of this host (``CUBINSTORE_HOME`` or the user cache directory)."""
    return LocalLayer(knobs.home())


def usable(local: LocalLayer, *, check: bool = False, create: bool = False) -> LocalLayer:
    """``local``, once its root opens; ``check``: once the directories down to ``v1/cas`` that
    exist pass the ownership checks every write makes; ``create``: once they all exist (made
    here) and pass them. A store that cannot be used at all (its root a file, a directory
    others can write, a root that cannot be made) fails the command here, in one line naming
    the store and the cause, rather than once for every blob of a closure.
    """
    from cubinstore.store.local.root import StoreRoot

    with StoreRoot(local.root, allow_shared=knobs.allow_shared_store()).dir("v1", "cas", create=create, check=check):
        pass
    return local


def archs(values: Sequence[str] | None) -> set[str] | None:
    """``--arch`` values (repeatable, or comma-separated), each checked; None when none was given."""
    if not values:
        return None
    from cubinstore.manifest import parse_arch

    found = {a.strip() for value in values for a in value.split(",") if a.strip()}
    for arch in found:
        parse_arch(arch)
    return found
