"""`cubinstore explain`: names the changed header (relative path), the changed flag and the changed
toolkit, each in its own case; and the nearest points of a manifest for a family point."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import ENTRIES, TU, child_env, make_library, toolkit_copy_with_changed_header  # noqa: E402

from cubinstore import jit  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"


def _explain(cli, home: Path, *args: str) -> str:
    out = cli(["explain", *args], child_env(home))
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in list(os.environ):
        if name.startswith("CUBINSTORE_"):
            monkeypatch.delenv(name)
    jit.clear_caches()
    home = tmp_path / "home"
    include = make_library(tmp_path / "lib")
    store = Store([LocalLayer(home)])
    first = jit.compile(TU, include_dirs=[include], arch=ARCH, entries=ENTRIES, store=store)
    yield home, include, store, first
    jit.clear_caches()


def test_explain_names_the_changed_header_by_relative_path(base, cli, tmp_path: Path) -> None:
    home, include, store, first = base
    changed = tmp_path / "other-prefix" / "include"
    shutil.copytree(include, changed)
    with open(changed / "mylib" / "twice.cuh", "a") as f:
        f.write("// a patched release of the library\n")
    k = jit.compile(TU, include_dirs=[changed], arch=ARCH, entries=ENTRIES, store=store)
    text = _explain(cli, home, str(k.key))
    assert text.startswith(f"JIT key {k.key}: in the index: {k.digest}")
    assert f"nearest entry: {first.key} ({first.digest}); 1 of 8 parts differ: includes" in text
    assert "  include root 0: mylib/twice.cuh changed content\n" in text
    assert str(tmp_path) not in text


def test_explain_names_the_changed_flag(base, cli) -> None:
    home, include, store, first = base
    k = jit.compile(TU, include_dirs=[include], flags=["-DFACTOR=3"], arch=ARCH, entries=ENTRIES, store=store)
    text = _explain(cli, home, str(k.key))
    assert "1 of 8 parts differ: flags" in text
    assert "  flag: -DFACTOR=3 only in this key\n" in text


def test_explain_names_the_changed_toolkit_file(base, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, include, store, first = base
    monkeypatch.setenv("CUDA_PATH", str(toolkit_copy_with_changed_header(tmp_path / "cuda-copy")))
    k = jit.compile(TU, include_dirs=[include], arch=ARCH, entries=ENTRIES, store=store)
    text = _explain(cli, home, str(k.key))
    assert "1 of 8 parts differ: toolkit" in text
    assert "  toolkit: file include/cuda_fp16.h changed content\n" in text
    assert "cuda-copy" not in text


def test_explain_a_miss_refused_with_jit_off(base, cli) -> None:
    home, include, store, first = base
    with pytest.raises(Exception) as info:
        jit.compile(TU, include_dirs=[include], arch="sm_80", entries=ENTRIES, store=store, jit=False)
    key = re.search(r"xxh3:[0-9a-f]{32}", str(info.value)).group(0)
    text = _explain(cli, home, key)
    assert text.startswith(f"JIT key {key}: not in the index")
    assert "  arch: sm_90a -> sm_80\n" in text


def test_explain_unknown_key_is_an_error_naming_it(base, cli) -> None:
    home = base[0]
    out = cli(["explain", "xxh3:" + "0" * 32], child_env(home))
    assert out.returncode == 1
    assert out.stderr.startswith(f"cubinstore: error: JIT key xxh3:{'0' * 32}: no parts kept in ")


def test_explain_family_point_lists_the_nearest_points_and_what_differs(make_release, cli, tmp_path: Path) -> None:
    release = make_release(n=8, archs=("sm_90a",))  # axpy f32/f64 x vec 1,2,4,8
    out = cli(["explain", "axpy", "dtype=f32", "vec=3", "--arch", "sm_90a", "--manifest", str(release.path)],
              child_env(tmp_path / "home"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"axpy dtype=f32 vec=3 arch=sm_90a: not in manifest {release.digest}\nnearest points (1 difference):\n")
    assert "  axpy/f32/vec1/sm_90a\n    vec: 1 in the manifest, 3 asked\n" in out.stdout
    found = cli(["explain", "axpy", "dtype=f32", "vec=4", "--manifest", str(release.path)], child_env(tmp_path / "home"))
    assert found.stdout.startswith(f"axpy dtype=f32 vec=4: in manifest {release.digest}\n  axpy/f32/vec4/sm_90a")


@pytest.mark.parametrize("args, why", [
    (["axpy", "vec=" + "9" * 5000], "explain: parameter vec: expected an integer in [-2**63, 2**63) or a word like "
                                    "'f32' ([A-Za-z0-9_.+-]), got '" + "9" * 37 + "'... (5000 characters)"),
    (["axpy", f"vec={2**63}"], "explain: parameter vec: expected an integer in [-2**63, 2**63) or a word"),
    (["axpy", "vec=" + "1" * 30], "explain: parameter vec: expected an integer in [-2**63, 2**63) or a word"),
    (["axpy", "dtype=f'32"], "explain: parameter dtype: expected an integer in [-2**63, 2**63) or a word"),
    (["axpy", "dtype="], "explain: parameter dtype: expected an integer in [-2**63, 2**63) or a word"),
    (["axpy", "d type=f32"], "explain: expected NAME=VALUE with NAME an identifier, got 'd type=f32'"),
    (["axpy", "vec=1", "vec=2"], "explain: parameter vec is given twice"),
    (["axpy", "vec=1", "--arch", "sm_9"], "invalid arch 'sm_9': expected 'sm_<major><minor>'"),
    (["ax/py", "vec=1"], "explain: expected a JIT key (xxh3:<32 hex>) or a family name like 'axpy', got 'ax/py'"),
])
def test_explain_refuses_a_malformed_point_in_one_line(make_release, cli, tmp_path: Path, args, why) -> None:
    release = make_release(n=2, archs=("sm_90a",))
    out = cli(["explain", *args, "--manifest", str(release.path)], child_env(tmp_path / "home"), timeout=60)
    assert out.returncode == 2, out.stdout
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"cubinstore: error: {why}"), out.stderr
