"""cubinstore-nvcc against a store or a remote someone else wrote: a FIFO or a path out of a root
named by the JIT's dependency list, a call record naming a file above its root, a toolchain record
naming odd paths, a remote record nested past the parser, and control characters in a replay
(real nvcc, real processes, a real nginx, no GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

xxhash = pytest.importorskip("xxhash", reason="cubinstore-nvcc needs the jit extra (xxhash)")

from helpers.jit import child_env, real_toolkit  # noqa: E402

from cubinstore import Digest  # noqa: E402
from cubinstore.internals import calls, remote  # noqa: E402
from cubinstore.store import HttpLayer, LocalLayer, Store  # noqa: E402
from cubinstore.store.action_result import ActionResult, OutputFile, action_digest_for  # noqa: E402

WRAPPER = Path(sys.executable).with_name("cubinstore-nvcc")
ARCH = "sm_90a"
TU = '#include "mylib/extra.cuh"\nextern "C" __global__ void scale(float* x) { x[0] *= EXTRA; }\n'
PROMPT_S = 120  # a call that blocks on a FIFO never returns; one that refuses it takes seconds
KEY = "0123456789abcdef0123456789abcdef"


def _xxh3(data: bytes) -> str:
    return "xxh3:" + xxhash.xxh3_128_hexdigest(data)


@pytest.fixture
def t(tmp_path: Path) -> SimpleNamespace:
    include = tmp_path / "lib" / "include"
    (include / "mylib").mkdir(parents=True)
    (include / "mylib" / "extra.cuh").write_text("#pragma once\n#define EXTRA 3\n")
    home = tmp_path / "home"
    return SimpleNamespace(base=tmp_path, home=home, include=include,
                           env=child_env(home, CUBINSTORE_NVCC=str(real_toolkit() / "bin" / "nvcc")))


def _call(t: SimpleNamespace, env: dict[str, str] | None = None) -> SimpleNamespace:
    work = t.base / "work"
    work.mkdir(exist_ok=True)
    (work / "kernel.cu").write_text(TU)
    out = work / "kernel.cubin"
    out.unlink(missing_ok=True)
    argv = [str(WRAPPER), str(work / "kernel.cu"), "-cubin", "-o", str(out), f"-I{t.include}", f"-arch={ARCH}"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=work, env=env or t.env, capture_output=True, timeout=PROMPT_S)
    return SimpleNamespace(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, seconds=time.monotonic() - started,
                           cubin=out.read_bytes() if out.exists() else None)


def _only(home: Path, kind: str) -> Path:
    found = sorted((home / "v1").glob(f"{kind}/*/*.json"))
    assert len(found) == 1, found
    return found[0]


def _rewrite(path: Path, doc: dict) -> None:
    path.unlink()  # the store's files are read-only
    path.write_bytes(calls.canonical(doc))


def _add_dep(t: SimpleNamespace, label: str, rel: str) -> Path:
    """The first call's JIT dependency list, with one more file; its call record dropped (a miss)."""
    for record in (t.home / "v1" / "nvcc" / "calls").glob("*/*.json"):
        record.unlink()
    deps = _only(t.home, "jit/deps")
    doc = json.loads(deps.read_text())
    doc["files"].append([label, rel, _xxh3(b"")])
    _rewrite(deps, doc)
    return deps


# -- 1. the JIT's dependency list: a FIFO never blocks, a path out of its root is an error ----------

def test_a_deps_file_naming_a_fifo_out_of_its_root_fails_promptly_naming_both(t: SimpleNamespace) -> None:
    first = _call(t)
    assert first.rc == 0 and first.cubin[:4] == b"\x7fELF", first.stderr
    os.mkfifo(t.include.parent / "pipe.h")  # nobody writes it: an open for reading blocks
    deps = _add_dep(t, "inc/0", "../pipe.h")
    got = _call(t)
    assert got.rc == 0 and got.cubin[:4] == b"\x7fELF", got.stderr  # the real nvcc answered
    assert got.stderr.decode().startswith(
        f"cubinstore-nvcc: JIT deps file {deps}: 'inc/0' file '../pipe.h' is not a path below its root"), got.stderr
    assert not list((t.home / "v1" / "nvcc" / "calls").glob("*/*.json"))


def test_a_fifo_inside_a_root_is_not_read_and_the_call_not_recorded(t: SimpleNamespace) -> None:
    # The toolkit's root outside its include tree: no key or shape covers it, so only the
    # record's reader meets the FIFO there.
    real = real_toolkit()
    toolkit = t.base / "cuda"
    toolkit.mkdir()
    for item in real.iterdir():
        (toolkit / item.name).symlink_to(item)
    env = child_env(t.home, CUDA_PATH=str(toolkit), CUBINSTORE_NVCC=str(toolkit / "bin" / "nvcc"))
    first = _call(t, env)
    assert first.rc == 0 and first.cubin[:4] == b"\x7fELF", first.stderr
    os.mkfifo(toolkit / "pipe.h")
    _add_dep(t, "cuda", "pipe.h")
    got = _call(t, env)
    assert (got.rc, got.cubin) == (0, first.cubin), got.stderr  # the JIT's CUBIN, found by its key
    assert b"cubinstore-nvcc" not in got.stderr
    assert not list((t.home / "v1" / "nvcc" / "calls").glob("*/*.json"))  # nothing read, nothing recorded


# -- 2. a call record names paths below its roots, a toolchain record absolute paths of words ---------

def _record(files: list[list[str]], absent: list[list[str]]) -> dict:
    return {"key": KEY, "digest": "sha256:" + "0" * 64, "size": 1, "files": files, "absent": absent, "outside": [],
            "stdout": "", "stderr": ""}


@pytest.mark.parametrize("rel", ["sbin/../../etc/hostname", "bin/../../etc/hostname", "bin/../bin/../../etc/hostname",
                                 "/etc/hostname", "mylib/./x.h", "mylib//x.h"])
def test_a_record_naming_a_path_out_of_the_grammar_is_refused_unread(t: SimpleNamespace, rel: str) -> None:
    (t.include / "sbin").mkdir()
    (t.include / "bin").mkdir()
    secret = t.include.parent / "etc" / "hostname"  # one level above the include root: a host file
    secret.parent.mkdir()
    secret.write_text("build-host-7\n")
    where = {"inc/0": str(t.include)}
    for record in (_record([["inc/0", rel, _xxh3(secret.read_bytes())]], []), _record([], [["inc/0", rel]])):
        assert calls.record_problem(record) in ("files", "absent")
        assert calls.check(record, where) == f"inc/0/{rel!r} is not a path below its root"
    # nvcc's own spelling of the toolkit's headers still checks.
    header = t.include / "mylib" / "extra.cuh"
    good = _record([["cuda", "bin/../mylib/extra.cuh", _xxh3(header.read_bytes())]], [["cuda", "bin/../mylib/none.h"]])
    assert calls.record_problem(good) is None and calls.check(good, {"cuda": str(t.include)}) is None


@pytest.mark.parametrize("field, value", [("toolkit", "/opt/../etc"), ("toolkit", "cuda"), ("program", "nvcc"),
                                          ("paths", "/etc/../root/x"), ("paths", "relative/nvcc")])
def test_a_toolchain_record_naming_odd_paths_is_not_taken(t: SimpleNamespace, field: str, value: str) -> None:
    program = t.base / "bin" / "nvcc"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    st = os.stat(program)
    name = "ab" + "0" * 30
    doc = {"schema": calls.ENV_SCHEMA, "name": name, "identity": KEY, "toolkit": str(t.base), "program": str(program),
           "program_id": None, "paths": [str(program)], "facts": [[st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                                   st.st_ctime_ns]]}
    at = t.home / "v1" / "nvcc" / "env" / name[:2] / f"{name}.json"
    at.parent.mkdir(parents=True)
    at.write_bytes(calls.canonical(doc))
    assert calls.read_env(str(t.home), name) == doc
    doc[field] = [value] if field == "paths" else value
    if field == "paths":
        doc["facts"] = [None]
    _rewrite(at, doc)
    assert calls.read_env(str(t.home), name) is None


# -- 3. a replay shows nvcc's words, never a terminal's commands --------------------------------------

def test_control_characters_in_a_record_are_not_replayed(t: SimpleNamespace) -> None:
    first = _call(t)
    assert first.rc == 0
    path = _only(t.home, "nvcc/calls")
    doc = json.loads(path.read_text())
    raw_csi = b"\x9b".decode("utf-8", "surrogateescape")  # nvcc's byte 0x9b, not UTF-8, as records keep it
    doc["records"][0]["stderr"] = ("warning:\x1b]0;owned\x07 see\tthis\x1b[2J\x1b[1;31m here\x1b[0m\r\n"
                                   f"fake prompt\rover\x9b2J{raw_csi}3J\x00\x7f\x08 end\n")
    _rewrite(path, doc)
    got = _call(t)
    assert got.rc == 0 and got.cubin == first.cubin
    assert got.stderr == b"warning: see\tthis here\r\nfake promptover2J3J end\n"


# -- 4. a remote's record: a malformed one is a miss, a large one is not fetched ---------------------

def _publish(url: str, record: OutputFile) -> None:
    cubin = b"\x7fELF" + bytes(60)
    result = ActionResult(output_files=(OutputFile("kernel.cubin", Digest(hashlib.sha256(cubin).hexdigest()), len(cubin)),
                                        record))
    HttpLayer(url).put_action_result(action_digest_for(remote.SCHEME, KEY), result.encode())


def test_a_remote_record_nested_past_the_parser_is_a_miss(tmp_path: Path, nginx) -> None:
    url = nginx.base()
    nested = b"[" * 200_000 + b"]" * 200_000
    _publish(url, OutputFile("call.json", Digest(hashlib.sha256(nested).hexdigest()), len(nested), contents=nested))
    store = Store([LocalLayer(tmp_path / "home"), HttpLayer(url)])
    assert remote.fetch(store, KEY, {"inc/0": str(tmp_path)}) is None


def test_a_remote_record_over_the_record_limit_is_never_fetched(tmp_path: Path, nginx) -> None:
    url = nginx.base()
    big = hashlib.sha256(b"a record no writer of ours makes").hexdigest()
    _publish(url, OutputFile("call.json", Digest(big), calls.MAX_RECORD_BYTES + 1))
    store = Store([LocalLayer(tmp_path / "home"), HttpLayer(url)])
    assert remote.fetch(store, KEY, {"inc/0": str(tmp_path)}) is None
    assert nginx.requests("GET", big) == 0
