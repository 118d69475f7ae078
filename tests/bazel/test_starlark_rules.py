"""The Starlark analysis tests of the rules (tests/starlark, bazel_skylib's analysistest) pass
under Bazel 7, and they can fail: a wrong expectation makes `bazel test` fail."""

from __future__ import annotations

import re

import pytest

from ._workspace import BazelError, replace_once
from .conftest import Checkouts7

pytestmark = pytest.mark.bazel

TESTS = "//tests/starlark:all"
# Analysis tests need their targets analysed, not built: no CUBIN is compiled.
FLAGS = ["--color=no", "--curses=no", "--build_tests_only", "--test_output=errors", "--nocache_test_results",
         "--disk_cache="]


def _test_targets(checkouts7: Checkouts7) -> list[str]:
    text = (checkouts7.shallow.root / "tests" / "starlark" / "BUILD.bazel").read_text()
    return re.findall(r'name = "(\w+_test)"', text)


def test_starlark_analysis_tests_pass(checkouts7: Checkouts7) -> None:
    names = _test_targets(checkouts7)
    assert len(names) >= 6
    proc = checkouts7.shallow.run("test", [*FLAGS, TESTS])
    summary = re.search(r"Executed (\d+) out of (\d+) tests?: (\d+) tests? pass", proc.stdout + proc.stderr)
    assert summary, proc.stderr[-2000:]
    assert summary.groups() == (str(len(names)),) * 3


def test_a_wrong_expectation_fails_the_starlark_tests(checkouts7: Checkouts7) -> None:
    wrong = replace_once('"//tests/starlark:probe_f32_vec4_sm_80",', '"//tests/starlark:probe_f32_vec8_sm_80",')
    with checkouts7.shallow.edit("tests/starlark/BUILD.bazel", wrong):
        with pytest.raises(BazelError) as failed:
            checkouts7.shallow.run("test", [*FLAGS, "//tests/starlark:macro_names_test"])
    assert "macro_names_test" in failed.value.output and "FAILED" in failed.value.output
