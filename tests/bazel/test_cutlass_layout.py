"""CUTLASS/CuTe headers are content-hashed inputs: the pinned wheel's include directory, a copy
of it, a symlink farm of it and a symlink to it (via $CUBINSTORE_CUTLASS_INCLUDE) all give the
keys of the baseline (which found the wheel through the checkout's .venv). A directory that is
not the pinned CUTLASS is refused by name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ._workspace import BazelError, replace_once, replace_with_copy, symlink_farm
from .conftest import Matrix

pytestmark = pytest.mark.bazel

TRANSPOSE = "//kernels/transpose:"  # the family that includes CuTe


def _layout(name: str, wheel: Path, tmp: Path) -> Path:
    if name == "wheel_directory":
        return wheel
    if name == "copy":
        return Path(shutil.copytree(wheel, tmp / "copy" / "include"))
    if name == "symlink_farm":
        return symlink_farm(wheel, tmp / "farm" / "include")
    if name == "directory_symlink":
        link = tmp / "link" / "include"
        link.parent.mkdir(parents=True)
        link.symlink_to(wheel, target_is_directory=True)
        return link
    raise ValueError(f"unknown layout '{name}'")


@pytest.mark.parametrize("layout", ["wheel_directory", "copy", "symlink_farm", "directory_symlink"])
def test_cutlass_header_layout_gives_the_baseline_keys(layout: str, matrix: Matrix, tmp_path: Path) -> None:
    include = _layout(layout, matrix.cutlass_include, tmp_path)
    result = matrix.build((TRANSPOSE + "all",), env={"CUBINSTORE_CUTLASS_INCLUDE": str(include)})

    # The repository was made from this layout, not from the .venv the baseline used.
    assert os.readlink(matrix.ws.output_base / "external" / "cutlass" / "include") == str(include)
    transpose = {label for label in matrix.baseline.by_label() if label.startswith(TRANSPOSE)}
    assert transpose and set(result.by_label()) == transpose
    assert result.misses() == set(), f"log: {result.log}"


def test_include_directory_without_cutlass_headers_is_refused(matrix: Matrix, tmp_path: Path) -> None:
    with pytest.raises(BazelError) as caught:
        matrix.ws.fetch_repository("cutlass", env={"CUBINSTORE_CUTLASS_INCLUDE": str(tmp_path)})
    assert caught.value.fail_message() == (
        f"cutlass_headers: $CUBINSTORE_CUTLASS_INCLUDE='{tmp_path}' holds no cute/tensor.hpp and cutlass/version.h")


def test_cutlass_of_another_version_is_refused(matrix: Matrix, tmp_path: Path) -> None:
    farm = symlink_farm(matrix.cutlass_include, tmp_path / "include")
    replace_with_copy(farm / "cutlass" / "version.h",
                      replace_once("#define CUTLASS_MINOR 2", "#define CUTLASS_MINOR 1"))
    with pytest.raises(BazelError) as caught:
        matrix.ws.fetch_repository("cutlass", env={"CUBINSTORE_CUTLASS_INCLUDE": str(farm)})
    assert caught.value.fail_message() == (
        f"cutlass_headers: {farm}/cutlass/version.h is CUTLASS 4.1, expected 4.2 (nvidia-cutlass==4.2.0.0)")
