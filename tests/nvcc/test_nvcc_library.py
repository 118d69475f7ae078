"""The seed's scenario through cubinstore-nvcc: a kernel library's JIT (DeepGEMM's way of calling
nvcc, ``helpers.kernel_library``) at prefixes of different depth, through a symlinked tree and
with a fresh library cache each time: 41 compiles once, then 41 hits with no real nvcc run."""

from __future__ import annotations

import shutil
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


def test_bundled_headers_decide_hit_or_miss(tmp_path: Path) -> None:
    log = tmp_path / "nvcc.log"
    env = child_env(tmp_path / "home", CUBINSTORE_NVCC=str(counting_nvcc(tmp_path / "counting", log)))
    include = install_library(tmp_path / "venv")
    inst = INSTANTIATIONS[0]
    runs = iter(range(100))

    def build() -> tuple[int, bytes]:
        before = count_compiles(log)
        cubin = LibraryJit(include, tmp_path / f"cache{next(runs)}", WRAPPER, env=env).build(inst).read_bytes()
        return count_compiles(log) - before, cubin

    first = build()
    assert first[0] == 1
    # No lookup of the TU finds these: hits.
    (include / "README.md").write_text("# mylib\n")
    (include / "mylib" / "_version.py").write_text("version = '1.0'\n")
    (include / "__pycache__").mkdir()
    (include / "__pycache__" / "mylib.cpython-311.pyc").write_bytes(b"\x00" * 32)
    (include / "cute" / "NOTES").write_text("vendored from CUTLASS 4.2\n")
    assert build() == (0, first[1])
    # affine.cuh includes "mylib/types.cuh" quoted: its own directory is searched first, so a
    # types.cuh at mylib/mylib/ would shadow the one it read: a miss.
    (include / "mylib" / "mylib").mkdir()
    (include / "mylib" / "mylib" / "types.cuh").write_text((include / "mylib" / "types.cuh").read_text())
    assert build()[0] == 1
    shutil.rmtree(include / "mylib" / "mylib")
    assert build() == (0, first[1])
    # A bundled CuTe header the TU read, changed: a miss.
    with open(include / "cute" / "numeric" / "int.hpp", "a") as f:
        f.write("\n// patched by the library's vendor\n")
    assert build()[0] == 1
