"""One descriptor per environment variable: `cubinstore/_core/knobs.py` is the only reader, and
README's table and the Bazel repository rules agree with its `VARIABLES`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import knobs

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cubinstore"
KNOBS = PACKAGE / "_core" / "knobs.py"
README = REPO / "README.md"
NAME = re.compile(r"\bCUBINSTORE_[A-Z0-9_]+\b")


def readme_section(title: str) -> list[str]:
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return lines[start:end]


def readme_table() -> list[tuple[str, str, str]]:
    """(variable, type, default) of each row of README's "Environment variables" table."""
    rows = []
    for line in readme_section("### Environment variables"):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`CUBINSTORE_"):
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def test_readme_table_is_the_variables_table() -> None:
    # Same names in the same order, same types and defaults: a variable added to knobs.py and
    # not to the README (or the other way round) fails here.
    assert readme_table() == [(v.name, v.type, v.default_text) for v in knobs.VARIABLES]


def test_each_variable_reads_as_its_default_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBINSTORE_HOME")  # clean_env's
    for var in knobs.VARIABLES:
        assert var.type in knobs.TYPES, var
        assert var.get() == var.default, var.name
    assert knobs.home() == knobs.user_cache_dir() / "cubinstore"


@pytest.mark.parametrize("var", [v for v in knobs.VARIABLES if v.type in ("bool", "seconds", "int")],
                         ids=lambda v: v.name)
def test_a_bad_value_is_an_error_naming_the_variable(var: knobs.Variable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var.name, "not-a-value")
    with pytest.raises(BadArgumentError, match=f"^{var.name}: expected "):
        var.get()


def test_the_accessors_read_their_descriptors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Set every variable to a value unlike its default; unsetting one must change exactly one
    # accessor: the one that reads it.
    def sample(var: knobs.Variable) -> tuple[str, object]:
        if var is knobs.VERIFY:  # a choice of two words, read as "is it full"
            return ("full", True)
        return {"path": (str(tmp_path), tmp_path), "URLs": ("http://a, http://b", ("http://a", "http://b")),
                "bool": ("off" if var.default else "on", not var.default), "seconds": ("2.5", 2.5), "int": ("7", 7),
                "str": ("x", "x")}[var.type]

    accessors = {name: getattr(knobs, name) for name in knobs.__all__ if name not in ("VARIABLES", "Variable")}
    for var in knobs.VARIABLES:
        monkeypatch.setenv(var.name, sample(var)[0])
    before = {name: accessor() for name, accessor in accessors.items()}
    for var in knobs.VARIABLES:
        monkeypatch.delenv(var.name)
        changed = [name for name, accessor in accessors.items() if accessor() != before[name]]
        assert [before[name] for name in changed] == [sample(var)[1]], (var.name, changed)
        before.update((name, accessors[name]()) for name in changed)


def environ_reads(path: Path) -> list[str]:
    """`os.environ`, `os.environb`, `os.getenv`, `os.putenv` (or a bare `environ`/`getenv` imported from os) in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"environ", "environb", "getenv", "putenv", "unsetenv"}:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path.relative_to(REPO)}:{node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in {"environ", "environb", "getenv"}]
    return found


def test_only_knobs_reads_the_environment() -> None:
    reads = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != KNOBS for hit in environ_reads(path)]
    assert reads == [], "read the environment through cubinstore/_core/knobs.py:\n" + "\n".join(reads)


def test_every_variable_the_package_names_is_declared() -> None:
    # A message or docstring naming CUBINSTORE_X where knobs has no X is a typo or an undeclared variable.
    declared = {v.name for v in knobs.VARIABLES}
    named = {(path.relative_to(REPO).as_posix(), name)
             for path in sorted(PACKAGE.rglob("*.py")) for name in NAME.findall(path.read_text(encoding="utf-8"))}
    assert sorted((where, name) for where, name in named if name not in declared) == []


def repository_rule_reads() -> dict[str, str]:
    """Variable -> default of every `rctx.os.environ.get("X", default)` in the repository rules, plus each `environ = [...]`."""
    reads: dict[str, str] = {}
    for path in sorted((REPO / "third_party").rglob("*.bzl")):
        text = path.read_text(encoding="utf-8")
        for name, default in re.findall(r'rctx\.os\.environ\.get\("([A-Z0-9_]+)",\s*"([^"]*)"\)', text):
            reads[name] = default
        for listed in re.findall(r"\benviron\s*=\s*\[([^\]]*)\]", text):
            for name in re.findall(r'"([A-Z0-9_]+)"', listed):
                reads.setdefault(name, "")
    return reads


def test_readme_names_what_the_repository_rules_read() -> None:
    reads = repository_rule_reads()
    assert {"CUBINSTORE_HOST_CC", "CUBINSTORE_CUTLASS_INCLUDE", "CUDA_PATH"} <= set(reads)  # the scan works
    section = "\n".join(readme_section("### Environment variables"))
    build_side = section[section.index("Build side"):].split("\n\n")[0]
    missing = sorted(name for name in reads if name != "PATH" and f"`{name}`" not in build_side)
    assert missing == [], f"README's 'Build side' line does not name {missing}"


def test_the_build_and_the_runtime_share_defaults() -> None:
    # CUBINSTORE_HOST_CC means one compiler to Bazel and to the JIT: one default.
    by_name = {v.name: v for v in knobs.VARIABLES}
    reads = repository_rule_reads()
    shared = sorted(set(reads) & set(by_name))
    assert shared, "no CUBINSTORE_* variable read by both the repository rules and knobs.py"
    for name in shared:
        assert reads[name] == (by_name[name].default or ""), name
