"""Which CUDA toolkit built a kernel, and which driver can load it: the one table and rule.

A manifest kernel records ``toolkit`` (the toolkit's version, ``"13.0.88"``, read from the bytes
it built: a CUBIN's ``.note.nv.tkinfo``, a PTX file's header) and ``min_driver`` (the oldest
driver that loads it, as ``cuDriverGetVersion`` reports a driver: ``13000`` is CUDA 13.0). The
build derives ``min_driver`` from ``toolkit`` here (``min_driver``), the JIT does the same for
what it compiles, and the loader compares it with the host's driver before any byte reaches it.

The rule (NVIDIA's CUDA compatibility guide): a CUBIN loads on any driver of its toolkit's major
version (minor version compatibility), so a 13.x CUBIN needs a CUDA 13.0 driver; PTX is compiled
by the driver's own JIT, which reads only the PTX ISA of its own release and older, so PTX from
toolkit X.Y needs a driver of CUDA X.Y or newer. ``LINUX_DRIVERS`` only words the messages.
"""

from __future__ import annotations

import re
from typing import Final

from cubinstore.errors import BadArgumentError

__all__ = ["LINUX_DRIVERS", "TOOLKIT_RE", "describe_driver", "facts", "min_driver", "toolkit_of"]

#: A toolkit version as a kernel records it: ``<major>.<minor>.<patch>`` (the patch optional).
TOOLKIT_RE: Final = re.compile(r"([1-9][0-9]?)\.([0-9]{1,2})(?:\.[0-9]{1,6})?", re.ASCII)
#: The oldest and the newest ``min_driver`` a manifest may hold (CUDA 1.0 .. 99.9, as the driver encodes it).
MIN_DRIVER_RANGE: Final = (1000, 99990)

#: CUDA release -> the Linux driver it shipped with (release notes, "CUDA Toolkit and Corresponding
#: Driver Versions"); (major, 0) is also the oldest driver every CUBIN of that major loads on.
LINUX_DRIVERS: Final = {
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03", (13, 0): "580.65.06",
}

# nvcc's words in a CUBIN's tool note and in a PTX file's header comment.
_RELEASE_RE: Final = re.compile(rb"Cuda compilation tools, release ([0-9]{1,2})\.([0-9]{1,2}), V([0-9.]{3,20})")
_TKINFO: Final = ".note.nv.tkinfo"
_PTX_HEADER_BYTES: Final = 1024  # the header comment comes before any directive


def toolkit_of(data: bytes, what: str) -> str:
    """The version of the toolkit that built ``data`` (a CUBIN or PTX text), e.g. ``"13.0.88"``.

    Raises ``BadArgumentError`` naming ``what`` when the bytes do not say (a CUBIN without the
    tool note nvcc writes, or PTX without nvcc's header)."""
    if data[:4] == b"\x7fELF":
        from cubinstore._core.cubin import CubinImage  # the build and the JIT ask; a manifest's reader never does

        note = CubinImage(data, what).section(_TKINFO)
        match = _RELEASE_RE.search(note) if note is not None else None
        where = f"its {_TKINFO} section"
    else:
        match = _RELEASE_RE.search(data[:_PTX_HEADER_BYTES])
        where = "its header comment"
    if match is None:
        raise BadArgumentError(f"{what}: {where} does not name the CUDA toolkit that built it "
                               "('Cuda compilation tools, release X.Y, VX.Y.Z'); build it with nvcc 12 or newer")
    version = match.group(3).decode("ascii")
    if not TOOLKIT_RE.fullmatch(version) or version.split(".")[:2] != [match.group(1).decode(), match.group(2).decode()]:
        raise BadArgumentError(f"{what}: {where} names toolkit {version!r}, which is not 'X.Y.Z' of release "
                               f"{match.group(1).decode()}.{match.group(2).decode()}")
    return version


def _major_minor(toolkit: str) -> tuple[int, int]:
    match = TOOLKIT_RE.fullmatch(toolkit) if isinstance(toolkit, str) else None
    if match is None:
        raise BadArgumentError(f"invalid toolkit version {toolkit!r}: expected 'X.Y' or 'X.Y.Z', e.g. '13.0.88'")
    return int(match.group(1)), int(match.group(2))


def min_driver(toolkit: str, *, ptx: bool) -> int:
    """The oldest driver (``cuDriverGetVersion``'s number) that loads what ``toolkit`` built:
    its major's first release for a CUBIN, the toolkit's own release for PTX (see the module)."""
    major, minor = _major_minor(toolkit)
    return major * 1000 + (minor * 10 if ptx else 0)


def facts(toolkit: object, *, ptx: bool = False) -> dict[str, str | int]:
    """A kernel's ``toolkit`` and ``min_driver`` fields for what ``toolkit`` built (KernelSpec keywords);
    none where ``toolkit`` is no version (the JIT's kernels carry them where their key names one)."""
    if not isinstance(toolkit, str) or not TOOLKIT_RE.fullmatch(toolkit):
        return {}
    return {"toolkit": toolkit, "min_driver": min_driver(toolkit, ptx=ptx)}


def describe_driver(version: int) -> str:
    """``13000`` -> ``"CUDA 13.0 (Linux driver 580.65.06 or newer)"``; the Linux number where the table has it."""
    major, minor = version // 1000, version % 1000 // 10
    linux = LINUX_DRIVERS.get((major, minor))
    return f"CUDA {major}.{minor}" + (f" (Linux driver {linux} or newer)" if linux else "")
