"""The toolkit's header sets (third_party/cuda/header_sets.bzl): a compile declares the compiler,
the core headers and the optional sets its `toolkit_headers` names, nothing else, and the set
is a promise the sandbox keeps: a header outside it fails the compile naming the header, and a
change to a file inside it re-runs exactly the compiles that declare it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._workspace import COMPILE, BazelError, append, replace_with_copy
from .conftest import Matrix
from .test_toolkit import chosen_toolkit, copy_toolkit

pytestmark = pytest.mark.bazel

AXPY = "//kernels/axpy:"
TRANSPOSE = "//kernels/transpose:"
CUDA = "external/local_cuda/"

PROBE_BUILD = """\
load("//tools:defs.bzl", "cuda_cubin")

[
    cuda_cubin(
        name = name,
        srcs = [src],
        arch = "sm_80",
        entries = {{"probe": ["ptr"]}},
        family = "probe",
        id = "probe/" + name,
        toolkit_headers = sets,
    )
    for name, src, sets in [
        ("std_undeclared", "std.cu", []),
        ("std_declared", "std.cu", ["libcudacxx"]),
        ("cub_undeclared", "cub.cu", ["libcudacxx"]),
        ("cub_declared", "cub.cu", ["cub"]),
        ("unknown_set", "std.cu", {unknown}),
    ]
]
"""

# One header of libcu++ and one of CUB, each small; both are in every CUDA 12 and 13 toolkit.
STD_CU = '#include <cuda/std/limits>\nextern "C" __global__ void probe(int* p) { p[0] = cuda::std::numeric_limits<int>::max(); }\n'
CUB_CU = '#include <cub/version.cuh>\nextern "C" __global__ void probe(int* p) { p[0] = CUB_VERSION; }\n'


@pytest.fixture(scope="module")
def probe(matrix: Matrix) -> Iterator[Matrix]:
    pkg = matrix.ws.root / "toolkit_headers_probe"
    pkg.mkdir()
    (pkg / "BUILD.bazel").write_text(PROBE_BUILD.format(unknown='["cccl"]'))
    (pkg / "std.cu").write_text(STD_CU)
    (pkg / "cub.cu").write_text(CUB_CU)
    try:
        yield matrix
    finally:
        shutil.rmtree(pkg)


def _toolkit_inputs(spawn_inputs: tuple[str, ...]) -> set[str]:
    return {p[len(CUDA):] for p in spawn_inputs if p.startswith(CUDA)}


def test_each_compile_declares_the_compiler_the_core_headers_and_only_its_sets(matrix: Matrix) -> None:
    compiles = {s.label: _toolkit_inputs(s.inputs) for s in matrix.baseline.spawns if s.mnemonic == COMPILE}
    axpy = [files for label, files in compiles.items() if label.startswith(AXPY)]
    transpose = [files for label, files in compiles.items() if label.startswith(TRANSPOSE)]
    assert axpy and transpose
    for files in axpy + transpose:
        # What nvcc -cubin runs, and the header it force-includes.
        assert {"bin/nvcc", "bin/nvcc.profile", "bin/ptxas", "nvvm/bin/cicc", "include/cuda_runtime.h",
                "host_compiler.id"} <= files
        assert any(f.startswith("nvvm/libdevice/") for f in files)
        # nvcc -cubin runs none of these; a change to them must not re-key a compile.
        assert not {"bin/cudafe++", "bin/fatbinary", "bin/nvlink", "bin/bin2c"} & files
        assert not any(f.startswith(("include/cccl/cub/", "include/cccl/thrust/", "include/cub/", "include/thrust/"))
                       for f in files)
    # axpy declares toolkit_headers = []: no CCCL at all, a tenth of the toolkit.
    for files in axpy:
        assert not any(f.startswith(("include/cccl/", "include/cuda/")) for f in files)
        assert len(files) < 400, len(files)
    # transpose declares libcu++ (CuTe includes <cuda/std/...>).
    for files in transpose:
        assert any(f.startswith(("include/cccl/cuda/std/", "include/cuda/std/")) for f in files)


def test_a_toolkit_header_outside_the_declared_sets_fails_the_compile_naming_it(probe: Matrix) -> None:
    ws = probe.ws
    for target, header in (("std_undeclared", "cuda/std/limits"), ("cub_undeclared", "cub/version.cuh")):
        with pytest.raises(BazelError) as failed:
            ws.build([f"//toolkit_headers_probe:{target}"], disk_cache=None)
        output = failed.value.output
        assert f"{header}: No such file or directory" in output, output[-3000:]
        assert f"//toolkit_headers_probe:{target}" in output
    # The same sources with their sets declared compile: the failures were the sets' doing.
    built = ws.build(["//toolkit_headers_probe:std_declared", "//toolkit_headers_probe:cub_declared"], disk_cache=None)
    assert built.misses() == {"//toolkit_headers_probe:std_declared", "//toolkit_headers_probe:cub_declared"}


def test_an_unknown_header_set_fails_naming_target_attribute_value_and_allowed_values(probe: Matrix) -> None:
    with pytest.raises(BazelError) as failed:
        probe.ws.build(["//toolkit_headers_probe:unknown_set"], disk_cache=None)
    assert failed.value.fail_message() == (
        "//toolkit_headers_probe:unknown_set: attribute 'toolkit_headers' has 'cccl'; allowed: "
        "'all', 'libcudacxx', 'cub', 'thrust' (the toolkit's core headers are always there)"), failed.value.output


def test_a_changed_header_of_a_set_re_runs_exactly_the_compiles_that_declare_it(
        matrix: Matrix, tmp_path: Path) -> None:
    changed = copy_toolkit(matrix.toolkit, tmp_path / "cuda-changed").resolve()
    try:
        limits = next(p for p in (changed / "include" / "cccl" / "cuda" / "std" / "limits",
                                  changed / "include" / "cuda" / "std" / "limits") if p.exists())
        replace_with_copy(limits, append("/* cubinstore test: changed */"))
        result = matrix.build(env={"CUDA_PATH": str(changed), "CUDA_HOME": None})
        assert chosen_toolkit(matrix) == changed
    finally:
        shutil.rmtree(changed, ignore_errors=True)  # a few hundred MB

    built = result.by_label()
    assert set(built) == set(matrix.baseline.by_label())
    # transpose declares libcu++, axpy only the core headers.
    assert result.misses() == {label for label in built if label.startswith(TRANSPOSE)}, f"log: {result.log}"
    assert result.hits() == {label for label in built if label.startswith(AXPY)}, f"log: {result.log}"
