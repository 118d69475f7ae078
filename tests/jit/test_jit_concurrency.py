"""Single flight and crashes: N processes compile one key once; a compile killed at any stage
leaves no index entry and no partial blob, and the next compile succeeds (real nvcc, no GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.children import read_line  # noqa: E402
from helpers.jit import ENTRIES, TU, child_env, counting_toolkit, make_library  # noqa: E402

from cubinstore import Digest, jit  # noqa: E402
from cubinstore.internals import JitIndex  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"
PROCESSES = 16
SIGNAL_TIMEOUT_S = 120  # only bounds a broken child; the test never sleeps on a timer


def _compile_call(include: Path, factor: int, module: str = "jit", extra: str = "") -> str:
    return (f"{module}.compile({TU!r}, include_dirs=[{str(include)!r}], flags=['-DFACTOR={factor}'], "
            f"arch={ARCH!r}, entries={ENTRIES!r}{', ' + extra if extra else ''})")


def test_sixteen_processes_missing_one_key_run_nvcc_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    include = make_library(tmp_path / "lib")
    log = tmp_path / "nvcc.log"
    toolkit = counting_toolkit(tmp_path / "cuda", log)
    env = child_env(home, CUDA_PATH=str(toolkit))
    code = (
        "import sys\nfrom cubinstore import jit\n"
        "print('ready', flush=True)\nsys.stdin.readline()\n"
        f"k = {_compile_call(include, 2)}\n"
        "print(k.compiled, k.digest, flush=True)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(PROCESSES)]
    try:
        for p in procs:
            assert read_line(p, "ready", SIGNAL_TIMEOUT_S) == "ready"
        for p in procs:  # all imported and waiting: release them together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err
            results.append(out.split())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    compiles = [line for line in log.read_text().splitlines() if " -cubin " in f" {line} "]
    assert len(compiles) == 1, compiles
    assert sorted(r[0] for r in results) == ["False"] * (PROCESSES - 1) + ["True"]
    assert len({r[1] for r in results}) == 1


# Where the child stops and waits to be killed. Each stage wraps one step of the compile: a
# public method of the child's own index or CAS subclass, passed in through
# ``compile(make_index=...)`` or ``compile(store=...)``, or nvcc itself through ``compile(nvcc=...)`` (``kw``).
_STAGES = {
    "lock_held_before_nvcc": """
class Index(JitIndex):
    def put_parts(self, *a):
        super().put_parts(*a); stop("lock_held_before_nvcc")
kw["make_index"] = Index
""",
    "nvcc_running": """
def run_nvcc(argv, work):
    p = subprocess.Popen(argv, cwd=work, env=dict(ACTION_ENV, TMPDIR=str(work / "tmp")))
    stop("nvcc_running")
kw["nvcc"] = run_nvcc
""",
    "cubin_in_memory_not_stored": """
class Local(LocalLayer):
    def write(self, digest, data):  # the CUBIN is compiled, read back and checked; the CAS write is next
        stop("cubin_in_memory_not_stored")
kw["store"] = Store([Local(os.environ["CUBINSTORE_HOME"])])
""",
    "cubin_stored_index_not_written": """
class Index(JitIndex):
    def put(self, entry):
        stop("cubin_stored_index_not_written")
kw["make_index"] = Index
""",
    "index_half_written": """
from cubinstore.manifest import dumps_canonical
class Index(JitIndex):
    def put(self, entry):
        data = dumps_canonical(entry.to_json())
        with self.local.stream_file(*self._at("index", entry.key)) as f:
            f.write(data[: len(data) // 2]); f.flush(); stop("index_half_written")
kw["make_index"] = Index
""",
}

_CHILD = """
import os, subprocess, sys
from cubinstore.internals import ACTION_ENV, JitIndex, compiler
from cubinstore.store import LocalLayer, Store
kw = {}
def stop(stage):
    print(stage, flush=True)
    sys.stdin.readline()  # the parent kills us here
    raise SystemExit("not killed")
"""


@pytest.mark.parametrize("stage", list(_STAGES))
def test_compile_killed_at_each_stage_leaves_no_entry_and_recovers(stage: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    include = make_library(tmp_path / "lib")
    factor = 10 + list(_STAGES).index(stage)
    code = _CHILD + _STAGES[stage] + f"{_compile_call(include, factor, 'compiler', '**kw')}\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env(home), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert read_line(proc, stage, SIGNAL_TIMEOUT_S) == stage
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and any nvcc it started
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    store = Store([LocalLayer(home)])
    key = jit.key(TU, include_dirs=[include], flags=[f"-DFACTOR={factor}"], arch=ARCH, store=store)
    index = JitIndex(LocalLayer(home))
    assert index.get(key.hex) is None
    assert not (home / "v1" / "jit" / "index" / key.hex[:2] / f"{key.hex}.json").exists()
    local = LocalLayer(home)
    entries, _ = local.scan()
    for entry in entries:  # whatever reached a final CAS path is complete
        assert Digest.of(entry.path.read_bytes()) == entry.digest

    started = time.monotonic()
    k = jit.compile(TU, include_dirs=[include], flags=[f"-DFACTOR={factor}"], arch=ARCH, entries=ENTRIES,
                    store=store)
    assert time.monotonic() - started < 300
    assert k.compiled is True and index.get(key.hex).digest == k.digest
    assert not list((home / "v1" / "jit" / "tmp").glob(f"{key.hex}.*"))  # the killed compile's directory is gone
    assert not list((home / "v1" / "jit" / "index").glob(f"*/.tmp.{key.hex}.*"))  # and its half-written entry
