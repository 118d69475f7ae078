"""The package's layering holds: `lint-imports` keeps every contract of pyproject.toml's
`[tool.importlinter]` (imports point down only, no circle among siblings, only `_driver` imports
the CUDA bindings, only `ops` imports torch), and no module is reached by a name string."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cubinstore"


def lint_imports() -> list[str]:
    """The command that runs import-linter with this interpreter: its console script, else its entry point."""
    script = Path(sys.executable).parent / "lint-imports"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def test_import_contracts_are_kept() -> None:
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is not installed: .venv/bin/python -m pip install -r requirements-dev.txt")
    # --no-cache: nothing written into the checkout; the graph of 50 modules takes well under a second.
    out = subprocess.run([*lint_imports(), "--no-cache", "--no-logo", str(REPO / "pyproject.toml")], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"lint-imports exited {out.returncode}:\n{out.stdout}{out.stderr}"
    assert "0 broken" in out.stdout, out.stdout


def name_string_imports(path: Path) -> list[str]:
    """`importlib.import_module(...)`, `__import__(...)` and `sys.modules[...]`/`.get(...)` of a cubinstore module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("importlib.import_module", "import_module", "__import__") and node.args:
                target = node.args[0]
            elif func in ("sys.modules.get", "sys.modules.pop", "sys.modules.setdefault") and node.args:
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            target = node.slice
        if target is None:
            continue
        if "cubinstore" in ast.unparse(target):  # a literal or an f-string naming one of ours
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_is_reached_by_a_name_string() -> None:
    # An import the linter cannot see hides a circle from it. The one exception is the package's
    # own __init__, which imports its public subpackages and names on first attribute access.
    hits = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "__init__.py"
            for hit in name_string_imports(path)]
    assert hits == [], "import these modules by name (an import statement):\n" + "\n".join(hits)


def test_subpackages_are_attributes_loaded_on_first_use() -> None:
    # `import cubinstore` then `cubinstore.ops...` (README's quickstart) works without importing
    # the subpackage first, and reaching one loads neither torch nor the CUDA driver.
    code = """
import sys
import cubinstore
names = ("ops", "jit", "launch", "tensormap", "manifest", "store")
assert not any(f"cubinstore.{n}" in sys.modules for n in names)
assert set(names) <= set(dir(cubinstore))
for n in names:
    assert getattr(cubinstore, n) is sys.modules[f"cubinstore.{n}"], n
assert callable(cubinstore.ops.set_library) and callable(cubinstore.jit.compile)
assert "torch" not in sys.modules and "cuda.bindings.driver" not in sys.modules
try:
    cubinstore.no_such_module
except AttributeError as exc:
    assert str(exc) == "module 'cubinstore' has no attribute 'no_such_module'", exc
else:
    raise AssertionError("no AttributeError")
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
