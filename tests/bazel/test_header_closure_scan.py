"""The CubinScan tool (tools/private/header_closure.py) without Bazel: which declared headers a
TU reaches, resolved as the preprocessor resolves them, and where it must copy everything."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "private" / "header_closure.py"


def _load_tool() -> ModuleType:
    # A build tool run as a script, not a package module: loaded from its path.
    spec = importlib.util.spec_from_file_location("header_closure_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


@pytest.fixture
def execroot(tmp_path: Path) -> Iterator[Path]:
    """An empty execution root as the current directory (the tool takes exec paths)."""
    before = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(before)


def _write(files: dict[str, str]) -> set[str]:
    for name, text in files.items():
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(text)
    return {n for n in files if not n.endswith(".cu")}


def test_a_quoted_name_is_found_beside_its_includer_before_the_roots(execroot: Path) -> None:
    declared = _write({
        "pkg/k.cu": '#include "h.cuh"\n',
        "pkg/h.cuh": "// beside\n",
        "h.cuh": "// at the root\n",
        "unused.cuh": "",
    })
    files, everything = tool.closure("pkg/k.cu", [".", "lib/include"], declared)
    assert (files, everything) == (["pkg/k.cu", "pkg/h.cuh"], None)


def test_an_angle_name_is_found_in_the_first_root_that_has_it(execroot: Path) -> None:
    declared = _write({
        "k.cu": "#include <x/y.h>\n  #  include <z.h>  // spaced\n",
        "first/x/y.h": "",
        "second/x/y.h": "",
        "second/z.h": '#include "../first/x/y.h"\n',
    })
    files, _ = tool.closure("k.cu", ["first", "second"], declared)
    assert files == ["k.cu", "first/x/y.h", "second/z.h"]


def test_a_computed_include_is_expanded_with_every_definition_of_its_macro(execroot: Path) -> None:
    # CUTLASS's spelling: the definition sits in one branch of an #if, the use in another file.
    declared = _write({
        "k.cu": '#include "config.h"\n#include STD_HEADER(tuple)\n',
        "config.h": "#if defined(A)\n#define STD_HEADER(header) <a/header>\n#else\n"
                    "#define STD_HEADER(header) <b/header>\n#endif\n",
        "inc/a/tuple": "",
        "inc/b/tuple": "",
        "inc/b/other": "",
    })
    files, everything = tool.closure("k.cu", ["inc"], declared)
    assert everything is None
    assert sorted(files) == ["config.h", "inc/a/tuple", "inc/b/tuple", "k.cu"]


def test_has_include_counts_as_an_include(execroot: Path) -> None:
    declared = _write({"k.cu": "#if __has_include(<opt.h>)\n#endif\n", "inc/opt.h": ""})
    assert tool.closure("k.cu", ["inc"], declared)[0] == ["k.cu", "inc/opt.h"]


@pytest.mark.parametrize("line, why", [
    ("#include_next <a.h>", "k.cu: #include_next <a.h>"),
    ("#include NOWHERE_DEFINED", "k.cu: #include NOWHERE_DEFINED: no #define of it in the headers reached"),
    ("#include 3", "k.cu: #include 3"),
])
def test_what_text_cannot_resolve_copies_every_declared_header(execroot: Path, line: str, why: str) -> None:
    declared = _write({"k.cu": line + "\n", "a.h": "", "b.h": ""})
    files, everything = tool.closure("k.cu", ["."], declared)
    assert (files, everything) == (["k.cu", "a.h", "b.h"], why)


def test_a_header_over_the_size_limit_fails_naming_it(execroot: Path) -> None:
    declared = _write({"k.cu": '#include "big.h"\n', "big.h": "x" * 100})
    with pytest.raises(tool.ScanError, match=r"^big.h: 100 bytes, more than the 64 a header may have$"):
        tool.closure("k.cu", ["."], declared, max_file_bytes=64)


def test_main_copies_the_closure_to_the_tree_at_exec_paths(execroot: Path) -> None:
    _write({"pkg/k.cu": '#include "pkg/h.cuh"\n', "pkg/h.cuh": "", "pkg/other.cuh": ""})
    params = Path("params")
    params.write_text("--out\ntree\n--src\npkg/k.cu\n--root\n.\npkg/h.cuh\npkg/other.cuh\n")
    assert tool.main(["@params"]) == 0
    assert sorted(str(p) for p in Path("tree").rglob("*") if p.is_file()) == ["tree/pkg/h.cuh", "tree/pkg/k.cu"]
