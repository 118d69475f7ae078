"""The two paths a first load's read can take: the compiled helper (``cubinstore._core.native``) and
Python. Tests of what a read checks run on both; a missing helper skips its half, or fails where
CUBINSTORE_REQUIRE_BAZEL_TESTS=1 (CI: tools/bootstrap.sh builds it)."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

from cubinstore.internals import native

PATHS = ("native", "python")


def built_helper() -> ModuleType:
    """The extension module; skips (or fails in CI) where it was not built."""
    helper = native.built()
    if helper is None:
        why = "the C helper cubinstore/_core/_native.c is not built (pip install -e . with a C compiler)"
        if os.environ.get("CUBINSTORE_REQUIRE_BAZEL_TESTS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return helper


def use(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make the layers made from now on read through ``path`` (one of ``PATHS``)."""
    if path == "native":
        built_helper()
    monkeypatch.setenv("CUBINSTORE_NATIVE", "1" if path == "native" else "0")
