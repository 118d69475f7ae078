"""The manifest's two validating paths, for tests that hold the fast one to the full checker's answers."""

from __future__ import annotations

from typing import Any

from cubinstore import Manifest
from cubinstore.errors import CubinstoreError


def outcome(raw: bytes, *, fast: bool = True) -> Any:
    """What opening ``raw`` gives: the error (type and message), or every spec, entry, blob, arch and template."""
    try:
        m = Manifest.from_bytes(raw, source="m.json", fast=fast)
    except CubinstoreError as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", [k.to_json() for k in m.kernels], [(k.id, k.entry_specs) for k in m.kernels], m.blobs, m.archs,
            dict(m.jit_templates))


def full_checker(raw: bytes) -> Any:
    """``outcome`` with the fast path off (``Manifest.from_bytes(fast=False)``): the full checker alone decides."""
    return outcome(raw, fast=False)
