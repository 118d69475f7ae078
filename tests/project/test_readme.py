"""README's Python examples run as written, so the README cannot drift from the code.

Each ```python block of README.md runs in a fresh interpreter, in a temporary directory whose
``bazel-bin/kernels/manifest.json`` is a release the test made, with a fresh ``CUBINSTORE_HOME``
holding its blobs. An HTML comment on the line before a block says how it is tested:

    <!-- test: gpu -->           needs a GPU (and torch): runs against the manifest under test
                                 (CUBINSTORE_TEST_MANIFEST, else bazel-bin/kernels/manifest.json)
                                 only where one is present, else skips with the reason
    <!-- test: skip (why) -->    a fragment on purpose; never run

Every block, run or not, must parse, and each ``cubinstore`` name it uses must exist and take
the keywords the block passes (checked on CPU, so a GPU example cannot drift either).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cubinstore import Digest
from cubinstore.store import LocalLayer

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARKER = re.compile(r"^<!--\s*test:\s*(gpu|skip\s*\((?P<why>[^)]+)\))\s*-->$")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    kind: str  # "cpu", "gpu" or "skip"
    why: str = ""

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks() -> list[Block]:
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = lines.index("```", i + 1)
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        kind, why = "cpu", ""
        if before.startswith("<!--"):
            match = MARKER.match(before)
            assert match, f"README.md:{i}: unknown test marker {before!r} (gpu, or skip (why))"
            kind, why = ("skip", match["why"].strip()) if match["why"] else ("gpu", "")
        blocks.append(Block(i + 1, "\n".join(lines[i + 1:end]) + "\n", kind, why))
        i = end + 1
    return blocks


BLOCKS = readme_blocks()


def test_the_readme_has_python_examples() -> None:
    assert BLOCKS, "no ```python block found in README.md: the parser or the README changed"
    assert any(b.kind == "gpu" for b in BLOCKS)  # the quickstart


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_parses(block: Block) -> None:
    compile(block.code, block.name, "exec")


# -- the cubinstore names a block uses ------------------------------------------------------------

def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def api_uses(code: str) -> list[tuple[int, str, list[str]]]:
    """(line, dotted cubinstore name, keywords passed) of each name the block reaches from an import of cubinstore."""
    tree = ast.parse(code)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cubinstore":
                    bound[alias.asname or "cubinstore"] = alias.name if alias.asname else "cubinstore"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cubinstore":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    uses: dict[tuple[int, int], tuple[int, str, list[str]]] = {}
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)) or isinstance(node.ctx, ast.Store):
            continue
        parts = _dotted(node)
        if parts is None or parts[0] not in bound:
            continue
        call = calls.get(id(node))
        keywords = [k.arg for k in call.keywords if k.arg] if call else []
        key = (node.lineno, node.col_offset)
        name = ".".join([bound[parts[0]], *parts[1:]])
        if key not in uses or len(name) > len(uses[key][1]):  # the longest chain at a position
            uses[key] = (node.lineno, name, keywords)
    return sorted(uses.values())


def resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    value: Any = importlib.import_module(parts[0])
    for part in parts[1:]:
        value = getattr(value, part)  # cubinstore's subpackages load on first access
    return value


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_uses_names_that_exist(block: Block) -> None:
    wrong = []
    for line, name, keywords in api_uses(block.code):
        try:
            value = resolve(name)
        except (AttributeError, ImportError) as exc:
            wrong.append(f"line {block.line + line}: {name}: {exc}")
            continue
        if keywords and callable(value):
            params = inspect.signature(value).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                wrong += [f"line {block.line + line}: {name}() takes no keyword {k!r}" for k in keywords if k not in params]
    assert wrong == [], "\n".join(wrong)


# -- running a block -------------------------------------------------------------------------------

def run_block(block: Block, cwd: Path, home: Path, timeout: float) -> None:
    script = cwd / "readme_block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env.update(CUBINSTORE_HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{block.name} exited {out.returncode}:\n{block.code}\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "cpu"], ids=lambda b: b.name)
def test_cpu_block_runs(block: Block, make_release, tmp_path: Path) -> None:
    # A release of random-bytes kernels at the path the README uses, its blobs in the local store.
    release = make_release(n=4)
    cwd = tmp_path / "cwd"
    (cwd / "bazel-bin" / "kernels").mkdir(parents=True)
    (cwd / "bazel-bin" / "kernels" / "manifest.json").write_bytes(release.raw)
    home = tmp_path / "home"
    local = LocalLayer(home)
    for data in release.blobs.values():
        local.write(Digest.of(data), data)
    run_block(block, cwd, home, timeout=120)


def manifest_under_test() -> Path:
    path = Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    return path if path.is_absolute() else REPO / path


@pytest.mark.gpu
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "gpu"], ids=lambda b: b.name)
def test_gpu_block_runs(block: Block, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the GPU examples use torch")
    manifest = manifest_under_test()
    if not manifest.is_file():
        pytest.skip(f"no manifest at {manifest}: run `bazel build //kernels:all` or set CUBINSTORE_TEST_MANIFEST")
    # bazel-bin/kernels/manifest.json in the block is the manifest under test; its CUBINs enter a
    # fresh local store the way a user's do: `cubinstore prefetch` from the build tree.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "bazel-bin").symlink_to(manifest.parent.parent.resolve(), target_is_directory=True)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env.update(CUBINSTORE_HOME=str(home), PYTHONPATH=str(REPO))
    ref = f"bazel-bin/{manifest.parent.name}/{manifest.name}"
    fill = subprocess.run([sys.executable, "-m", "cubinstore", "prefetch", ref], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert fill.returncode == 0, fill.stdout + fill.stderr
    code = block.code.replace("bazel-bin/kernels/manifest.json", ref)
    run_block(Block(block.line, code, block.kind), cwd, home, timeout=300)


def test_skipped_blocks_say_why() -> None:
    assert all(b.why for b in BLOCKS if b.kind == "skip")


# -- the package table of "Layout" ----------------------------------------------------------------

def package_table() -> list[set[str]]:
    """The modules of each row of README's "The Python package" table, top row first."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("### The Python package")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("| `cubinstore/"):
            continue
        # `cubinstore/cli/` or `cubinstore/_loader.py`, `_args.py`: later paths are beside the first.
        paths = [p.rstrip("/") for p in re.findall(r"`([^`]+)`", line.split("|")[1])]
        base, first = paths[0].rsplit("/", 1)
        rows.append({f"{base}/{name.removesuffix('.py')}".replace("/", ".") for name in [first, *paths[1:]]})
    return rows


def test_the_package_table_is_the_layer_order() -> None:
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c.get("id") == "layers")
    expected = [{m.strip() for m in re.split(r"[|:]", layer)} for layer in layers]
    assert package_table() == expected


def test_the_package_table_names_every_part_of_the_package() -> None:
    named = set().union(*package_table())
    parts = {f"cubinstore.{p.name.removesuffix('.py')}" for p in (REPO / "cubinstore").iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name not in ("__init__.py", "__main__.py")}
    assert parts == named
