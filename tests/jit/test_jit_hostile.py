"""The JIT against store files someone else wrote and programs that misbehave: a dependency list
naming a path out of its root, a TU path that is a FIFO, a toolkit whose ``nvcc --version`` does
not stop printing (real files, real processes, no GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import TU, child_env, make_library, run_child  # noqa: E402

from cubinstore import jit  # noqa: E402
from cubinstore.errors import BadArgumentError, StoreError  # noqa: E402
from cubinstore.internals import JitIndex, direct  # noqa: E402
from cubinstore.store import LocalLayer  # noqa: E402

ARCH = "sm_90a"
KEY = "0123456789abcdef0123456789abcdef"
CHILD_TIMEOUT_S = 120  # bounds a child that blocks (the regression), never a measurement
DIGEST = "xxh3:" + "0" * 32


def _deps(home: Path, files: list[list[str]]) -> JitIndex:
    local = LocalLayer(home)
    doc = {"schema": "cubinstore/jit-deps/v1", "key": KEY, "files": files, "shapes": {"inc/0": "x", "cuda": "y"}}
    local.write_file(("jit", "deps", KEY[:2]), f"{KEY}.json", json.dumps(doc).encode())
    return JitIndex(local)


# nvcc's own spellings: the toolkit's headers through bin/.., a header's #include "../x.h" and "./x.h".
NVCC_SPELLINGS = [["cuda", "bin/../targets/x86_64-linux/include/cooperative_groups/../cooperative_groups.h", DIGEST],
                  ["inc/0", "mylib/./twice.cuh", DIGEST], ["inc/0", "a/b/../../c.h", DIGEST]]


@pytest.mark.parametrize("rel", ["../pipe.h", "sbin/../../etc/hostname", "bin/../../x.h", "/etc/hostname", "a//b.h",
                                 "a/b.h/..", "", "x.h\x1b]0;owned\x07", 7])
def test_a_deps_file_naming_a_path_out_of_its_root_is_a_store_error_naming_both(tmp_path: Path, rel: object) -> None:
    got = _deps(tmp_path / "home", NVCC_SPELLINGS).get_deps(KEY)
    assert got is not None and got[0] == [tuple(f) for f in NVCC_SPELLINGS]
    index = _deps(tmp_path / "home", [*NVCC_SPELLINGS, ["inc/0", rel, DIGEST]])
    where = index.dir / "deps" / KEY[:2] / f"{KEY}.json"
    with pytest.raises(StoreError) as caught:
        index.get_deps(KEY)
    assert str(caught.value).startswith(f"JIT deps file {where}: 'inc/0' file {rel!r} is not a path below its root")


def test_hash_deps_never_reads_a_file_above_its_root(tmp_path: Path) -> None:
    include = make_library(tmp_path / "lib")
    (include / "sbin").mkdir()
    host = tmp_path / "lib" / "etc" / "hostname"  # one level above the include root
    host.parent.mkdir()
    host.write_text("build-host-7\n")
    roots = direct.Roots(labels=("inc/0",), base=(str(include),), tree=(str(include),))
    assert direct.hash_deps([("inc/0", "sbin/../../etc/hostname")], roots) is None
    assert direct.hash_deps([("inc/0", "mylib/twice.cuh")], roots) is not None


def test_a_tu_path_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    include = make_library(tmp_path / "lib")
    fifo = tmp_path / "kernel.cu"
    os.mkfifo(fifo)  # nobody writes it: a blocking open never returns
    code = (
        "from pathlib import Path\nfrom cubinstore import jit\nfrom cubinstore.errors import BadArgumentError\n"
        "try:\n"
        f"    jit.key(Path({str(fifo)!r}), include_dirs=[{str(include)!r}], arch={ARCH!r})\n"
        "    print('no error')\n"
        "except BadArgumentError as exc:\n"
        "    print('BadArgumentError:', exc)\n"
    )
    out = run_child(code, child_env(tmp_path / "home"), timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"BadArgumentError: cannot read JIT source {fifo}: it is a FIFO; expected a regular file")


def test_a_toolkit_whose_nvcc_version_does_not_stop_is_refused(tmp_path: Path, clean_env: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "nvvm" / "bin").mkdir(parents=True)
    (toolkit / "nvvm" / "bin" / "cicc").write_bytes(b"")
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nhead -c 4000000 /dev/zero | tr '\\0' x\n")  # 4 MB, where a version is one line
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    jit.clear_caches()
    try:
        with pytest.raises(BadArgumentError, match=rf"^CUDA toolkit: {nvcc} --version printed over 1048576 bytes and was killed"):
            jit.key(TU, include_dirs=[make_library(tmp_path / "lib")], arch=ARCH)
    finally:
        jit.clear_caches()
