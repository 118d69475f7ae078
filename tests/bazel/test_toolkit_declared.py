"""The CUDA toolkit declared in a consumer's MODULE.bazel (`cuda.toolkit` of tools/extensions.bzl),
under Bazel 7: a declared path is the toolkit every compile runs, even where $CUDA_PATH names
another; a declared version passes over toolkits of other versions; what cannot be satisfied
fails naming the module and what was tried; and cubinstore's `@local_cuda` keeps its name, so
a declaration that picks the same toolkit changes no action key.

`tools/bazel7` always exports $CUDA_PATH (the sid root's CUDA 13.5): the declared toolkit here
is a tree of links to it at another path whose `cuda_runtime.h` (nvcc force-includes it) defines
one macro more, so a compile proves which toolkit it saw."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._workspace import COMPILE, BazelError, Workspace, append, copy_workspace
from .conftest import Bazel7Tools, Tools

pytestmark = pytest.mark.bazel

CONSUMER = Path("examples") / "consumer"
MODULE = "cubinstore_example"  # examples/consumer/MODULE.bazel's module()
LOCAL_CUDA = "cubinstore~~_repo_rules~local_cuda"  # cubinstore's @local_cuda, seen from the consumer
# The parts of a toolkit nvcc -cubin reads (tests/bazel/test_toolkit.py copies the same).
TOOLKIT_PARTS = ("bin", "nvvm", "include")
MARK = "CUBINSTORE_DECLARED_TOOLKIT"

MARKED_CU = f"""\
#ifndef {MARK}
#error "compiled with a toolkit other than the one cuda.toolkit declares"
#endif
extern "C" __global__ void mark(int* p) {{ p[0] = {MARK}; }}
"""
MARKED_BUILD = """\
load("@cubinstore//tools:defs.bzl", "cubin_instantiations")

cubin_instantiations(
    name = "marked",
    srcs = ["k.cu"],
    archs = ["sm_90a"],
    entries = {"mark": ["ptr"]},
    grid = {"v": [1]},
    toolkit_headers = [],
)
"""


def _declare(**attrs: str) -> str:
    args = ", ".join(f'{k} = "{v}"' for k, v in attrs.items())
    return f'cuda = use_extension("@cubinstore//tools:extensions.bzl", "cuda")\ncuda.toolkit({args})\n'


def _link_tree(source_in_root: str, source_on_host: Path, dest: Path) -> None:
    """`dest` mirrors the toolkit's parts with real directories and one absolute link per file,
    each naming the file as Bazel 7 sees it inside the sid root (`source_in_root`)."""
    for part in TOOLKIT_PARTS:
        for dirpath, dirnames, filenames in os.walk(source_on_host / part):
            rel = Path(dirpath).relative_to(source_on_host)
            (dest / rel).mkdir(parents=True, exist_ok=True)
            linked_dirs = [name for name in dirnames if Path(dirpath, name).is_symlink()]  # not walked
            for name in filenames + linked_dirs:
                (dest / rel / name).symlink_to(f"{source_in_root}/{rel}/{name}")


def _version(toolkit: Path) -> str:
    for line in (toolkit / "include" / "cuda.h").read_text().splitlines():
        words = line.split()
        if words[:2] == ["#define", "CUDA_VERSION"]:
            number = int(words[2])
            return f"{number // 1000}.{number % 1000 // 10}"
    raise AssertionError(f"no CUDA_VERSION in {toolkit}/include/cuda.h")


@dataclass
class Declared:
    ws: Workspace  # a copy of examples/consumer with a package //marked
    toolkit: Path  # the declared toolkit: links to the sid root's, one header changed
    sid_toolkit: str  # the sid root's toolkit, as a path inside the root ($CUDA_PATH there)
    version: str  # its MAJOR.MINOR


@pytest.fixture(scope="module")
def declared(bazel7_tools: Bazel7Tools, bazel_tools: Tools,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Declared]:
    base = tmp_path_factory.mktemp("toolkit_declared")
    in_root = "/" + str(bazel7_tools.toolkit.relative_to(bazel7_tools.root))
    toolkit = base / "opt" / "cuda-declared"
    _link_tree(in_root, bazel7_tools.toolkit, toolkit)
    # The links resolve inside the root only: the changed header is written from the host's view.
    header = toolkit / "include" / "cuda_runtime.h"
    header.unlink()
    header.write_text(append(f"#define {MARK} 1")((bazel7_tools.toolkit / "include" / "cuda_runtime.h").read_text()))
    copy_workspace(base / "checkout", venv=bazel_tools.venv)
    root = base / "checkout" / CONSUMER
    (root / "marked").mkdir()
    (root / "marked" / "k.cu").write_text(MARKED_CU)
    (root / "marked" / "BUILD.bazel").write_text(MARKED_BUILD)
    ws = Workspace(root=root, output_base=base / "output_base", bazel=bazel7_tools.bazel, bzlmod=True)
    try:
        yield Declared(ws=ws, toolkit=toolkit, sid_toolkit=in_root, version=_version(bazel7_tools.toolkit))
    finally:
        ws.shutdown()


def _compile_keys(ws: Workspace, target: str = "//scale") -> dict[str, str]:
    proc = ws.run("aquery", ["--color=no", "--curses=no", "--output=jsonproto", f'mnemonic("{COMPILE}", deps({target}))'])
    graph = json.loads(proc.stdout)
    labels = {t["id"]: t["label"] for t in graph["targets"]}
    return {labels[a["targetId"]]: a["actionKey"] for a in graph["actions"]}


def _nvcc(ws: Workspace) -> str:
    return os.readlink(ws.output_base / "external" / LOCAL_CUDA / "bin" / "nvcc")


def test_a_declared_path_is_the_toolkit_every_compile_runs(declared: Declared) -> None:
    ws = declared.ws
    # Undeclared, $CUDA_PATH's toolkit lacks the mark: the source refuses to compile with it.
    with pytest.raises(BazelError) as undeclared:
        ws.build(["//marked"], disk_cache=None)
    assert "compiled with a toolkit other than the one cuda.toolkit declares" in undeclared.value.output
    assert _nvcc(ws) == f"{declared.sid_toolkit}/bin/nvcc"

    with ws.edit("MODULE.bazel", append(_declare(path=str(declared.toolkit)))):
        result = ws.build(["//marked"], disk_cache=None)
        nvcc = _nvcc(ws)
    assert result.misses() == {"//marked:marked_v1_sm_90a"}
    # The action runs cubinstore's @local_cuda, under its usual name, made from the declared path.
    (spawn,) = [s for s in result.spawns if s.mnemonic == COMPILE]
    assert spawn.program == f"external/{LOCAL_CUDA}/bin/nvcc"
    assert nvcc == f"{declared.toolkit}/bin/nvcc"
    assert (ws.root / "bazel-bin" / "marked" / "marked_v1_sm_90a.cubin").read_bytes()[:4] == b"\x7fELF"


def test_a_declared_version_that_the_search_finds_changes_no_key(declared: Declared) -> None:
    ws = declared.ws
    undeclared = _compile_keys(ws)
    assert len(undeclared) == 4, undeclared
    with ws.edit("MODULE.bazel", append(_declare(version=declared.version))):
        assert _compile_keys(ws) == undeclared
        assert _nvcc(ws) == f"{declared.sid_toolkit}/bin/nvcc"
    # The same toolkit at a declared path: its content, not its path, is in the keys.
    with ws.edit("MODULE.bazel", append(_declare(path=declared.sid_toolkit, version=declared.version))):
        assert _compile_keys(ws) == undeclared


def test_a_declared_version_no_candidate_has_fails_listing_each_with_its_version(declared: Declared) -> None:
    wanted = "12.1" if declared.version != "12.1" else "12.2"
    with declared.ws.edit("MODULE.bazel", append(_declare(version=wanted))):
        with pytest.raises(BazelError) as failed:
            declared.ws.run("query", ["--color=no", "//scale:all"])
    message = failed.value.fail_message()
    assert message.startswith(
        f"cuda_toolkit: no CUDA toolkit of version {wanted} found for cuda.toolkit in module '{MODULE}'. "
        f"Tried, in order: {declared.sid_toolkit} from $CUDA_PATH (CUDA {declared.version}, not {wanted}); "), message
    assert f"; /usr/local/cuda-{wanted} from default location of CUDA {wanted} (" in message, message
    assert message.endswith(
        f". Set CUDA_PATH to a CUDA {wanted} toolkit's root, or change cuda.toolkit in that module's MODULE.bazel."), message


def test_a_declared_path_without_a_toolkit_fails_naming_it_and_the_module(declared: Declared, tmp_path: Path) -> None:
    # No fallback to $CUDA_PATH: a declared path is the only candidate.
    with declared.ws.edit("MODULE.bazel", append(_declare(path=str(tmp_path)))):
        with pytest.raises(BazelError) as failed:
            declared.ws.run("query", ["--color=no", "//scale:all"])
    assert failed.value.fail_message() == (
        f"cuda_toolkit: no CUDA toolkit found for cuda.toolkit in module '{MODULE}'. Tried, in order: "
        f"{tmp_path} from cuda.toolkit(path) in module '{MODULE}' (no bin/nvcc and nvvm/bin/cicc). "
        "Change cuda.toolkit in that module's MODULE.bazel."), failed.value.output


@pytest.mark.parametrize("attrs, error", [
    ({"version": "13"}, "attribute 'version' must be MAJOR.MINOR (e.g. '13.0'), got '13'"),
    ({"path": "opt/cuda"}, "attribute 'path' must be an absolute path, got 'opt/cuda'"),
    ({}, "give 'path' (the toolkit's root) or 'version' (e.g. '13.0'), or both"),
])
def test_a_malformed_declaration_fails_naming_the_module_and_attribute(
        declared: Declared, attrs: dict[str, str], error: str) -> None:
    with declared.ws.edit("MODULE.bazel", append(_declare(**attrs))):
        with pytest.raises(BazelError) as failed:
            declared.ws.run("query", ["--color=no", "//scale:all"])
    assert failed.value.fail_message() == f"cuda.toolkit in module '{MODULE}': {error}", failed.value.output


def test_two_declarations_in_one_module_fail(declared: Declared) -> None:
    twice = _declare(version=declared.version) + f'cuda.toolkit(path = "{declared.toolkit}")\n'
    with declared.ws.edit("MODULE.bazel", append(twice)):
        with pytest.raises(BazelError) as failed:
            declared.ws.run("query", ["--color=no", "//scale:all"])
    assert failed.value.fail_message() == (
        f"cubinstore cuda: module '{MODULE}' declares cuda.toolkit 2 times; declare it once"), failed.value.output
