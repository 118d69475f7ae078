"""Fixtures of the Bazel-side tests: the tools, and the workspace copies shared by a session.

Expensive state is built once per session:
- `matrix`: a copy whose disk cache is seeded by a cold build of MATRIX_TARGETS (nothing
  else ever written to it), for tests that must see misses;
- `checkouts`: two copies at paths of different depth with their own output bases (each
  plays "CI" or "production"), whose shared disk cache may start from the developer's
  default disk cache, for tests that assert only on hits.
Every Bazel server started here is shut down at the end of the session.

Missing tools skip these tests with the reason; set CUBINSTORE_REQUIRE_BAZEL_TESTS=1 (CI)
to make a missing tool a failure instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from ._workspace import (
    ALL_TARGETS,
    MATRIX_TARGETS,
    BuildResult,
    Workspace,
    find_bazel,
    find_bazel7,
    find_toolkit,
    find_venv,
    seed_disk_cache,
    sid_root,
    sid_toolkit,
)

REQUIRE_ENV = "CUBINSTORE_REQUIRE_BAZEL_TESTS"


def unavailable(reason: str) -> NoReturn:
    """Skips the test, or fails it where the tools are required (CI)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class Tools:
    bazel: Path
    toolkit: Path
    venv: Path  # holds the nvidia-cutlass wheel; copies link it as .venv


@pytest.fixture(scope="session")
def bazel_tools() -> Tools:
    bazel = find_bazel()
    if bazel is None:
        unavailable("Bazel not found: no node_modules/.bin/bazelisk, bazelisk or bazel on PATH")
    if shutil.which("git") is None:
        unavailable("git not found: the workspace copies are made from `git ls-files`")
    toolkit = find_toolkit()
    if toolkit is None:
        unavailable("no CUDA toolkit (nvcc and cicc) in $CUDA_PATH, $CUDA_HOME, /usr/local/cuda or on PATH")
    venv = find_venv()
    if venv is None:
        unavailable("no virtualenv with the nvidia-cutlass wheel (run tools/bootstrap.sh)")
    return Tools(bazel=bazel, toolkit=toolkit, venv=venv)


@dataclass
class Matrix:
    """A workspace copy whose disk cache holds exactly the baseline build of MATRIX_TARGETS."""

    ws: Workspace
    disk_cache: Path
    baseline: BuildResult
    toolkit: Path  # the CUDA toolkit root the baseline used
    cutlass_include: Path  # the CUTLASS include directory the baseline used (the wheel's)

    def build(self, targets: Sequence[str] = MATRIX_TARGETS, *, env: Mapping[str, str | None] | None = None,
              flags: Sequence[str] = ()) -> BuildResult:
        """A clean build against the baseline's disk cache."""
        return self.ws.build(targets, disk_cache=self.disk_cache, env=env, flags=flags)


@pytest.fixture(scope="session")
def matrix(bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    base = tmp_path_factory.mktemp("matrix")
    ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    disk_cache = base / "disk_cache"
    disk_cache.mkdir()
    try:
        baseline = ws.build(MATRIX_TARGETS, disk_cache=disk_cache)
        if not baseline.by_label() or baseline.hits():
            raise AssertionError(f"the matrix seed must be a cold build of some instantiations; got "
                                 f"{len(baseline.hits())} hits, {len(baseline.misses())} misses")
        # Read now: tests later point these repositories elsewhere.
        nvcc = os.readlink(ws.output_base / "external" / "local_cuda" / "bin" / "nvcc")
        cutlass = (ws.output_base / "external" / "cutlass" / "include").resolve()
        yield Matrix(ws=ws, disk_cache=disk_cache, baseline=baseline, toolkit=Path(nvcc).parent.parent,
                     cutlass_include=cutlass)
    finally:
        ws.shutdown()


@dataclass
class Checkouts:
    """Two copies at paths of different depth, each with its own output base."""

    shallow: Workspace
    deep: Workspace
    disk_cache: Path
    seeded_from_developer_cache: bool
    _seed: BuildResult | None = None

    def seed(self) -> BuildResult:
        """The shallow checkout's build of //kernels:all into the shared disk cache (once)."""
        if self._seed is None:
            self._seed = self.shallow.build(ALL_TARGETS, disk_cache=self.disk_cache)
        return self._seed


@pytest.fixture(scope="session")
def checkouts(bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkouts]:
    base = tmp_path_factory.mktemp("checkouts")
    shallow = Workspace.create(base / "a" / "cubinstore", base / "output_base_shallow",
                               bazel_tools.bazel, bazel_tools.venv)
    deep = Workspace.create(base / "b" / "srv" / "releases" / "current" / "cubinstore",
                            base / "output_base_deep", bazel_tools.bazel, bazel_tools.venv)
    disk_cache = base / "disk_cache"
    # Only the second (relocated) build is asserted on, so the seed may start warm.
    seeded = seed_disk_cache(disk_cache)
    try:
        yield Checkouts(shallow=shallow, deep=deep, disk_cache=disk_cache, seeded_from_developer_cache=seeded)
    finally:
        shallow.shutdown()
        deep.shutdown()


# -- Bazel 7 ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bazel7Tools:
    bazel: Path  # tools/bazel7
    root: Path  # the sid root it runs in
    toolkit: Path  # the root's CUDA 13.5 toolkit, as a path on this host


@pytest.fixture(scope="session")
def bazel7_tools(bazel_tools: Tools) -> Bazel7Tools:
    bazel = find_bazel7()
    if bazel is None:
        unavailable(f"no Bazel 7 root at {sid_root()} (run tools/bootstrap_bazel7.sh)")
    return Bazel7Tools(bazel=bazel, root=sid_root(), toolkit=sid_toolkit())


@dataclass
class Checkouts7:
    """Two Bazel 7 copies at paths of different depth, each with its own output base and
    without WORKSPACE (MODULE.bazel alone defines the external repositories), sharing a disk
    cache that starts empty."""

    shallow: Workspace
    deep: Workspace
    disk_cache: Path
    _seed: BuildResult | None = None

    def seed(self) -> BuildResult:
        """The shallow checkout's cold build of //kernels:all into the shared disk cache (once)."""
        if self._seed is None:
            self._seed = self.shallow.build(ALL_TARGETS, disk_cache=self.disk_cache)
        return self._seed


@pytest.fixture(scope="session")
def checkouts7(bazel7_tools: Bazel7Tools, bazel_tools: Tools,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checkouts7]:
    base = tmp_path_factory.mktemp("checkouts7")
    shallow = Workspace.create(base / "a" / "cubinstore", base / "output_base_shallow",
                               bazel7_tools.bazel, bazel_tools.venv, bzlmod=True)
    deep = Workspace.create(base / "b" / "srv" / "releases" / "current" / "cubinstore",
                            base / "output_base_deep", bazel7_tools.bazel, bazel_tools.venv, bzlmod=True)
    for ws in (shallow, deep):
        (ws.root / "WORKSPACE").unlink()
    disk_cache = base / "disk_cache"
    disk_cache.mkdir()
    try:
        yield Checkouts7(shallow=shallow, deep=deep, disk_cache=disk_cache)
    finally:
        shallow.shutdown()
        deep.shutdown()
