"""Bad inputs to cubin_instantiations fail at loading, naming what to fix: a `{placeholder}`
that is no grid key, in any attribute the macro fills (a typo in `defines` used to reach nvcc
as text). Only `bazel query` runs: loading needs no build."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._workspace import BazelError, Workspace
from .conftest import Tools

pytestmark = pytest.mark.bazel

PACKAGE = "bad_inputs"

FAMILY = """\
load("//tools:defs.bzl", "cubin_instantiations")

cubin_instantiations(
    name = "probe",
    srcs = ["probe.cu"],
    archs = ["sm_80"],
    grid = {{"dtype": ["f32"], "block": [128, 256]}},
    hdrs = {hdrs},
    defines = {defines},
    copts = {copts},
    entries = {entries},
    launch = {launch},
)
"""
GOOD = {
    "hdrs": ["probe_{dtype}.cuh"],
    "defines": ["BLOCK={block}", "INIT={0}", "PAIR={ 1, 2 }"],  # C++ braces are no placeholders
    "copts": ["-lineinfo"],
    "entries": {"probe_{dtype}": ["i32", "{dtype}", "ptr"]},
    "launch": {"block": ["{block}"], "grid": ["cdiv(args[0], {block})"]},
}


@pytest.fixture(scope="module")
def workspace(bazel_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    base = tmp_path_factory.mktemp("bad_inputs")
    ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    (ws.root / PACKAGE).mkdir()
    (ws.root / PACKAGE / "probe.cu").write_text('extern "C" __global__ void probe_f32(int n, float a, float* y) {}\n')
    try:
        yield ws
    finally:
        ws.shutdown()


def _load(ws: Workspace, **attributes: object) -> None:
    """Writes the family with GOOD's attributes, some replaced, and loads its package."""
    values = {**GOOD, **attributes}
    text = FAMILY.format(**{k: repr(v) for k, v in values.items()})
    Path(ws.root / PACKAGE / "BUILD.bazel").write_text(text)
    ws.run("query", ["--color=no", "--curses=no", "--noshow_progress", f"//{PACKAGE}:all"])


def test_a_family_whose_placeholders_are_grid_keys_loads(workspace: Workspace) -> None:
    _load(workspace)


@pytest.mark.parametrize("attribute, value, text", [
    ("defines", ["BLOCK={blok}"], "BLOCK={blok}"),
    ("copts", ["-Xptxas=-v", "-maxrregcount={regs}"], "-maxrregcount={regs}"),
    ("hdrs", ["probe_{dtyp}.cuh"], "probe_{dtyp}.cuh"),
    ("entries", {"probe_{dtype}": ["i32", "{dtpye}", "ptr"]}, "{dtpye}"),
    ("entries", {"probe_{type}": ["i32", "f32", "ptr"]}, "probe_{type}"),
    ("launch", {"block": ["{block}"], "grid": ["cdiv(args[0], {blocks})"]}, "cdiv(args[0], {blocks})"),
    ("launch", {"probe_{dtype}": {"block": ["{bk}"]}}, "{bk}"),
])
def test_an_unknown_placeholder_fails_loading_naming_the_attribute_and_the_placeholder(
        workspace: Workspace, attribute: str, value: object, text: str) -> None:
    with pytest.raises(BazelError) as caught:
        _load(workspace, **{attribute: value})
    word = text.split("{")[1].split("}")[0]
    assert caught.value.fail_message() == (
        f"cubin_instantiations 'probe': attribute '{attribute}' has placeholder '{{{word}}}' in \"{text}\", "
        f"which is not a grid key; grid keys: '{{dtype}}', '{{block}}'"), caught.value.output[-3000:]
