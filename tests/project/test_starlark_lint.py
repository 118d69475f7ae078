"""The Starlark files are formatted and lint-clean by buildifier (the pinned npm one)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILDIFIER = ROOT / "node_modules" / ".bin" / "buildifier"


def starlark_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "*.bzl", "*.bazel", "WORKSPACE", "third_party/*/*.BUILD"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in listed if (ROOT / f).exists()]


@pytest.mark.skipif(not BUILDIFIER.exists(), reason="buildifier is not installed: run tools/bootstrap.sh")
def test_starlark_is_formatted_and_lint_clean():
    files = starlark_files()
    assert "tools/private/rules/cuda_cubin.bzl" in files
    result = subprocess.run([str(BUILDIFIER), "-mode=check", "-lint=warn", *files],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
