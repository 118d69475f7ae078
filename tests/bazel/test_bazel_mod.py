"""`bazel mod` under Bazel 7 in cubinstore and in examples/consumer: the module graph, the
direct dependencies and a repository's definition, resolved through the offline stub registry
(third_party/registry) with no network.

Bazel 7's own `@bazel_tools` module uses the buildozer module's `buildozer_binary` extension, so
every `bazel mod` command loads `@buildozer//:buildozer_binary.bzl`: the stub must be a package
with that extension, not a bare MODULE.bazel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._workspace import Workspace, copy_workspace
from .conftest import Bazel7Tools, Tools

pytestmark = pytest.mark.bazel

CONSUMER = Path("examples") / "consumer"


@dataclass
class ModCopies:
    cubinstore: Workspace
    consumer: Workspace


@pytest.fixture(scope="module")
def copies(bazel7_tools: Bazel7Tools, bazel_tools: Tools,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModCopies]:
    base = tmp_path_factory.mktemp("bazel_mod")
    checkout = copy_workspace(base / "checkout" / "cubinstore", venv=bazel_tools.venv)
    (checkout / "WORKSPACE").unlink()  # MODULE.bazel alone, as a Bazel 7 user has it
    cubinstore = Workspace(root=checkout, output_base=base / "output_base_cubinstore",
                           bazel=bazel7_tools.bazel, bzlmod=True)
    consumer = Workspace(root=checkout / CONSUMER, output_base=base / "output_base_consumer",
                         bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        yield ModCopies(cubinstore=cubinstore, consumer=consumer)
    finally:
        cubinstore.shutdown()
        consumer.shutdown()


def _mod(ws: Workspace, *args: str) -> str:
    """`bazel mod ARGS` in `ws` (Workspace.run raises, with the output, on a non-zero exit)."""
    return ws.run("mod", ["--color=no", "--curses=no", *args]).stdout


def test_mod_graph_in_cubinstore_names_its_deps_and_repositories(copies: ModCopies) -> None:
    graph = _mod(copies.cubinstore, "graph", "--extension_info=all")
    lines = graph.splitlines()
    assert lines[0] == "<root> (cubinstore@0.1.0)", graph
    assert "bazel_skylib@" in graph, graph
    # The repositories MODULE.bazel's use_repo_rule makes.
    assert {"cutlass", "local_cuda"} <= {line.split("─")[-1].strip() for line in lines}, graph


def test_mod_deps_in_cubinstore_lists_its_direct_deps(copies: ModCopies) -> None:
    plain = _mod(copies.cubinstore, "deps")
    assert plain.startswith("<root> (cubinstore@0.1.0)"), plain
    deps = _mod(copies.cubinstore, "deps", "bazel_skylib")
    assert "bazel_skylib@" in deps and "platforms@" in deps, deps


def test_mod_show_repo_in_cubinstore_shows_its_repository_rules(copies: ModCopies) -> None:
    # `show_repo cubinstore` names the main repository there, which Bazel does not show
    # ("no such repo"); its external repositories are what a user inspects.
    shown = _mod(copies.cubinstore, "show_repo", "@local_cuda", "@cutlass")
    assert "cuda_toolkit(" in shown and 'name = "_main~_repo_rules~local_cuda"' in shown, shown
    assert "cutlass_headers(" in shown and 'name = "_main~_repo_rules~cutlass"' in shown, shown


def test_mod_graph_in_the_consumer_names_cubinstore_and_its_repositories(copies: ModCopies) -> None:
    graph = _mod(copies.consumer, "graph", "--extension_info=all")
    lines = [line.split("─")[-1].strip() for line in graph.splitlines()]
    assert lines[0].startswith("<root> (cubinstore_example@"), graph
    assert "cubinstore@_" in lines, graph
    assert {"cutlass", "local_cuda"} <= set(lines), graph
    deps = _mod(copies.consumer, "deps", "cubinstore")
    assert "cubinstore@_" in deps, deps


def test_mod_show_repo_cubinstore_in_the_consumer(copies: ModCopies) -> None:
    shown = _mod(copies.consumer, "show_repo", "cubinstore")
    assert shown.startswith("## cubinstore@"), shown
    assert 'name = "cubinstore~"' in shown, shown
