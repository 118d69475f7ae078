"""cubinstore-nvcc, run as a library's JIT runs nvcc (real nvcc, real processes, no GPU).

Every real nvcc run is counted through a ``CUBINSTORE_NVCC`` shim that appends a line to a log;
"a hit" below means the call produced its CUBIN with no new line there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="cubinstore-nvcc needs the jit extra (xxhash)")

from helpers.jit import child_env, real_toolkit  # noqa: E402

WRAPPER = Path(sys.executable).with_name("cubinstore-nvcc")
ARCH = "sm_90a"
TWICE = "#pragma once\ntemplate <typename T> __device__ T twice(T x) { return x + x; }\n"
# A TU like a library's generated one: quoted and angle includes of the library's headers.
TU = """#include <mylib/twice.cuh>
#include "mylib/extra.cuh"
extern "C" __global__ void scale(int n, float a, float* x) {
  int unused_here;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = twice(x[i]) * a * EXTRA;
}
"""
EXTRA = "#pragma once\n#define EXTRA 3\n"


def _library(prefix: Path) -> Path:
    include = prefix / "lib" / "python3.11" / "site-packages" / "mylib" / "include"
    (include / "mylib").mkdir(parents=True)
    (include / "mylib" / "twice.cuh").write_text(TWICE)
    (include / "mylib" / "extra.cuh").write_text(EXTRA)
    return include


def _shim(dest: Path, log: Path, gate: Path | None = None) -> Path:
    """A CUBINSTORE_NVCC that logs each run (and, with ``gate``, waits for it to exist first)."""
    real = real_toolkit() / "bin" / "nvcc"
    wait = f'echo "start $$" >> "{log}"\nwhile [ ! -e "{gate}" ]; do sleep 0.02; done\n' if gate else ""
    dest.write_text(f'#!/bin/sh\necho "run $$" >> "{log}"\n{wait}"{real}" "$@"\nrc=$?\necho "done $$" >> "{log}"\nexit $rc\n')
    dest.chmod(0o755)
    return dest


def _runs(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("run ")) if log.exists() else 0


@pytest.fixture
def t(tmp_path: Path) -> SimpleNamespace:
    log = tmp_path / "nvcc.log"
    ns = SimpleNamespace(base=tmp_path, home=tmp_path / "home", log=log, shim=_shim(tmp_path / "nvcc-shim", log),
                         include=_library(tmp_path / "venv"))
    ns.env = child_env(ns.home, CUBINSTORE_NVCC=str(ns.shim))
    return ns


def _call(t: SimpleNamespace, include: Path | list[Path], *extra: str, cache: Path | None = None, tu: str = TU,
          nvcc: Path = WRAPPER, env: dict[str, str] | None = None, name: str = "u1", kind: str = "cubin") -> SimpleNamespace:
    """The library JIT's call: TU at <cache>/tmp/<name>/kernel.cu, run from <cache>/tmp."""
    cache = cache or t.base / "cache"
    work = cache / "tmp" / name
    work.mkdir(parents=True, exist_ok=True)
    (work / "kernel.cu").write_text(tu)
    out = work / f"kernel.{kind}"
    out.unlink(missing_ok=True)
    roots = include if isinstance(include, list) else [include]
    argv = [str(nvcc), str(work / "kernel.cu"), f"-{kind}", "-o", str(out), "-std=c++17", *(f"-I{r}" for r in roots),
            f"--gpu-architecture={ARCH}", "-O3", *extra]
    before = _runs(t.log)
    proc = subprocess.run(argv, cwd=cache / "tmp", env=env or t.env, capture_output=True, timeout=300)
    return SimpleNamespace(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, argv=argv,
                           cubin=out.read_bytes() if out.exists() else None, runs=_runs(t.log) - before, work=work)


def _without_times(text: bytes) -> bytes:
    return b"\n".join(line for line in text.splitlines() if b"Compile time" not in line)


# -- pass-through ------------------------------------------------------------------------------------

def test_version_is_nvccs_byte_for_byte(t: SimpleNamespace) -> None:
    real = subprocess.run([str(real_toolkit() / "bin" / "nvcc"), "--version"], capture_output=True, env=t.env)
    ours = subprocess.run([str(WRAPPER), "--version"], capture_output=True, env=t.env)
    assert (ours.returncode, ours.stdout, ours.stderr) == (real.returncode, real.stdout, real.stderr)
    assert b"release 13." in ours.stdout or b"release 12." in ours.stdout  # what DeepGEMM parses


def test_pass_through_calls_are_nvccs(t: SimpleNamespace) -> None:
    (t.base / "k.cu").write_text(TU.replace("<mylib/twice.cuh>", '"nope.cuh"'))
    for args in (["-c", "k.cu", "-o", "k.o", f"-I{t.include}"], ["k.cu", "-cubin", "-o", "k.cubin", f"-I{t.include}",
                                                               f"-arch={ARCH}"]):
        real = subprocess.run([str(real_toolkit() / "bin" / "nvcc"), *args], cwd=t.base, capture_output=True, env=t.env)
        ours = subprocess.run([str(WRAPPER), *args], cwd=t.base, capture_output=True, env=t.env)
        assert real.returncode != 0 and b"nope.cuh" in real.stderr
        assert (ours.returncode, ours.stdout, ours.stderr) == (real.returncode, real.stdout, real.stderr), args
    assert not (t.home / "v1" / "nvcc" / "calls").exists()  # a failing compile records nothing


def test_it_never_runs_itself(t: SimpleNamespace) -> None:
    env = dict(t.env, CUBINSTORE_NVCC=str(WRAPPER))
    proc = subprocess.run([str(WRAPPER), "--version"], capture_output=True, env=env, timeout=60)
    assert proc.returncode != 0 and b"cubinstore-nvcc itself" in proc.stderr
    # Installed as `nvcc` first on PATH, with no CUBINSTORE_NVCC: the toolkit's nvcc runs.
    bindir = t.base / "bin"
    bindir.mkdir()
    (bindir / "nvcc").symlink_to(WRAPPER)
    env = {k: v for k, v in t.env.items() if k != "CUBINSTORE_NVCC"}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["nvcc", "--version"], capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0 and b"Cuda compilation tools" in proc.stdout


# -- hits, misses and what is replayed -----------------------------------------------------------------

def test_a_hit_replays_the_compile_and_runs_no_nvcc(t: SimpleNamespace) -> None:
    verbose = ("--ptxas-options=--verbose",)
    first = _call(t, t.include, *verbose)
    assert first.rc == 0 and first.runs == 1 and first.cubin[:4] == b"\x7fELF"
    # nvcc's own messages for the same call, with the same names.
    real = subprocess.run([str(real_toolkit() / "bin" / "nvcc"), *first.argv[1:]], cwd=t.base / "cache" / "tmp",
                          capture_output=True, env=t.env)
    assert _without_times(first.stderr) == _without_times(real.stderr)
    assert b"unused_here" in first.stderr and f"{first.work}/kernel.cu".encode() in first.stderr
    assert b"Used " in first.stderr and b"registers" in first.stderr  # ptxas -v: what DeepGEMM greps
    again = _call(t, t.include, *verbose, cache=t.base / "other-cache", name="u2")
    assert again.rc == 0 and again.runs == 0 and again.cubin == first.cubin
    # The replay names this call's TU, not the first one's.
    assert again.stderr == first.stderr.replace(str(first.work).encode(), str(again.work).encode())
    assert again.stdout == first.stdout


@pytest.mark.parametrize("kind, magic", [("ptx", b"//"), ("fatbin", b"\x50\xed\x55\xba")])
def test_ptx_and_fatbin_calls_are_cached_too(t: SimpleNamespace, kind: str, magic: bytes) -> None:
    first = _call(t, t.include, kind=kind)
    assert first.rc == 0 and first.runs == 1 and first.cubin.startswith(magic), first.stderr
    if kind == "ptx":
        assert b".entry scale" in first.cubin
    again = _call(t, _library(t.base / "elsewhere"), kind=kind, cache=t.base / "cache2")
    assert (again.rc, again.runs, again.cubin) == (0, 0, first.cubin)
    # A cubin of the same TU is another call: compiled, and an ELF image.
    cubin = _call(t, t.include)
    assert cubin.runs == 1 and cubin.cubin[:4] == b"\x7fELF"


def test_a_library_at_any_prefix_hits(t: SimpleNamespace) -> None:
    first = _call(t, t.include)
    deep = _library(t.base / "opt" / "envs" / "serving-v2" / "x")
    shared = t.base / "symlinked" / "include"
    shared.parent.mkdir()
    shared.symlink_to(deep)
    copies = [deep, shared]
    for i, include in enumerate(copies):
        got = _call(t, include, cache=t.base / f"cache{i}")
        assert (got.rc, got.runs, got.cubin) == (0, 0, first.cubin), include


def test_what_a_lookup_can_find_decides_hit_or_miss(t: SimpleNamespace) -> None:
    first_root = t.base / "first" / "include"  # searched before the library's root
    first_root.mkdir(parents=True)
    base = _call(t, [first_root, t.include])
    assert base.runs == 1
    # Files no lookup of the TU could find: hits.
    (t.include / "README").write_text("docs\n")
    (t.include / "mylib" / "helper.py").write_text("x = 1\n")
    (t.include / "__pycache__").mkdir()
    (t.include / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"\0" * 16)
    (first_root / "NOTES.md").write_text("notes\n")
    assert _call(t, [first_root, t.include]).runs == 0
    # A header placed earlier in the search path, where a lookup of the TU would find it first: a miss.
    (first_root / "mylib").mkdir()
    (first_root / "mylib" / "twice.cuh").write_text(TWICE.replace("x + x", "x + x + x"))
    shadowed = _call(t, [first_root, t.include])
    assert shadowed.runs == 1 and shadowed.cubin != base.cubin
    shutil.rmtree(first_root / "mylib")
    assert _call(t, [first_root, t.include]).runs == 0  # back as it was: the first record holds again
    # A header the TU read, changed: a miss.
    (t.include / "mylib" / "extra.cuh").write_text(EXTRA.replace("3", "5"))
    changed = _call(t, [first_root, t.include])
    assert changed.runs == 1 and changed.cubin != base.cubin


def test_a_header_read_by_absolute_path_is_keyed_by_its_content(t: SimpleNamespace) -> None:
    outside = t.base / "etc" / "factor.h"
    outside.parent.mkdir()
    outside.write_text("#define FACTOR 2\n")
    tu = f'#include "{outside}"\n' + TU.replace("* EXTRA", "* EXTRA * FACTOR")
    first = _call(t, t.include, tu=tu)
    assert first.runs == 1
    assert _call(t, t.include, tu=tu, name="u2").runs == 0
    outside.write_text("#define FACTOR 4\n")
    changed = _call(t, t.include, tu=tu, name="u3")
    assert changed.runs == 1 and changed.cubin != first.cubin


def test_16_processes_asking_for_one_kernel_run_one_nvcc(t: SimpleNamespace) -> None:
    procs = []
    for i in range(16):
        work = t.base / "cache" / "tmp" / f"r{i}"
        work.mkdir(parents=True)
        (work / "kernel.cu").write_text(TU)
        argv = [str(WRAPPER), str(work / "kernel.cu"), "-cubin", "-o", str(work / "kernel.cubin"),
                f"-I{t.include}", f"-arch={ARCH}"]
        procs.append((work, subprocess.Popen(argv, env=t.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    outs = []
    for work, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append((work / "kernel.cubin").read_bytes())
    assert _runs(t.log) == 1
    assert len(set(outs)) == 1 and outs[0][:4] == b"\x7fELF"


def test_a_killed_compile_leaves_nothing_half_written(t: SimpleNamespace) -> None:
    gate = t.base / "go"
    env = dict(t.env, CUBINSTORE_NVCC=str(_shim(t.base / "gated-shim", t.log, gate)))
    work = t.base / "cache" / "tmp" / "k"
    work.mkdir(parents=True)
    (work / "kernel.cu").write_text(TU)
    out = work / "kernel.cubin"
    argv = [str(WRAPPER), str(work / "kernel.cu"), "-cubin", "-o", str(out), f"-I{t.include}", f"-arch={ARCH}"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while "start" not in (t.log.read_text() if t.log.exists() else ""):  # nvcc is running under the wrapper
        assert proc.poll() is None, "the wrapper exited before nvcc started"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    gate.touch()  # let the orphaned nvcc finish, then wait for it: nothing it writes may be taken
    while "done" not in t.log.read_text():
        time.sleep(0.01)
    assert not out.exists() and not [p for p in work.iterdir() if p.name != "kernel.cu"]
    assert not (t.home / "v1" / "nvcc" / "calls").exists() or not any((t.home / "v1" / "nvcc" / "calls").rglob("*.json"))
    again = _call(t, t.include, env=env, name="k")
    assert again.rc == 0 and again.runs == 1 and again.cubin[:4] == b"\x7fELF"
    assert _call(t, t.include, env=env, name="k2").runs == 0


# -- across hosts ------------------------------------------------------------------------------------------

def test_ci_publishes_and_a_fresh_host_hits_from_the_remote(t: SimpleNamespace, nginx) -> None:
    url = nginx.base()
    ci = dict(t.env, CUBINSTORE_REMOTE=url, CUBINSTORE_NVCC_PUBLISH="1")
    first = _call(t, t.include, env=ci)
    assert first.rc == 0 and first.runs == 1, first.stderr
    fresh = child_env(t.base / "fresh-home", CUBINSTORE_NVCC=str(t.shim), CUBINSTORE_REMOTE=url)
    other = _library(t.base / "elsewhere" / "prefix")
    got = _call(t, other, env=fresh, cache=t.base / "fresh-cache")
    assert (got.rc, got.runs, got.cubin) == (0, 0, first.cubin), got.stderr
    # Then locally, without the remote.
    offline = dict(fresh, CUBINSTORE_REMOTE="")
    assert _call(t, other, env=offline, cache=t.base / "fresh-cache2").runs == 0
    # A fresh host whose headers differ from the published record's compiles.
    (other / "mylib" / "extra.cuh").write_text(EXTRA.replace("3", "7"))
    fresh2 = child_env(t.base / "fresh-home2", CUBINSTORE_NVCC=str(t.shim), CUBINSTORE_REMOTE=url)
    differs = _call(t, other, env=fresh2, cache=t.base / "fresh-cache3")
    assert differs.rc == 0 and differs.runs == 1 and differs.cubin != first.cubin


def test_a_remote_blob_that_does_not_verify_is_never_loaded(t: SimpleNamespace, nginx) -> None:
    url = nginx.base()
    ci = dict(t.env, CUBINSTORE_REMOTE=url, CUBINSTORE_NVCC_PUBLISH="1")
    first = _call(t, t.include, env=ci)
    digest = json.loads(next((t.home / "v1" / "nvcc" / "calls").rglob("*.json")).read_text())["records"][0]["digest"]
    blob = nginx.file(url, digest.split(":")[1])
    blob.write_bytes(b"\x7fELF" + bytes(len(first.cubin) - 4))  # same size, other bytes
    fresh = child_env(t.base / "fresh-home", CUBINSTORE_NVCC=str(t.shim), CUBINSTORE_REMOTE=url)
    got = _call(t, t.include, env=fresh, cache=t.base / "fresh-cache")
    assert got.rc == 0 and got.runs == 1 and got.cubin == first.cubin


def test_explain_says_why_a_call_missed(t: SimpleNamespace) -> None:
    first_root = t.base / "first" / "include"
    first_root.mkdir(parents=True)
    base = _call(t, [first_root, t.include])
    cli = Path(sys.executable).with_name("cubinstore")

    def explain(call: SimpleNamespace) -> str:
        proc = subprocess.run([str(cli), "explain", "--nvcc", *call.argv[1:]], cwd=t.base / "cache" / "tmp", env=t.env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "holds: the call is a hit" in explain(base)
    (first_root / "mylib").mkdir()
    (first_root / "mylib" / "twice.cuh").write_text(TWICE)
    assert "does not hold: inc/0/mylib/twice.cuh appeared" in explain(base)
    shutil.rmtree(first_root / "mylib")
    (t.include / "mylib" / "extra.cuh").write_text(EXTRA.replace("3", "5"))
    assert "does not hold: inc/1/mylib/extra.cuh changed" in explain(base)
    # No record of the call key: the JIT key's parts against the nearest key this store knows.
    other = _call(t, [first_root, t.include], "-DFACTOR=2", name="u9")
    (other.work / "kernel.cu").write_text(TU)
    report = explain(SimpleNamespace(argv=[*other.argv[:-1], "-DFACTOR=3"]))
    assert "no record" in report and "flags" in report
    # A call it does not cache says which word makes it a pass-through.
    assert "not cached: option '--keep'" in explain(SimpleNamespace(argv=[*base.argv, "--keep"]))


def test_a_remote_record_never_makes_a_host_read_a_file_outside_its_roots(t: SimpleNamespace, nginx) -> None:
    url = nginx.base()
    outside = t.base / "etc" / "factor.h"
    outside.parent.mkdir()
    outside.write_text("#define FACTOR 2\n")
    tu = f'#include "{outside}"\n' + TU.replace("* EXTRA", "* EXTRA * FACTOR")
    ci = dict(t.env, CUBINSTORE_REMOTE=url, CUBINSTORE_NVCC_PUBLISH="1")
    assert _call(t, t.include, env=ci, tu=tu).runs == 1  # published, with its outside file in the record
    fresh = child_env(t.base / "fresh-home", CUBINSTORE_NVCC=str(t.shim), CUBINSTORE_REMOTE=url)
    got = _call(t, t.include, env=fresh, tu=tu, cache=t.base / "fresh-cache")
    assert got.rc == 0 and got.runs == 1  # refused: compiled here, which reads the file itself
    assert b"outside the include roots" not in got.stderr  # a log line, not the library's output
