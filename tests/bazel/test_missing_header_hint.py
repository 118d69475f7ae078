"""A header missing from a compile's sandbox (left out of `hdrs`, or a CUB header outside
`toolkit_headers`) fails with a hint naming the attributes that declare headers, and the hint
changes no action key: it is the compile's progress message, which Bazel prints in front of the
failure (tools/private/actions/compile.bzl, `header_hint`) and which is no part of the key."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from ._workspace import COMPILE, BazelError, Workspace, replace_once
from .conftest import Tools

pytestmark = pytest.mark.bazel

PACKAGE = "hint_probe"
BUILD = """\
load("//tools:defs.bzl", "cuda_cubin")

[
    cuda_cubin(
        name = name,
        srcs = [src],
        hdrs = hdrs,
        arch = "sm_80",
        entries = {"probe": ["ptr"]},
        family = "probe",
        id = "probe/" + name,
        toolkit_headers = sets,
    )
    for name, src, hdrs, sets in [
        ("hdrs_missing", "own.cu", [], []),
        ("hdrs_declared", "own.cu", ["helper.cuh"], []),
        ("cub_missing", "cub.cu", [], ["libcudacxx"]),
        ("cub_declared", "cub.cu", [], ["cub"]),
    ]
]
"""
OWN_CU = f'#include "{PACKAGE}/helper.cuh"\nextern "C" __global__ void probe(int* p) {{ p[0] = HELPER; }}\n'
CUB_CU = '#include <cub/version.cuh>\nextern "C" __global__ void probe(int* p) { p[0] = CUB_VERSION; }\n'
HINTED = 'message = progress_message + " " + header_hint(ctx)'
COMPILE_BZL = "tools/private/actions/compile.bzl"


@pytest.fixture(scope="module")
def workspace(bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    base = tmp_path_factory.mktemp("missing_header_hint")
    ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    (ws.root / PACKAGE).mkdir()
    (ws.root / PACKAGE / "BUILD.bazel").write_text(BUILD)
    (ws.root / PACKAGE / "own.cu").write_text(OWN_CU)
    (ws.root / PACKAGE / "helper.cuh").write_text("#pragma once\n#define HELPER 7\n")
    (ws.root / PACKAGE / "cub.cu").write_text(CUB_CU)
    try:
        yield ws
    finally:
        ws.shutdown()


def _failure_line(output: str, target: str) -> str:
    """Bazel's `ERROR: <BUILD file>:<line>:<col>: <progress message> failed: ...` line of the failed compile."""
    lines = [line for line in output.splitlines() if line.startswith("ERROR: ") and " failed: " in line]
    assert len(lines) == 1, output[-3000:]
    assert f"probe/{target} (sm_80)" in lines[0], lines[0]
    return lines[0].split(": ", 2)[2]


@pytest.mark.parametrize("target, header, sets", [
    ("hdrs_missing", f"{PACKAGE}/helper.cuh", "core"),
    ("cub_missing", "cub/version.cuh", "core + libcudacxx"),
])
def test_a_missing_header_fails_naming_hdrs_deps_and_the_declared_toolkit_sets(
        workspace: Workspace, target: str, header: str, sets: str) -> None:
    with pytest.raises(BazelError) as failed:
        workspace.build([f"//{PACKAGE}:{target}"], disk_cache=None)
    output = failed.value.output
    assert _failure_line(output, target).startswith(
        f"Compiling CUBIN probe/{target} (sm_80) [headers only from hdrs, deps and toolkit_headers: {sets}] failed: ")
    assert f"{header}: No such file or directory" in output, output[-3000:]


def test_the_same_sources_with_their_headers_declared_compile(workspace: Workspace) -> None:
    built = workspace.build([f"//{PACKAGE}:hdrs_declared", f"//{PACKAGE}:cub_declared"], disk_cache=None)
    assert built.misses() == {f"//{PACKAGE}:hdrs_declared", f"//{PACKAGE}:cub_declared"}


def _compile_keys(ws: Workspace) -> dict[str, str]:
    """Target -> action key of every CubinCompile of the probe and of //kernels/axpy."""
    expression = f'mnemonic("{COMPILE}", deps(//{PACKAGE}:all) + deps(//kernels/axpy:all))'
    proc = ws.run("aquery", ["--color=no", "--curses=no", "--output=jsonproto", expression])
    graph = json.loads(proc.stdout)
    targets = {t["id"]: t["label"] for t in graph["targets"]}
    return {targets[a["targetId"]]: a["actionKey"] for a in graph["actions"]}


def test_the_hint_changes_no_compile_key(workspace: Workspace) -> None:
    with_hint = _compile_keys(workspace)
    assert len(with_hint) >= 4 + 4, with_hint
    with workspace.edit(COMPILE_BZL, replace_once(HINTED, "message = progress_message")):
        assert _compile_keys(workspace) == with_hint
    # The comparison can fail: what is in the key (here the environment) changes every key.
    salted = 'env = dict(ACTION_ENV, CUBINSTORE_TEST_SALT = "1"),'
    with workspace.edit(COMPILE_BZL, replace_once("env = ACTION_ENV,", salted)):
        salted_keys = _compile_keys(workspace)
    assert salted_keys.keys() == with_hint.keys()
    assert all(salted_keys[label] != key for label, key in with_hint.items())

