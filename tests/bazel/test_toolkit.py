"""The CUDA toolkit as an input: its content, not its install path, is part of every key; the
repository rule looks for it in a documented order and says what it tried when it finds none.

Search order (third_party/cuda/cuda_toolkit.bzl): $CUDA_PATH, $CUDA_HOME, /usr/local/cuda,
the toolkit of nvcc on $PATH; the first holding bin/nvcc and nvvm/bin/cicc wins.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._workspace import BazelError, append, replace_with_copy
from .conftest import Matrix

pytestmark = pytest.mark.bazel

# What nvcc reads to make a CUBIN; the rest of the toolkit (libraries) is not needed to build.
TOOLKIT_PARTS = ("bin", "nvvm", "include")


def copy_toolkit(source: Path, dest: Path) -> Path:
    for part in TOOLKIT_PARTS:
        shutil.copytree(source / part, dest / part, symlinks=True)
    return dest


def chosen_toolkit(matrix: Matrix) -> Path:
    """The toolkit root @local_cuda was last made from."""
    nvcc = os.readlink(matrix.ws.output_base / "external" / "local_cuda" / "bin" / "nvcc")
    return Path(nvcc).parent.parent


@pytest.fixture(scope="module")
def toolkit_copy(matrix: Matrix, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The baseline's toolkit, copied to another path (a different depth, a different name)."""
    base = tmp_path_factory.mktemp("toolkit")
    yield copy_toolkit(matrix.toolkit, base / "opt" / "cuda-copy").resolve()
    shutil.rmtree(base, ignore_errors=True)  # a few hundred MB


def test_toolkit_copied_to_another_path_hits_for_every_instantiation(matrix: Matrix, toolkit_copy: Path) -> None:
    result = matrix.build(env={"CUDA_PATH": str(toolkit_copy), "CUDA_HOME": None})

    assert chosen_toolkit(matrix) == toolkit_copy
    assert set(result.by_label()) == set(matrix.baseline.by_label())
    assert result.misses() == set(), f"log: {result.log}"


def test_toolkit_copy_with_one_header_changed_misses_for_every_instantiation(
        matrix: Matrix, tmp_path: Path) -> None:
    changed = copy_toolkit(matrix.toolkit, tmp_path / "cuda-changed").resolve()
    try:
        # A header nvcc force-includes into every translation unit.
        replace_with_copy(changed / "include" / "cuda_runtime.h", append("/* cubinstore test: changed */"))
        result = matrix.build(env={"CUDA_PATH": str(changed), "CUDA_HOME": None})
        assert chosen_toolkit(matrix) == changed
    finally:
        shutil.rmtree(changed, ignore_errors=True)  # a few hundred MB

    assert set(result.by_label()) == set(matrix.baseline.by_label())
    assert result.hits() == set(), f"log: {result.log}"


# -- search order ------------------------------------------------------------------------------------

def test_cuda_path_comes_before_cuda_home(matrix: Matrix, toolkit_copy: Path) -> None:
    matrix.ws.fetch_repository("local_cuda", env={"CUDA_PATH": str(toolkit_copy), "CUDA_HOME": str(matrix.toolkit)})
    assert chosen_toolkit(matrix) == toolkit_copy


def test_cuda_home_comes_before_the_default_location(matrix: Matrix, toolkit_copy: Path) -> None:
    matrix.ws.fetch_repository("local_cuda", env={"CUDA_PATH": None, "CUDA_HOME": str(toolkit_copy)})
    assert chosen_toolkit(matrix) == toolkit_copy


def test_cuda_path_without_a_toolkit_is_skipped_for_the_next_candidate(
        matrix: Matrix, toolkit_copy: Path, tmp_path: Path) -> None:
    not_a_toolkit = tmp_path / "not-a-toolkit"
    (not_a_toolkit / "bin").mkdir(parents=True)
    matrix.ws.fetch_repository("local_cuda", env={"CUDA_PATH": str(not_a_toolkit), "CUDA_HOME": str(toolkit_copy)})
    assert chosen_toolkit(matrix) == toolkit_copy


def _mount_namespace() -> list[str] | None:
    """An `unshare` prefix giving a private mount namespace, or None if this machine refuses one."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    prefix = [unshare, *user, "--mount", "--propagation", "private"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


def test_no_toolkit_anywhere_fails_naming_every_candidate_in_search_order(
        matrix: Matrix, tmp_path: Path) -> None:
    # /usr/local/cuda exists on a build machine: hide it in a private mount namespace.
    namespace = _mount_namespace()
    if namespace is None:
        pytest.skip("no private mount namespace (unshare) to hide /usr/local/cuda in")
    not_a_toolkit = tmp_path / "not-a-toolkit"
    not_a_toolkit.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    env = matrix.ws.env({"CUDA_PATH": str(not_a_toolkit), "CUDA_HOME": None})
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip(f"nvcc is on the PATH Bazel gets ({env['PATH']}): a toolkit is always found")
    hide = 'if [ -e /usr/local/cuda ]; then mount --bind "$1" /usr/local/cuda; fi; shift; exec "$@"'
    # --batch: no server outlives the namespace.
    bazel = [str(matrix.ws.bazel), f"--output_base={tmp_path / 'output_base'}", "--nohome_rc", "--batch",
             "query", "--color=no", "@local_cuda//:all"]
    proc = subprocess.run([*namespace, "sh", "-c", hide, "sh", str(empty), *bazel], cwd=matrix.ws.root,
                          env=env, capture_output=True, text=True, timeout=600)

    assert proc.returncode != 0
    error = BazelError(bazel, matrix.ws.root, proc.returncode, proc.stdout + proc.stderr)
    assert error.fail_message() == (
        "cuda_toolkit: no CUDA toolkit found. Tried, in order: "
        f"{not_a_toolkit} from $CUDA_PATH (no bin/nvcc and nvvm/bin/cicc); "
        "$CUDA_HOME (unset); "
        "/usr/local/cuda from default location (no bin/nvcc and nvvm/bin/cicc); "
        "nvcc on $PATH (not found). "
        "Set CUDA_PATH to the toolkit's root."
    ), error.output


# -- host compiler -------------------------------------------------------------------------------------

def test_host_compiler_missing_from_the_action_path_fails_naming_it(matrix: Matrix) -> None:
    with pytest.raises(BazelError) as caught:
        matrix.ws.fetch_repository("local_cuda", env={"CUBINSTORE_HOST_CC": "no-such-cc"})
    assert caught.value.fail_message() == (
        "cuda_toolkit: host compiler 'no-such-cc' (CUBINSTORE_HOST_CC) not found on /usr/bin:/bin")


def test_host_compiler_given_as_a_path_is_refused(matrix: Matrix) -> None:
    with pytest.raises(BazelError) as caught:
        matrix.ws.fetch_repository("local_cuda", env={"CUBINSTORE_HOST_CC": "/usr/bin/gcc"})
    assert caught.value.fail_message() == (
        "cuda_toolkit: CUBINSTORE_HOST_CC must be a command name on /usr/bin:/bin, got '/usr/bin/gcc'")
