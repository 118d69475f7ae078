"""PTX in a release: a kernel whose arch is ``compute_<XY>[a|f]`` ships PTX text, which the driver
compiles for the device it loads on. The arch's prefix alone says a kernel is PTX.

``PtxArch`` is the grammar (the SM grammar of ``cubinstore._core.abi.Arch`` after ``compute_``)
and where PTX may run; ``check_text`` is the sanity check the loader runs on verified bytes in
place of the CUBIN's ELF header check; ``entries`` reads a PTX file's kernels and their parameter
sizes for the build's checks. Nothing here touches the driver.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final

from cubinstore._core.abi import Arch
from cubinstore.errors import BadArgumentError, CubinFormatError

__all__ = ["PTX_PREFIX", "PtxArch", "check_text", "entries", "is_ptx", "layout_arch"]

PTX_PREFIX: Final = "compute_"

# What nvcc writes before the kernels: `.version 9.0`, then `.target sm_90a` (maybe `, debug`).
_VERSION_RE: Final = re.compile(rb"^[ \t]*\.version[ \t]+([0-9]{1,2})\.([0-9]{1,2})[ \t]*$", re.M)
_TARGET_RE: Final = re.compile(rb"^[ \t]*\.target[ \t]+([A-Za-z0-9_]+)", re.M)
# PTX is ASCII text; a NUL would end what the driver reads before the verified bytes do.
_TEXT_BYTES: Final = bytes(range(0x20, 0x7F)) + b"\t\n\r"
_ENTRY_RE: Final = re.compile(r"(\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+([A-Za-z_$%][A-Za-z0-9_$]*)\s*\(([^)]*)\)")
_PARAM_BITS_RE: Final = re.compile(r"\.[busf](8|16|32|64)\b")
_PARAM_COUNT_RE: Final = re.compile(r"\[([0-9]{1,6})\]\s*$")


def is_ptx(arch: str) -> bool:
    """Whether a manifest arch names PTX (``compute_90``) rather than a CUBIN (``sm_90``)."""
    return arch.startswith(PTX_PREFIX)


@dataclass(frozen=True)
class PtxArch:
    """A PTX target, ``compute_90a``: the numbers and suffix of ``sm``, its SM arch."""

    sm: Arch

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def parse(text: object) -> PtxArch:
        sm = None
        if isinstance(text, str) and text.startswith(PTX_PREFIX):
            try:
                sm = Arch.parse("sm_" + text[len(PTX_PREFIX):])
            except BadArgumentError:
                pass
        if sm is None:
            shown = repr(text) if len(repr(text)) <= 40 else repr(text)[:37] + "..."
            raise BadArgumentError(
                f"invalid PTX arch {shown}: expected 'compute_<major><minor>' with optional 'a' or 'f', e.g. 'compute_90'"
            )
        return PtxArch(sm)

    def __str__(self) -> str:
        return PTX_PREFIX + str(self.sm)[3:]

    @property
    def target(self) -> str:
        """What the PTX's ``.target`` directive names: ``sm_90a`` for ``compute_90a``."""
        return str(self.sm)

    def runs_on(self, cc: tuple[int, int]) -> bool:
        """Whether the driver can compile this PTX for a GPU of compute capability ``cc``.

        ``compute_XYa`` only for X.Y; ``compute_XYf`` for major X from minor Y; plain
        ``compute_XY`` for X.Y and every newer GPU, of any major: that is what PTX is shipped for.
        """
        if self.sm.suffix:
            return self.sm.runs_on(cc)
        return (cc[0], cc[1]) >= (self.sm.major, self.sm.minor)


def layout_arch(arch: object) -> Arch:
    """The SM arch whose parameter layout rule a kernel of ``arch`` (``sm_`` or ``compute_``) follows;
    ``BadArgumentError`` for anything else."""
    return PtxArch.parse(arch).sm if isinstance(arch, str) and is_ptx(arch) else Arch.parse(arch)


def check_text(data: bytes, arch: str, what: str) -> None:
    """The verified bytes must be PTX text for ``arch``: ASCII, a ``.version`` and a ``.target`` naming
    ``arch``'s SM before any other target. Raises ``CubinFormatError`` naming ``what``."""
    target = PtxArch.parse(arch).target
    if not data or data.translate(None, _TEXT_BYTES):
        raise CubinFormatError(f"{what}: not PTX text (empty, or a byte that is not printable ASCII)")
    if _VERSION_RE.search(data) is None:
        raise CubinFormatError(f"{what}: not PTX text for {arch}: no '.version X.Y' directive")
    found = _TARGET_RE.search(data)
    if found is None or found.group(1).decode("ascii") != target:
        got = "no '.target'" if found is None else f"'.target {found.group(1).decode('ascii')}'"
        raise CubinFormatError(f"{what}: manifest says {arch}, the PTX has {got} (expected '.target {target}')")


def entries(text: str) -> dict[str, tuple[bool, tuple[int, ...]]]:
    """Each kernel (``.entry``) of PTX ``text``: symbol -> (local, the size in bytes of each parameter)."""
    found: dict[str, tuple[bool, tuple[int, ...]]] = {}
    for match in _ENTRY_RE.finditer(text):
        sizes = []
        for param in filter(None, (p.strip() for p in match.group(3).split(","))):
            bits = _PARAM_BITS_RE.search(param)
            count = _PARAM_COUNT_RE.search(param)
            if bits is None:
                raise BadArgumentError(f"PTX entry {match.group(2)}: cannot read the size of parameter {param!r}")
            sizes.append(int(bits.group(1)) // 8 * (int(count.group(1)) if count else 1))
        found[match.group(2)] = (match.group(1) is None, tuple(sizes))
    return found
