"""The kernel-library fixture itself, with the real nvcc: its 41 instantiations compile to CUBINs
holding the symbols it names, and its JIT's own cache misses after a relocation, as DeepGEMM's
did (the calls cubinstore-nvcc is for). The 41 compile once (two at a time, as two ranks would);
the relocation compiles one instantiation of each element type and checks the other keys only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.kernel_library import (
    ELEMENT_TYPES,
    INSTANTIATIONS,
    ElementType,
    Instantiation,
    LibraryJit,
    LibraryJitError,
    copy_install,
    count_compiles,
    count_runs,
    counting_nvcc,
    include_root,
    install_library,
    real_nvcc,
    round_to,
)

from cubinstore.internals import Arch, CubinImage, param_layout, param_type

ONE_OF_EACH_TYPE = [next(i for i in INSTANTIATIONS if i.dtype == t) for t in ELEMENT_TYPES]


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The library at a shallow prefix, its 41 kernels built once through a counting nvcc."""
    base = tmp_path_factory.mktemp("kernel_library")
    log = base / "nvcc.log"
    nvcc = counting_nvcc(base / "toolkit", log)
    root = install_library(base / "a")
    jit = LibraryJit(root, base / "cache", nvcc)
    with ThreadPoolExecutor(max_workers=2) as pool:
        cubins = dict(zip(INSTANTIATIONS, pool.map(jit.build, INSTANTIATIONS)))
    yield SimpleNamespace(base=base, log=log, nvcc=nvcc, root=root, jit=jit, cubins=cubins)


def test_grid_has_41_distinct_names_and_symbols_covering_every_element_type() -> None:
    assert len(INSTANTIATIONS) == 41
    assert len({i.name for i in INSTANTIATIONS}) == 41
    assert len({i.symbol for i in INSTANTIATIONS}) == 41
    assert {i.dtype for i in INSTANTIATIONS} == set(ELEMENT_TYPES)


def test_install_lays_the_library_out_as_pip_does(tmp_path: Path) -> None:
    root = install_library(tmp_path / "p")
    assert root == include_root(tmp_path / "p") and root.parts[-5:-2] == ("lib", root.parts[-4], "site-packages")
    assert (root.parent / "__init__.py").is_file()
    for path in ("cute/config.hpp", "cute/numeric/int.hpp", "cutlass/numeric_types.h", "mylib/affine.cuh"):
        assert (root / path).is_file() and not (root / path).is_symlink(), path
    with pytest.raises(FileExistsError, match=f"^{root}: the library is already installed"):
        install_library(tmp_path / "p")


def test_every_instantiation_compiles_to_a_cubin_with_its_symbol_and_layout(lib: SimpleNamespace) -> None:
    assert lib.jit.nvcc_runs() == 41 and count_compiles(lib.log) == 41
    assert count_runs(lib.log) == 42  # and the JIT's one `nvcc --version`
    arch = Arch.parse("sm_90a")
    for inst, path in lib.cubins.items():
        assert path.parent.name.startswith(f"kernel.{inst.name}.")
        image = CubinImage(path.read_bytes(), str(path))
        assert image.sm == 90, inst.name
        assert inst.symbol in image.kernels, f"{inst.name}: {sorted(image.kernels)}"
        types = [param_type(t) for t in inst.entry_types]
        expected = tuple(zip(param_layout(types, arch), (t.size for t in types)))
        assert image.param_layout(inst.symbol) == expected, inst.name


def test_nvcc_runs_from_the_cache_tmp_dir_with_deepgemms_flags(lib: SimpleNamespace) -> None:
    record = lib.jit.records[0]
    assert record.argv[0] == str(lib.nvcc) and record.argv[2:4] == ("-cubin", "-o")
    source, cubin = Path(record.argv[1]), Path(record.argv[4])
    assert source.name == "kernel.cu" and source.parent.parent == lib.base / "cache" / "tmp"
    assert cubin == source.parent / "kernel.cubin"
    assert f"-I{lib.root}" in record.argv and "--gpu-architecture=sm_90a" in record.argv
    assert not any((lib.base / "cache" / "tmp").iterdir())  # every tmp dir was renamed into cache/


def test_second_jit_over_the_same_cache_runs_no_nvcc(lib: SimpleNamespace) -> None:
    again = LibraryJit(lib.root, lib.base / "cache", lib.nvcc)
    before = count_compiles(lib.log)
    assert [again.build(i) for i in INSTANTIATIONS] == list(lib.cubins.values())
    assert again.nvcc_runs() == 0 and count_compiles(lib.log) == before


def test_relocated_prefix_misses_the_library_cache_and_runs_nvcc(lib: SimpleNamespace) -> None:
    # What the seed measured on DeepGEMM: its key holds -I<include root>, so every kernel recompiles.
    moved = copy_install(lib.base / "a", lib.base / "opt" / "venvs" / "prod-2")
    relocated = LibraryJit(moved, lib.base / "cache", lib.nvcc)
    assert all(relocated.cache_path(i) != lib.jit.cache_path(i) for i in INSTANTIATIONS)
    before = count_compiles(lib.log)
    for inst in ONE_OF_EACH_TYPE:
        assert relocated.build(inst).read_bytes() == lib.cubins[inst].read_bytes(), inst.name
    assert relocated.nvcc_runs() == len(ONE_OF_EACH_TYPE) == count_compiles(lib.log) - before


def test_key_without_the_include_root_survives_relocation(lib: SimpleNamespace) -> None:
    # Newer DeepGEMM strips -I<include root> from its key: its own cache then survives a move.
    moved = copy_install(lib.base / "a", lib.base / "b" / "c")
    first = LibraryJit(lib.root, lib.base / "cache2", lib.nvcc, key_has_include_root=False)
    relocated = LibraryJit(moved, lib.base / "cache2", lib.nvcc, key_has_include_root=False)
    assert all(first.key(i) == relocated.key(i) for i in INSTANTIATIONS)
    assert first.key(INSTANTIATIONS[0]) != lib.jit.key(INSTANTIATIONS[0])


def test_symlinked_install_compiles_the_same_bytes(lib: SimpleNamespace) -> None:
    root = install_library(lib.base / "linked" / "env", symlinked=True)
    assert (root / "cute").is_symlink() and not os.path.isabs(os.readlink(root / "cute"))
    assert (root / "cute" / "config.hpp").is_file()
    moved = copy_install(lib.base / "linked" / "env", lib.base / "linked2")
    assert (moved / "cutlass").is_symlink() and (moved / "cutlass" / "numeric_types.h").is_file()
    jit = LibraryJit(moved, lib.base / "cache_linked", real_nvcc())
    inst = INSTANTIATIONS[3]
    assert jit.build(inst).read_bytes() == lib.cubins[inst].read_bytes()
    assert jit.nvcc_runs() == 1


def test_verbose_build_returns_ptxas_report_and_passes_the_local_memory_check(tmp_path: Path) -> None:
    root = install_library(tmp_path / "p")
    jit = LibraryJit(root, tmp_path / "cache", real_nvcc(), verbose=True, ptxas_check=True)
    inst = INSTANTIATIONS[0]
    jit.build(inst)
    record = jit.records[-1]
    assert record.nvcc_ran and record.returncode == 0
    assert f"Compiling entry function '{inst.symbol}'" in record.output
    assert "--ptxas-options=--verbose,--warn-on-local-memory-usage" in record.argv
    assert jit.key(inst) != LibraryJit(root, tmp_path / "cache", real_nvcc()).key(inst)


def test_failing_compile_raises_with_nvcc_output(tmp_path: Path) -> None:
    root = install_library(tmp_path / "p")
    jit = LibraryJit(root, tmp_path / "cache", real_nvcc())
    bad = Instantiation(ElementType("bad", "no_such_type", "x", 0, "f32"), 128, 1)
    with pytest.raises(LibraryJitError, match=r"^affine_bad_b128_v1: nvcc .* exited [1-9]") as info:
        jit.build(bad)
    assert "no_such_type" in str(info.value)
    assert not (tmp_path / "cache" / "cache").exists()


def test_nvcc_without_a_release_line_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'some compiler 1.0'\n")
    fake.chmod(0o755)
    with pytest.raises(LibraryJitError, match=f"^{fake} --version: expected exit 0 and 'release X.Y'"):
        LibraryJit(tmp_path, tmp_path / "cache", fake)


def test_real_nvcc_version_is_parsed(tmp_path: Path) -> None:
    jit = LibraryJit(tmp_path, tmp_path / "cache", real_nvcc())
    assert jit.version.count(".") == 1 and jit.signature == f"NVCC{jit.version}"


def test_reference_rounds_to_the_storage_type() -> None:
    assert round_to("f16", 1 / 3) == 0.333251953125
    assert round_to("bf16", 1 / 3) == 0.333984375
    assert round_to("f32", 0.1) != 0.1 and round_to("f64", 0.1) == 0.1
    f32 = next(i for i in INSTANTIATIONS if i.dtype.label == "f32")
    assert f32.reference([1.5, -2.0], 2.0, 1.0) == [4.0, -3.0]
    f16 = next(i for i in INSTANTIATIONS if i.dtype.label == "f16")
    assert f16.reference([1 / 3], 1.0, 0.0) == [0.333251953125]
    assert f16.grid(1) == 1 and f16.grid(f16.block * f16.vec + 1) == 2
