"""No absolute path reaches a cached action: `bazel aquery` shows the command lines and
environments of CubinCompile (and CubinManifest) actions exactly as they are keyed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ._workspace import COMPILE, MANIFEST
from .conftest import Checkouts, Tools

pytestmark = pytest.mark.bazel

QUERY = f'mnemonic("{COMPILE}|{MANIFEST}", deps(//kernels:all))'


def _forms(path: Path | str) -> set[str]:
    """A path as written and resolved (a symlinked /tmp or home has two spellings)."""
    return {str(path), os.path.realpath(path)}


def test_cubin_compile_actions_name_no_machine_path(checkouts: Checkouts, bazel_tools: Tools) -> None:
    ws = checkouts.shallow
    graph = ws.aquery(QUERY)
    actions = graph.get("actions", [])
    compiles = [a for a in actions if a["mnemonic"] == COMPILE]
    assert compiles, f"aquery {QUERY} found no {COMPILE} action"

    toolkit = Path(os.readlink(ws.output_base / "external" / "local_cuda" / "bin" / "nvcc")).parent.parent
    machine_paths = {
        "workspace": _forms(ws.root),
        "output base": _forms(ws.output_base),
        "toolkit": _forms(toolkit) | _forms(bazel_tools.toolkit),
        "home directory": _forms(ws.env()["HOME"]),
        "virtualenv": _forms(bazel_tools.venv),
    }
    targets = {t["id"]: t["label"] for t in graph.get("targets", [])}
    leaks = []
    for action in actions:
        label = targets.get(action["targetId"], "?")
        values = [("argument", a) for a in action.get("arguments", [])]
        values += [(f"env {e['key']}", e.get("value", "")) for e in action.get("environmentVariables", [])]
        for what, value in values:
            for name, forms in machine_paths.items():
                if any(len(form) > 1 and form in value for form in forms):
                    leaks.append(f"{label}: {what} '{value}' contains the {name} path")
    assert leaks == []


def test_cubin_compile_arguments_are_all_relative(checkouts: Checkouts) -> None:
    # Stronger than the list above: no argument names an absolute path at all, so a path this
    # test does not know about (a second toolkit, a sysroot) cannot leak either.
    graph = checkouts.shallow.aquery(QUERY)
    absolute = []
    for action in graph.get("actions", []):
        for arg in action.get("arguments", []):
            value = arg.split("=", 1)[-1]
            if value.startswith("/") or arg.startswith(("-I/", "-isystem/", "-L/")):
                absolute.append(arg)
    assert graph.get("actions"), "no action found"
    assert absolute == []
