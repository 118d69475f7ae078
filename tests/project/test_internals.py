"""`cubinstore.internals` is the one door to the package's private modules: tests, benchmarks and
tools import those through it (or the public API) alone, replace no attribute of a cubinstore
module or class (they inject through parameters instead), no package module imports it, and
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


def imported_names(tree: ast.AST) -> set[str]:
    """The names an import of cubinstore binds (``import cubinstore.jit`` binds ``cubinstore``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] == "cubinstore"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module.split(".")[0] == "cubinstore":
                names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    """``a`` of ``a.b.c`` (None unless the chain starts at a plain name)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def code_strings(tree: ast.AST) -> Iterator[tuple[int, ast.AST]]:
    """(first line, parsed) of each multi-line string that parses as Python: a child process's code."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                yield node.lineno, ast.parse(node.value)
            except SyntaxError:
                continue


def attribute_patches(tree: ast.AST, names: set[str]) -> Iterator[tuple[int, str]]:
    """(line, what) of each ``x.attr = ...``, ``del x.attr``, ``setattr(x, ...)`` or ``delattr(x, ...)``
    whose ``x`` is a name in ``names`` (imported from cubinstore: a module, class or function of it)."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):  # a tuple target too
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)) and _root(sub) in names:
                    yield node.lineno, ast.unparse(sub)
        if isinstance(node, ast.Call) and node.args and _root(node.args[0]) in names and (
                (isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"))
                # pytest's monkeypatch.setattr(module, "name", ...) is the same replacement
                or (isinstance(node.func, ast.Attribute) and node.func.attr in ("setattr", "delattr")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "monkeypatch")):
            yield node.lineno, ast.unparse(node)


def patches_in(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``attribute_patches`` of a source and of the child code in its strings, with the names the
    source and those strings import (a child's stage may use a name its preamble imported)."""
    strings = list(code_strings(tree))
    names = imported_names(tree).union(*(imported_names(code) for _, code in strings))
    yield from attribute_patches(tree, names)
    for first, code in strings:
        for line, what in attribute_patches(code, names):
            yield first + line - 1, f"{what} (child code)"


def test_tests_benchmarks_and_tools_replace_no_attribute_of_cubinstore() -> None:
    found = [f"{rel}:{line + offset}: {what}" for rel, tree, offset in sources() for line, what in patches_in(tree)]
    assert found == [], ("inject through a parameter (a subclass or factory passed in, a fake driver object) "
                         "instead of replacing an attribute of a cubinstore module or class:\n" + "\n".join(found))


def test_the_patch_scan_finds_replacements_not_a_tests_own_objects() -> None:
    # One line a string (none multi-line), so the scan of this file does not read it as child code.
    source = "\n".join([
        "import cubinstore.jit",
        "from cubinstore.internals import JitIndex, compiler as c",
        'CHILD = """\nimport sys\nJitIndex.put = put\n"""',  # the stage of a child: lines 3-6
        "c.lookup = None",
        "cubinstore.jit.compile = wrapped",
        "setattr(c, 'lookup', None)",
        "class Index(JitIndex):",
        "    def put(self, entry): ...",
        "Index.put = put",  # the test's own subclass
        "index = JitIndex(local)",
        "index.local = other",  # the test's own instance
        "kw = {}",
        "kw['make_index'] = Index",
        "monkeypatch.setattr(c, '_driver', None)",
        "monkeypatch.setattr(os, 'fsync', None)",  # the standard library's: allowed
    ])
    assert [what for _, what in patches_in(ast.parse(source))] == [
        "c.lookup", "cubinstore.jit.compile", "setattr(c, 'lookup', None)",
        "monkeypatch.setattr(c, '_driver', None)", "JitIndex.put (child code)"]
    assert [line for line, _ in patches_in(ast.parse(source))] == [7, 8, 9, 17, 5]


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
