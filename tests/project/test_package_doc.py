"""docs/package.md lists every module of the package, once, and nothing else (one line per module)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_doc_lists_each_module_once() -> None:
    listed = re.findall(r"^\| `([^`]+\.py)` \|", (ROOT / "docs" / "package.md").read_text(), re.MULTILINE)
    modules = sorted(str(p.relative_to(ROOT / "cubinstore")) for p in (ROOT / "cubinstore").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert sorted(listed) == modules, (
        f"docs/package.md: missing {sorted(set(modules) - set(listed))}, gone {sorted(set(listed) - set(modules))}, "
        f"twice {sorted({m for m in listed if listed.count(m) > 1})}")
