"""The manifest's two validating paths, for tests that hold the fast one to the full checker's answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cubinstore import Manifest
from cubinstore import manifest as manifest_module
from cubinstore.errors import CubinstoreError


def outcome(raw: bytes) -> Any:
    """What opening ``raw`` gives: the error (type and message), or every spec, entry, blob, arch and template."""
    try:
        m = Manifest.from_bytes(raw, source="m.json")
    except CubinstoreError as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", [k.to_json() for k in m.kernels], [(k.id, k.entry_specs) for k in m.kernels], m.blobs, m.archs,
            dict(m.jit_templates))


def _always_slow(text: str) -> Any:
    raise manifest_module._Slow


def full_checker(monkeypatch: pytest.MonkeyPatch) -> Callable[[bytes], Any]:
    """``outcome`` with the fast path off: the full checker alone decides."""
    def parse(raw: bytes) -> Any:
        with monkeypatch.context() as m:
            m.setattr(manifest_module, "_fast_index", _always_slow)
            return outcome(raw)
    return parse
