"""Bazel 7 through MODULE.bazel (bzlmod, no WORKSPACE): the kernels build, their manifest is
byte-identical to Bazel 4.2.3's with the same toolkit, and the properties the Bazel 4.2.3 tests
prove hold here too, on the smallest family that shows each (axpy): relocation, the action
key's sensitivity, no machine path in an action, and the nginx and BuildGrid caches.

Bazel 7 runs in the Debian sid root of tools/bootstrap_bazel7.sh (tools/bazel7), with that
root's CUDA 13.5 and gcc-14.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ._servers import BuildGridCache, NginxCache
from ._workspace import (
    ALL_TARGETS,
    COMPILE,
    MANIFEST,
    PTX_COMPILE,
    BuildResult,
    Workspace,
    append,
    compiled_targets,
    find_bgd,
    find_nginx,
    replace_once,
)
from .conftest import Bazel7Tools, Checkouts7, Tools, unavailable

pytestmark = pytest.mark.bazel

AXPY = ("//kernels/axpy:all",)
AXPY_PREFIX = "//kernels/axpy:"


@pytest.fixture(scope="module")
def seed(checkouts7: Checkouts7) -> BuildResult:
    return checkouts7.seed()


def test_bazel7_builds_every_kernel_through_module_bazel_alone(checkouts7: Checkouts7, seed: BuildResult) -> None:
    assert not (checkouts7.shallow.root / "WORKSPACE").exists()
    instantiations = compiled_targets(seed.manifest_json())
    assert instantiations and set(seed.by_label()) == instantiations
    assert set(seed.by_label(PTX_COMPILE)) == compiled_targets(seed.manifest_json(), PTX_COMPILE)
    assert seed.hits() == set(), f"the seed must be cold (log: {seed.log})"
    # nvcc comes from the repository MODULE.bazel's use_repo_rule made, not from WORKSPACE.
    nvcc = {s.program for s in seed.spawns if s.mnemonic == COMPILE}
    assert nvcc == {"external/_main~_repo_rules~local_cuda/bin/nvcc"}


def test_bazel7_manifest_is_byte_identical_to_bazel_4s_with_the_same_toolkit(
        seed: BuildResult, bazel_tools: Tools, bazel7_tools: Bazel7Tools,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Bazel 4.2.3 on this host, through WORKSPACE, with the sid root's CUDA 13.5 (the host
    # compiler differs: gcc-12 here, gcc-14 there; it only preprocesses).
    base = tmp_path_factory.mktemp("bazel4_same_toolkit")
    ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    try:
        bazel4 = ws.build(ALL_TARGETS, disk_cache=None, env={"CUDA_PATH": str(bazel7_tools.toolkit)})
    finally:
        ws.shutdown()
    assert bazel4.misses() == set(bazel4.by_label()), "the Bazel 4.2.3 build must compile everything itself"
    assert bazel4.manifest is not None and bazel4.manifest == seed.manifest


def test_bazel7_relocated_checkout_takes_every_compile_from_the_disk_cache(
        checkouts7: Checkouts7, seed: BuildResult) -> None:
    relocated = checkouts7.deep.build(ALL_TARGETS, disk_cache=checkouts7.disk_cache)
    assert set(relocated.by_label()) == set(seed.by_label())
    assert relocated.misses() == set(), f"recompiled after relocation (log: {relocated.log})"
    assert relocated.by_label(MANIFEST) == {"//kernels:manifest": True}
    assert relocated.manifest == seed.manifest


# -- no machine path in an action -----------------------------------------------------------------

def _forms(path: Path | str) -> set[str]:
    return {str(path), os.path.realpath(path)}


def test_bazel7_cubin_compile_actions_name_no_machine_path(
        checkouts7: Checkouts7, bazel7_tools: Bazel7Tools) -> None:
    ws = checkouts7.shallow
    graph = ws.aquery(f'mnemonic("{COMPILE}", deps(//kernels/axpy:all))')
    actions = graph.get("actions", [])
    assert len(actions) == 8, f"expected the 8 axpy compiles, got {len(actions)}"
    machine = (_forms(ws.root) | _forms(ws.output_base) | _forms(bazel7_tools.root)
               | _forms(ws.env()["HOME"]) | {"/opt/cubinstore", str(bazel7_tools.toolkit)})
    for action in actions:
        env = {e["key"]: e.get("value", "") for e in action.get("environmentVariables", [])}
        assert env == {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
        for arg in action["arguments"]:
            assert not arg.split("=", 1)[-1].startswith("/"), f"absolute argument '{arg}'"
            assert not any(form in arg for form in machine if len(form) > 1), f"machine path in '{arg}'"


# -- the key's sensitivity, on axpy -------------------------------------------------------------------

@dataclass
class Matrix7:
    ws: Workspace
    disk_cache: Path
    baseline: BuildResult


@pytest.fixture(scope="module")
def matrix7(checkouts7: Checkouts7, tmp_path_factory: pytest.TempPathFactory) -> Matrix7:
    disk_cache = tmp_path_factory.mktemp("matrix7_disk_cache")
    baseline = checkouts7.shallow.build(AXPY, disk_cache=disk_cache)
    assert len(baseline.misses()) == 8 and baseline.hits() == set(), f"log: {baseline.log}"
    return Matrix7(ws=checkouts7.shallow, disk_cache=disk_cache, baseline=baseline)


@dataclass
class Case:
    all_miss: bool
    edits: list[tuple[str, Callable[[str], str]]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)


COMMENT = "// cubinstore Bazel 7 sensitivity test: changed"
CASES = {
    "nothing": Case(all_miss=False),
    "kernel_source": Case(all_miss=True, edits=[("kernels/axpy/axpy.cu", append(COMMENT))]),
    "copt": Case(all_miss=True, edits=[("kernels/axpy/BUILD.bazel",
                                        replace_once('    name = "axpy",\n', '    name = "axpy",\n    copts = ["-lineinfo"],\n'))]),
    "host_compiler": Case(all_miss=True, flags=["--repo_env=CUBINSTORE_HOST_CC=g++-14"]),
    "unrelated": Case(all_miss=False, edits=[("README.md", append("Edited by the Bazel 7 sensitivity test.")),
                                             ("kernels/transpose/BUILD.bazel", append("# edited"))]),
}


@contextlib.contextmanager
def _edited(ws: Workspace, edits: list[tuple[str, Callable[[str], str]]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for relpath, edit in edits:
            stack.enter_context(ws.edit(relpath, edit))
        yield


@pytest.mark.parametrize("case", sorted(CASES))
def test_bazel7_change_misses_exactly_what_depends_on_it(case: str, matrix7: Matrix7) -> None:
    change = CASES[case]
    with _edited(matrix7.ws, change.edits):
        result = matrix7.ws.build(AXPY, disk_cache=matrix7.disk_cache, flags=change.flags)
    expected = set(matrix7.baseline.by_label())
    assert set(result.by_label()) == expected
    assert result.misses() == (expected if change.all_miss else set()), f"log: {result.log}"



# -- the nginx and BuildGrid caches, on axpy ---------------------------------------------------------

def _cubins(ws: Workspace, result: BuildResult) -> dict[str, bytes]:
    """label -> CUBIN bytes of the compiles a build ran or took from a cache."""
    out = {}
    for label in result.by_label():
        package, name = label[2:].split(":")
        out[label] = (ws.root / "bazel-bin" / package / f"{name}.cubin").read_bytes()
    return out


@pytest.fixture(scope="module")
def nginx_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxCache]:
    nginx = find_nginx()
    if nginx is None:
        unavailable("nginx not found (tools/bootstrap.sh installs nginx-light)")
    server = NginxCache(tmp_path_factory.mktemp("nginx_cache7"), nginx)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def buildgrid_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuildGridCache]:
    bgd = find_bgd()
    if bgd is None:
        unavailable("BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    server = BuildGridCache(tmp_path_factory.mktemp("buildgrid_cache7"), bgd)
    server.start()
    yield server
    server.stop()


def test_bazel7_ci_uploads_to_nginx_and_production_elsewhere_builds_nothing(
        checkouts7: Checkouts7, nginx_cache: NginxCache) -> None:
    ci = checkouts7.shallow.build(AXPY, disk_cache=None, flags=["--config=ci", f"--remote_cache={nginx_cache.url}"])
    assert len(ci.misses()) == 8 and ci.hits() == set(), f"log: {ci.log}"
    for label, data in _cubins(checkouts7.shallow, ci).items():
        stored = nginx_cache.blob(hashlib.sha256(data).hexdigest())
        assert stored.is_file() and stored.read_bytes() == data, f"{label} was never uploaded"
    puts = nginx_cache.requests("PUT")
    production = checkouts7.deep.build(AXPY, disk_cache=None,
                                       flags=["--config=readonly", f"--remote_cache={nginx_cache.url}"])
    assert set(production.by_label()) == set(ci.by_label())
    assert production.misses() == set(), f"production recompiled (log: {production.log})"
    assert nginx_cache.requests("PUT") == puts, "--config=readonly uploaded to the cache"
    assert _cubins(checkouts7.deep, production) == _cubins(checkouts7.shallow, ci)


def test_bazel7_ci_uploads_to_buildgrid_and_production_elsewhere_builds_nothing(
        checkouts7: Checkouts7, buildgrid_cache: BuildGridCache, tmp_path: Path) -> None:
    ci = checkouts7.deep.build(AXPY, disk_cache=None, flags=["--config=ci", f"--remote_cache={buildgrid_cache.url}"])
    assert len(ci.misses()) == 8 and ci.hits() == set(), f"log: {ci.log}"
    cubins = _cubins(checkouts7.deep, ci)
    blobs = {hashlib.sha256(data).hexdigest(): len(data) for data in cubins.values()}
    fetched = buildgrid_cache.download(blobs, tmp_path / "fetched")
    assert sorted(fetched.values()) == sorted(cubins.values())
    production = checkouts7.shallow.build(AXPY, disk_cache=None,
                                          flags=["--config=readonly", f"--remote_cache={buildgrid_cache.url}"])
    assert set(production.by_label()) == set(ci.by_label())
    assert production.misses() == set(), f"production recompiled (log: {production.log})"
