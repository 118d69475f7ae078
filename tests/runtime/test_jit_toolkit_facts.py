"""A kernel the JIT compiles carries the same toolkit facts a release's kernel does (issue 31): the
local toolkit's version, which its key names, and the oldest driver that loads it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import ENTRIES, TU, make_library  # noqa: E402

from cubinstore import jit  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402


def test_a_jit_kernel_records_the_local_toolkit_and_its_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("CUBINSTORE_"):
            monkeypatch.delenv(name)
    jit.clear_caches()
    try:
        k = jit.compile(TU, include_dirs=[make_library(tmp_path / "lib")], arch="sm_90a", entries=ENTRIES,
                        store=Store([LocalLayer(tmp_path / "home")]))
        nvcc = k.key.parts.toolkit["version"]
        spec = k.spec
    finally:
        jit.clear_caches()
    root = os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    out = subprocess.run([f"{root}/bin/nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    assert nvcc == re.search(r"V(\d+\.\d+\.\d+)", out).group(1)  # type: ignore[union-attr]
    assert (spec.toolkit, spec.min_driver) == (nvcc, int(nvcc.split(".")[0]) * 1000)
