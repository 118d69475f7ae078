"""Sensitivity matrix of the CubinCompile key: each input that must matter makes exactly the
instantiations that depend on it miss the cache, and every other instantiation hit it; a
change to something no instantiation depends on misses nothing.

Every case changes the matrix copy, cleans and rebuilds MATRIX_TARGETS against the disk cache
that holds only the baseline build (so any hit is a baseline key and any miss a new key), and
reads hits and misses per target from the execution log. The copy is restored afterwards.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ._workspace import COMPILE, REPO_ROOT, append, replace_once, replace_with_copy, symlink_farm
from .conftest import Matrix

pytestmark = pytest.mark.bazel

AXPY = "//kernels/axpy:"
TRANSPOSE = "//kernels/transpose:"


@dataclass
class Change:
    """What a case changes (files of the copy, repository env, flags) and whom it must touch."""

    misses: Callable[[str], bool]
    # label in the baseline -> label after the change (a renamed target, e.g. another arch)
    rename: Callable[[str], str] = lambda label: label
    edits: list[tuple[str, Callable[[str], str]]] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)


def _another_familys_header() -> str:
    """A header under kernels/ that no family of the matrix includes."""
    for path in sorted((REPO_ROOT / "kernels").glob("*/*.cuh")):
        if path.parent.name not in ("axpy", "transpose"):
            return str(path.relative_to(REPO_ROOT))
    return "kernels/unrelated/unrelated.cuh"  # none yet: a new file is just as unrelated


def _add_copt(copt: str) -> Callable[[str], str]:
    def change(text: str) -> str:
        if "copts = [" in text:
            return replace_once("copts = [", f'copts = [\n        "{copt}",')(text)
        return replace_once('    name = "axpy",\n', f'    name = "axpy",\n    copts = ["{copt}"],\n')(text)
    return change


def _changed_cute_header(tmp: Path, wheel_include: Path) -> str:
    """A symlink farm of the wheel's headers in which one CuTe header differs."""
    farm = symlink_farm(wheel_include, tmp / "cutlass_include")
    replace_with_copy(farm / "cute" / "tensor.hpp", append("// cubinstore sensitivity test: changed"))
    return str(farm)


def _case(name: str, matrix: Matrix, tmp: Path) -> Change:
    comment = "// cubinstore sensitivity test: changed"
    if name == "nothing":
        return Change(misses=lambda label: False)
    if name == "kernel_source":
        return Change(misses=lambda label: label.startswith(AXPY), edits=[("kernels/axpy/axpy.cu", append(comment))])
    if name == "kernels_header":
        return Change(misses=lambda label: label.startswith(AXPY), edits=[("kernels/axpy/axpy.cuh", append(comment))])
    if name == "cute_header":
        return Change(misses=lambda label: label.startswith(TRANSPOSE),
                      env={"CUBINSTORE_CUTLASS_INCLUDE": _changed_cute_header(tmp, matrix.cutlass_include)})
    if name == "define":
        return Change(misses=lambda label: label.startswith(TRANSPOSE),
                      edits=[("kernels/transpose/BUILD.bazel",
                              replace_once("defines = [", 'defines = [\n        "CUBINSTORE_PROBE=1",'))])
    if name == "copt":
        return Change(misses=lambda label: label.startswith(AXPY),
                      edits=[("kernels/axpy/BUILD.bazel", _add_copt("-lineinfo"))])
    if name == "arch":
        # sm_80 -> sm_86 for axpy: the sm_86 instantiations are new keys, the sm_90a ones are not.
        return Change(misses=lambda label: label.startswith(AXPY) and label.endswith("_sm_86"),
                      rename=lambda label: label[:-len("_sm_80")] + "_sm_86"
                      if label.startswith(AXPY) and label.endswith("_sm_80") else label,
                      edits=[("kernels/axpy/BUILD.bazel", replace_once('"sm_80",', '"sm_86",'))])
    if name == "host_compiler":
        if shutil.which("g++", path="/usr/bin:/bin") is None:
            pytest.skip("no g++ on /usr/bin:/bin to switch the host compiler to")
        return Change(misses=lambda label: True, flags=["--repo_env=CUBINSTORE_HOST_CC=g++"])
    if name == "unrelated":
        return Change(misses=lambda label: False,
                      edits=[("README.md", append("Edited by the sensitivity test.")),
                             ("docs/CONTRACT.md", append("Edited by the sensitivity test.")),
                             (_another_familys_header(), append(comment))])
    raise ValueError(f"unknown case '{name}'")


@contextlib.contextmanager
def _applied(matrix: Matrix, change: Change) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for relpath, edit in change.edits:
            stack.enter_context(matrix.ws.edit(relpath, edit))
        yield


CASES = ["nothing", "kernel_source", "kernels_header", "cute_header", "define", "copt", "arch",
         "host_compiler", "unrelated"]


@pytest.mark.parametrize("case", CASES)
def test_change_misses_exactly_the_instantiations_that_depend_on_it(
        case: str, matrix: Matrix, tmp_path: Path) -> None:
    change = _case(case, matrix, tmp_path)
    with _applied(matrix, change):
        result = matrix.build(env=change.env, flags=change.flags)

    baseline = set(matrix.baseline.by_label())
    expected = {change.rename(label) for label in baseline}
    built = result.by_label()
    assert set(built) == expected, f"instantiations built differ from the baseline's (log: {result.log})"
    expected_misses = {label for label in expected if change.misses(label)}
    if case not in ("nothing", "unrelated"):
        assert expected_misses, f"case '{case}' selects no instantiation: the test would prove nothing"
    assert result.misses() == expected_misses, f"log: {result.log}"
    assert result.hits() == expected - expected_misses, f"log: {result.log}"


def test_every_compile_takes_the_host_compiler_identity_and_toolkit_as_inputs(matrix: Matrix) -> None:
    # The host compiler is not an input itself (it lives outside the workspace): its identity
    # file stands for it, so every compile must read it; likewise nvcc and the toolkit headers.
    required = {"external/local_cuda/host_compiler.id", "external/local_cuda/bin/nvcc",
                "external/local_cuda/nvvm/bin/cicc", "external/local_cuda/include/cuda_runtime.h"}
    compiles = [s for s in matrix.baseline.spawns if s.mnemonic == COMPILE]
    assert compiles
    for spawn in compiles:
        assert required - set(spawn.inputs) == set(), spawn.label
