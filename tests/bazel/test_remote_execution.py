"""Remote execution on a real REAPI cluster started here on loopback: PostgreSQL, BuildGrid
(Execution, Bots, CAS, action cache over an SQL scheduler) and one buildbox worker (casd +
worker) whose root is the Debian sid root alone: no /usr/local/cuda, no workspace, no home
directory of this host. `--config=rbe` builds //kernels:all with every action run remotely,
so a green build proves every input of every action is declared.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._servers import BuildboxWorker, BuildGridExecution, PostgreSQL, find_postgres, in_worker_root
from ._workspace import (
    ALL_TARGETS, COMPILE, MANIFEST, PTX_COMPILE, REPO_ROOT, BuildResult, Workspace, compiled_targets, copy_workspace,
    find_bgd,
)
from .conftest import Bazel7Tools, Checkouts7, Tools, unavailable

pytestmark = pytest.mark.bazel


@dataclass
class Cluster:
    database: PostgreSQL
    server: BuildGridExecution
    worker: BuildboxWorker

    @property
    def flags(self) -> list[str]:
        return ["--config=rbe", f"--remote_executor={self.server.url}"]


@pytest.fixture(scope="module")
def cluster(bazel7_tools: Bazel7Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    bgd = find_bgd()
    if bgd is None:
        unavailable("BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    postgres = find_postgres()
    if postgres is None:
        unavailable("PostgreSQL not found (tools/bootstrap_bazel7.sh installs it)")
    base = tmp_path_factory.mktemp("rbe")
    # Outside pytest's root-only temporary tree: the cluster belongs to the postgres user.
    pgdir = Path(tempfile.mkdtemp(prefix="cubinstore-pg-"))
    database = PostgreSQL(pgdir, postgres)
    server = BuildGridExecution(base / "buildgrid", bgd, database.url)
    worker = BuildboxWorker(base / "worker", bazel7_tools.root, 0)
    try:
        database.start()
        server.database_url = database.url
        server.start()
        worker.server = f"http://127.0.0.1:{server.port}"
        worker.start()
        yield Cluster(database=database, server=server, worker=worker)
    finally:
        worker.stop()
        server.stop()
        database.stop()
        shutil.rmtree(pgdir, ignore_errors=True)


def test_worker_sees_neither_toolkit_nor_workspace_nor_home(
        cluster: Cluster, checkouts7: Checkouts7, bazel_tools: Tools) -> None:
    # Files, not directories: tools/bazel7 leaves empty mount points (e.g. the checkout's
    # path) in the sid root, which hold nothing outside its own namespace.
    hidden = ["/usr/local/cuda/bin/nvcc", str(bazel_tools.toolkit / "bin" / "nvcc"), str(REPO_ROOT / "MODULE.bazel"),
              str(checkouts7.shallow.root / "MODULE.bazel"), str(Path.home() / ".cache" / "cubinstore"),
              str(checkouts7.shallow.output_base)]
    # What the worker does need is there (so a missing path is a real absence, not a broken probe).
    needed = ["/usr/bin/gcc-14", "/usr/bin/python3", "/worker/cache"]
    script = 'for p in "$@"; do if [ -e "$p" ]; then echo "present $p"; else echo "absent $p"; fi; done'
    argv = in_worker_root(cluster.worker.root, cluster.worker.workdir, ["/bin/sh", "-c", script, "probe", *hidden, *needed])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert out == [f"absent {p}" for p in hidden] + [f"present {p}" for p in needed]


@pytest.fixture(scope="module")
def remote(cluster: Cluster, checkouts7: Checkouts7) -> BuildResult:
    # No disk cache: every action must go to the cluster.
    return checkouts7.shallow.build(ALL_TARGETS, disk_cache=None, flags=cluster.flags)


def test_rbe_executes_every_cubin_compile_remotely(remote: BuildResult, checkouts7: Checkouts7) -> None:
    compiles = [s for s in remote.spawns if s.mnemonic in (COMPILE, PTX_COMPILE)]
    instantiations = compiled_targets(remote.manifest_json()) | compiled_targets(remote.manifest_json(), PTX_COMPILE)
    assert {s.label for s in compiles} == instantiations
    assert {(s.runner, s.cache_hit) for s in compiles} == {("remote", False)}, f"log: {remote.log}"
    manifest = [s for s in remote.spawns if s.mnemonic == MANIFEST]
    assert [(s.runner, s.cache_hit) for s in manifest] == [("remote", False)]


def test_rbe_manifest_is_byte_identical_to_a_local_build(remote: BuildResult, checkouts7: Checkouts7) -> None:
    local = checkouts7.seed()
    assert {s.runner for s in local.spawns if s.mnemonic == COMPILE} == {"processwrapper-sandbox"}
    assert remote.manifest is not None and remote.manifest == local.manifest


def test_second_checkout_gets_every_action_from_the_cluster_cache(
        remote: BuildResult, cluster: Cluster, checkouts7: Checkouts7) -> None:
    again = checkouts7.deep.build(ALL_TARGETS, disk_cache=None, flags=cluster.flags)
    assert set(again.by_label()) == set(remote.by_label())
    assert again.misses() == set(), f"the second checkout executed actions (log: {again.log})"
    assert again.by_label(MANIFEST) == {"//kernels:manifest": True}
    assert again.manifest == remote.manifest


def test_a_consumer_builds_remotely_with_the_manifest_of_its_local_build(
        cluster: Cluster, bazel7_tools: Bazel7Tools, bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> None:
    # examples/consumer depends on cubinstore as a module: its manifest action runs cubinstore's tool
    # from external/cubinstore~ on the worker, where only declared inputs exist.
    base = tmp_path_factory.mktemp("consumer-rbe")
    copy_workspace(base / "checkout", venv=bazel_tools.venv)
    root = base / "checkout" / "examples" / "consumer"
    remote = Workspace(root=root, output_base=base / "output_remote", bazel=bazel7_tools.bazel, bzlmod=True)
    local = Workspace(root=root, output_base=base / "output_local", bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        built = remote.build(("//:manifest",), disk_cache=None, flags=cluster.flags)
        runs = {(s.mnemonic, s.runner, s.cache_hit) for s in built.spawns if s.mnemonic in (COMPILE, MANIFEST)}
        assert runs == {(COMPILE, "remote", False), (MANIFEST, "remote", False)}, f"log: {built.log}"
        manifest = (root / "bazel-bin" / "manifest.json").read_bytes()
        local.build(("//:manifest",), disk_cache=None)
        assert (root / "bazel-bin" / "manifest.json").read_bytes() == manifest
    finally:
        remote.shutdown()
        local.shutdown()
