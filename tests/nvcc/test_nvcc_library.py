"""The seed's scenario through cubinstore-nvcc: a kernel library's JIT (DeepGEMM's way of calling
nvcc, ``helpers.kernel_library``) at prefixes of different depth, through a symlinked tree and
with a fresh library cache each time: 41 compiles once, then 41 hits with no real nvcc run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="cubinstore-nvcc needs the jit extra (xxhash)")

from helpers.jit import child_env  # noqa: E402
from helpers.kernel_library import INSTANTIATIONS, LibraryJit, count_compiles, counting_nvcc, install_library  # noqa: E402

WRAPPER = Path(sys.executable).with_name("cubinstore-nvcc")


def test_41_kernels_compile_once_wherever_the_library_is(tmp_path: Path) -> None:
    assert len(INSTANTIATIONS) == 41
    log = tmp_path / "nvcc.log"
    env = child_env(tmp_path / "home", CUBINSTORE_NVCC=str(counting_nvcc(tmp_path / "counting", log)))
    installs = [
        install_library(tmp_path / "venv"),
        install_library(tmp_path / "opt" / "conda" / "envs" / "serving-2026" / "x"),  # deeper prefix
        install_library(tmp_path / "container" / "app", symlinked=True),  # bundled headers through symlinks
    ]
    cubins: list[list[bytes]] = []
    for i, include in enumerate(installs):
        before = count_compiles(log)
        # verbose: DeepGEMM's ptxas report must be in every call's output, hits included.
        lib = LibraryJit(include, tmp_path / f"cache{i}", WRAPPER, verbose=True, env=env)
        cubins.append([lib.build(inst).read_bytes() for inst in INSTANTIATIONS])
        assert all(r.nvcc_ran for r in lib.records)  # the library's own cache missed every time (its key has the path)
        assert count_compiles(log) - before == (41 if i == 0 else 0), include
    assert cubins[1] == cubins[0] and cubins[2] == cubins[0]
    assert len(set(cubins[0])) == 41 and all(c[:4] == b"\x7fELF" for c in cubins[0])
