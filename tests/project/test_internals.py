"""`cubinstore.internals` is the one door to the package's private modules: tests, benchmarks and
tools import those through it (or the public API) alone, no package module imports it, and
importing it loads neither torch nor the CUDA driver."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cubinstore"
DOOR = "cubinstore.internals"

# The Bazel actions' tools run under the host's python3, which has no xxhash (internals imports
# it with the JIT and cubinstore-nvcc): they import the few private modules they check with
# directly. Exactly these; any other private import of theirs fails below too.
BUILD_TOOL_IMPORTS = {
    "tools/manifest_tool.py": {"cubinstore._core", "cubinstore._core.cubin", "cubinstore._core.cxxnames",
                               "cubinstore._core.geometry", "cubinstore._core.mangled", "cubinstore._jit.demangle"},
    "tools/jit_template_tool.py": {"cubinstore._jit.family"},
}
# `python -c '...'` in a shell script: the inline Python a tool runs.
_INLINE_PYTHON = re.compile(r"\S*(?:python|PY)\S*\s+-c\s+'([^']*)'")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def cubinstore_imports(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, the statement's module, the dotted name imported) of every import of cubinstore."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cubinstore":
                    yield node.lineno, alias.name, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module.split(".")[0] == "cubinstore":
                for alias in node.names:
                    yield node.lineno, node.module, f"{node.module}.{alias.name}"


def sources() -> Iterator[tuple[str, ast.AST, int]]:
    """(path relative to the repository, parsed source, first line) of the tests, benchmarks and
    tools, and of the inline Python of tools/*.sh."""
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tools").rglob("*.py")]
    for path in sorted(paths):
        yield str(path.relative_to(REPO)), ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), 0
    for path in sorted((REPO / "tools").glob("*.sh")):
        text = path.read_text(encoding="utf-8")
        for match in _INLINE_PYTHON.finditer(text):
            offset = text.count("\n", 0, match.start(1))
            yield str(path.relative_to(REPO)), ast.parse(match.group(1), filename=str(path)), offset


def test_tests_benchmarks_and_tools_reach_private_modules_through_internals_alone() -> None:
    found = []
    for rel, tree, offset in sources():
        for line, module, dotted in cubinstore_imports(tree):
            if module == DOOR and not _private(dotted.removeprefix(DOOR)):
                continue
            if _private(dotted) and module not in BUILD_TOOL_IMPORTS.get(rel, ()):
                found.append(f"{rel}:{line + offset}: {dotted}")
    assert found == [], ("import these from the public API or cubinstore.internals (add the name there if it "
                         "has none):\n" + "\n".join(found))


def test_the_inline_python_of_the_shell_tools_is_scanned() -> None:
    # The scan above reads stage_device.sh's `python -c`: the pattern still finds it.
    assert any(rel == "tools/stage_device.sh" for rel, _, _ in sources())


def test_no_package_module_imports_internals() -> None:
    # It sits above every layer (pyproject.toml's layers contract says so too, for all but the
    # package's own __init__ and __main__, which this covers).
    found = [f"{path.relative_to(REPO)}:{line}: {dotted}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "internals.py"
             for line, _, dotted in cubinstore_imports(ast.parse(path.read_text(encoding="utf-8")))
             if dotted == DOOR or dotted.startswith(DOOR + ".")]
    assert found == [], "cubinstore.internals is for tests, benchmarks and tools:\n" + "\n".join(found)


def test_importing_internals_loads_neither_torch_nor_the_cuda_driver() -> None:
    code = ("import sys, cubinstore.internals\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda', 'cupy')))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_build_tools_start_without_site_packages() -> None:
    # -S: no site-packages, so no xxhash, as under the host's python3 of a Bazel action.
    for tool in BUILD_TOOL_IMPORTS:
        out = subprocess.run([sys.executable, "-S", str(REPO / tool)], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and "Usage:" in out.stderr, (tool, out.returncode, out.stderr[-2000:])
