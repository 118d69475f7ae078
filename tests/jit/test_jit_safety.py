"""The JIT's safety and key correctness (issue 27): the key covers every file a compile read,
``sealed`` compiles read nothing of the host, index entries are re-checked claims, keying is
streamed and refuses FIFOs and devices, and every compile has a time limit (real nvcc, no GPU)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import ENTRIES, TU, child_env, make_library, run_child  # noqa: E402

from cubinstore import errors, jit  # noqa: E402
from cubinstore.errors import BadArgumentError, JitCompileError, KernelNotFoundError  # noqa: E402
from cubinstore.internals import JitIndex  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"
CHILD_TIMEOUT_S = 300  # only bounds a broken child (a regression that blocks), never a measurement


@pytest.fixture
def lib(tmp_path: Path, clean_env: Path) -> Iterator[SimpleNamespace]:
    jit.clear_caches()
    home = clean_env  # tmp_path / "home", also CUBINSTORE_HOME
    include = make_library(tmp_path / "lib")
    host = tmp_path / "host"  # a directory outside every root: "the host's files"
    host.mkdir()
    yield SimpleNamespace(tmp=tmp_path, home=home, include=include, host=host, store=Store([LocalLayer(home)]))
    jit.clear_caches()


def _compile(lib: SimpleNamespace, source: str = TU, flags: tuple[str, ...] = (), store: Store | None = None,
             **kw) -> jit.JitKernel:
    return jit.compile(source, include_dirs=[lib.include], flags=list(flags), arch=ARCH,
                       entries=kw.pop("entries", ENTRIES), store=store or lib.store, **kw)


def _jit_files(home: Path, kind: str) -> list[Path]:
    return sorted((home / "v1" / "jit" / kind).glob("*/*.json"))


# -- 1. the key covers every file the TU read -------------------------------------------------------

def _outside_tu(header: Path, how: str) -> tuple[str, tuple[str, ...]]:
    """A TU that reads ``header`` by absolute path: spelled in the TU, or through a -D macro."""
    if how == "include_in_tu":
        return f'#include "{header}"\n' + TU, ()
    return "#include CFG\n" + TU, (f'-DCFG="{header}"',)


@pytest.mark.parametrize("how", ["include_in_tu", "define_then_include_macro"])
def test_a_changed_header_outside_the_roots_is_a_miss_under_another_key(lib: SimpleNamespace, how: str) -> None:
    header = lib.host / "cfg.h"
    header.write_text("#define FACTOR 2\n")
    source, flags = _outside_tu(header, how)
    first = _compile(lib, source, flags)
    assert first.compiled is True

    header.write_text("#define FACTOR 3\n")
    changed = _compile(lib, source, flags)
    assert changed.compiled is True
    assert changed.digest != first.digest and changed.key != first.key
    assert [p for p, _ in first.key.parts.outside] == [str(header)]  # the reported key covers the header
    base = jit.key(source, include_dirs=[lib.include], flags=list(flags), arch=ARCH, store=lib.store)
    assert base.parts == first.key.parts.base == changed.key.parts.base  # jit.key's, before compiling, cannot

    header.write_text("#define FACTOR 2\n")
    back = _compile(lib, source, flags)
    assert (back.compiled, back.key, back.digest) == (False, first.key, first.digest)
    jit.clear_caches()  # and from the files alone, as a fresh process sees them
    again = _compile(lib, source, flags)
    assert (again.compiled, again.key, again.digest) == (False, first.key, first.digest)


def test_one_reported_key_never_names_two_cubins(lib: SimpleNamespace) -> None:
    header = lib.host / "cfg.h"
    header.write_text("#define FACTOR 2\n")
    source, _ = _outside_tu(header, "include_in_tu")
    seen: dict[str, str] = {}
    for home, text in (("a", "2"), ("a", "5"), ("b", "5"), ("b", "2"), ("a", "2")):  # two stores, both contents
        header.write_text(f"#define FACTOR {text}\n")
        jit.clear_caches()
        k = _compile(lib, source, store=Store([LocalLayer(lib.tmp / home)]))
        assert seen.setdefault(str(k.key), str(k.digest)) == str(k.digest), f"{k.key} names two CUBINs"
    assert len(seen) == 2


def test_a_changed_outside_header_misses_through_the_direct_path_too(lib: SimpleNamespace) -> None:
    header = lib.host / "cfg.h"
    header.write_text("#define FACTOR 2\n")
    source, _ = _outside_tu(header, "include_in_tu")
    first = _compile(lib, source)
    assert _compile(lib, source).found_by == "direct"  # the direct entry names the key with the header
    header.write_text("#define FACTOR 7\n")
    k = _compile(lib, source)
    assert k.compiled is True and k.digest != first.digest


# -- 2. sealed compiles -------------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["compiles", "garbage"])
def test_a_sealed_compile_that_reads_a_host_file_fails_naming_it_and_caches_nothing(lib: SimpleNamespace,
                                                                                    content: str) -> None:
    secret = lib.host / "secret.h"
    secret.write_text("#define FACTOR 2\n" if content == "compiles" else "host-secret-line-4242 = ;\n")
    source = f'#include "{secret}"\n' + TU
    with pytest.raises(JitCompileError) as info:
        _compile(lib, source, sealed=True, family="axpy", params={"dtype": "f32"})
    message = str(info.value)
    assert message.startswith("sealed JIT compile of key xxh3:") and f" read {secret}: expected only files" in message
    assert "host-secret-line-4242" not in message
    assert type(info.value) is JitCompileError
    local = LocalLayer(lib.home)
    assert list(local.scan()[0]) == []  # no CUBIN in the CAS
    for kind in ("index", "deps", "direct", "outside"):
        assert _jit_files(lib.home, kind) == [], kind
    from cubinstore.internals import warmset as _warmset

    assert [r for r in _warmset.records(local) if r.kind == "jit"] == []


def test_a_sealed_compile_may_read_its_roots_the_toolkit_and_system_headers(lib: SimpleNamespace) -> None:
    source = "#include <stdint.h>\n#include <cstring>\n#include <cuda_fp16.h>\n" + TU
    k = _compile(lib, source, sealed=True)
    assert k.compiled is True and k.key.parts.outside == ()
    assert _compile(lib, source, sealed=True).compiled is False


def test_a_sealed_call_never_takes_a_key_that_read_host_files(lib: SimpleNamespace) -> None:
    header = lib.host / "cfg.h"
    header.write_text("#define FACTOR 2\n")
    source = f'#include "{header}"\n' + TU
    assert _compile(lib, source).compiled is True  # not sealed: keyed by the header
    with pytest.raises(JitCompileError, match=f" read {header}: expected only files"):
        _compile(lib, source, sealed=True)


# -- 3. index entries are re-checked ----------------------------------------------------------------

OTHER_TU = 'extern "C" __global__ void other(int n, float* x) { if (n) x[0] = 1.0f; }\n'


def _rewrite_entry(lib: SimpleNamespace, victim: jit.JitKernel, to: jit.JitKernel, fields: tuple[str, ...]) -> Path:
    path = lib.home / "v1" / "jit" / "index" / victim.key.hex[:2] / f"{victim.key.hex}.json"
    doc = json.loads(path.read_text())
    other = json.loads((lib.home / "v1" / "jit" / "index" / to.key.hex[:2] / f"{to.key.hex}.json").read_text())
    for f in fields:
        doc[f] = other[f]
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("fields", [("digest", "size"), ("digest", "size", "kernels")])
@pytest.mark.parametrize("fresh", [False, True])
def test_an_index_entry_rewritten_to_name_another_kernels_cubin_is_never_loaded(
        lib: SimpleNamespace, fields: tuple[str, ...], fresh: bool, caplog: pytest.LogCaptureFixture) -> None:
    first = _compile(lib)
    second = _compile(lib, OTHER_TU, entries={"other": ["i32", "ptr"]})
    assert first.digest != second.digest
    _rewrite_entry(lib, first, second, fields)
    if fresh:
        jit.clear_caches()  # the direct path from its files, as a fresh process
    with caplog.at_level(logging.WARNING, logger="cubinstore"):
        k = _compile(lib)
    assert k.digest != second.digest
    assert (k.key, k.digest, k.compiled) == (first.key, first.digest, True)
    assert JitIndex(LocalLayer(lib.home)).get(first.key.hex).digest == first.digest  # rewritten by the compile
    if "kernels" not in fields:
        assert any(str(first.key) in r.getMessage() and str(second.digest) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fields", [("digest", "size"), ("digest", "size", "kernels"), ("arch",)])
def test_a_rewritten_index_entry_with_compiling_off_is_a_miss_not_the_wrong_cubin(
        lib: SimpleNamespace, fields: tuple[str, ...]) -> None:
    first = _compile(lib)
    second = _compile(lib, OTHER_TU, entries={"other": ["i32", "ptr"]})
    if fields == ("arch",):
        path = lib.home / "v1" / "jit" / "index" / first.key.hex[:2] / f"{first.key.hex}.json"
        doc = json.loads(path.read_text())
        doc["arch"] = "sm_80"
        path.write_text(json.dumps(doc))
    else:
        _rewrite_entry(lib, first, second, fields)
    jit.clear_caches()
    with pytest.raises(KernelNotFoundError):
        _compile(lib, jit=False)


def test_a_rewritten_index_entry_is_removed(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    second = _compile(lib, OTHER_TU, entries={"other": ["i32", "ptr"]})
    path = _rewrite_entry(lib, first, second, ("digest", "size"))
    with pytest.raises(KernelNotFoundError):
        _compile(lib, jit=False)
    assert not path.exists()


def test_an_index_entry_of_the_previous_schema_is_still_a_hit(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    path = lib.home / "v1" / "jit" / "index" / first.key.hex[:2] / f"{first.key.hex}.json"
    doc = json.loads(path.read_text())
    del doc["parts"]  # v1 entries are checked against v1/jit/parts
    doc["schema"] = "cubinstore/jit-index/v1"
    path.write_text(json.dumps(doc))
    jit.clear_caches()
    k = _compile(lib, jit=False)
    assert (k.compiled, k.digest) == (False, first.digest)


# -- 4. streamed keying; FIFOs and devices refused --------------------------------------------------

_BOUNDED = """
import resource, sys
from cubinstore.internals import key as _jitkey
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
# A process that reads the file whole cannot: it fails instead of taking 2 GiB of the machine.
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = _jitkey.tree(sys.argv[1], cached=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, t.files["big.bin"])
"""


def test_keying_a_root_that_holds_a_2_gib_sparse_file_takes_bounded_memory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "big.bin", "wb") as f:
        f.truncate(2 << 30)
    out = subprocess.run([sys.executable, "-c", _BOUNDED, str(root)], env=child_env(tmp_path / "home"),
                         capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    growth, digest = out.stdout.split()
    assert int(growth) < 64 << 20, f"peak RSS grew {int(growth) >> 20} MiB keying a 2 GiB file"
    assert digest.startswith("xxh3:")


@pytest.mark.parametrize("where", ["include_root", "nested_in_root", "file_flag"])
def test_a_fifo_in_an_include_root_is_refused_naming_it_without_blocking(tmp_path: Path, where: str) -> None:
    include = make_library(tmp_path / "lib")
    fifo = include / "mylib" / "pipe.cuh" if where == "nested_in_root" else \
        include / "pipe.cuh" if where == "include_root" else tmp_path / "pipe.h"
    os.mkfifo(fifo)
    flags = [f"-include{fifo}"] if where == "file_flag" else []
    code = (
        "from cubinstore import jit\nfrom cubinstore.errors import BadArgumentError\n"
        "try:\n"
        f"    jit.key({TU!r}, include_dirs=[{str(include)!r}], flags={flags!r}, arch={ARCH!r})\n"
        "    print('no error')\n"
        "except BadArgumentError as exc:\n"
        "    print('BadArgumentError:', exc)\n"
    )
    out = run_child(code, child_env(tmp_path / "home"), timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("BadArgumentError:"), out.stdout
    rel = "pipe.h" if where == "file_flag" else os.path.relpath(fifo, include)
    assert rel in out.stdout
    if where != "file_flag":
        assert "is a FIFO" in out.stdout


# -- 5. every compile has a time limit ---------------------------------------------------------------

def _processes_in(work_root: Path) -> dict[int, int]:
    """pid -> process group of every live process whose working directory is under ``work_root``."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd")
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if cwd.startswith(str(work_root)) and fields[0] != b"Z":
            found[int(name)] = int(fields[2])
    return found


def _live_in_group(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def test_a_compile_past_its_time_limit_is_killed_with_its_group_and_releases_its_lock(
        lib: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBINSTORE_LOCK_TIMEOUT", "60")  # a lock left held fails the recompile, never hangs it
    fifo = lib.host / "blocks.h"  # outside the roots: nvcc's preprocessor blocks opening it
    os.mkfifo(fifo)
    source = f'#include "{fifo}"\n' + TU
    key = jit.key(source, include_dirs=[lib.include], arch=ARCH, store=lib.store)
    result: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            _compile(lib, source, timeout=3)
            result["error"] = None
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    work_root = lib.home / "v1" / "jit" / "tmp"
    groups: set[int] = set()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while thread.is_alive() and time.monotonic() < deadline:  # synchronise: nvcc's group is seen running
        groups |= set(_processes_in(work_root).values())
        time.sleep(0.05)
    thread.join(CHILD_TIMEOUT_S)
    assert not thread.is_alive()
    error = result["error"]
    assert isinstance(error, errors.JitTimeoutError), error
    assert str(error).startswith(f"JIT key {key}: nvcc ran past its time limit of 3 s")
    assert groups, "nvcc's processes were never seen running"
    assert os.getpgid(0) not in groups  # nvcc ran in its own process group
    for pgid in groups:
        assert _live_in_group(pgid) == [], f"process group {pgid} still runs"
    assert _processes_in(work_root) == {}
    assert list(work_root.iterdir()) == []  # the compile directory is gone
    assert JitIndex(LocalLayer(lib.home)).get(key.hex) is None

    os.unlink(fifo)  # the same key (the base key does not cover the header) compiles now: the lock is free
    fifo.write_text("#define FACTOR 4\n")
    k = _compile(lib, source, timeout=120)
    assert k.compiled is True and k.key.parts.base == key.parts


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "3", True])
def test_a_bad_timeout_is_a_bad_argument(lib: SimpleNamespace, value: object) -> None:
    with pytest.raises(BadArgumentError, match="^timeout: expected a positive number of seconds"):
        _compile(lib, timeout=value)


def test_the_jit_timeout_variable_is_declared_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from cubinstore.internals import knobs as _env

    assert "CUBINSTORE_JIT_TIMEOUT" in {v.name for v in _env.VARIABLES}
    monkeypatch.delenv("CUBINSTORE_JIT_TIMEOUT", raising=False)
    assert _env.jit_timeout() == 600.0
    monkeypatch.setenv("CUBINSTORE_JIT_TIMEOUT", "nope")
    with pytest.raises(BadArgumentError, match="^CUBINSTORE_JIT_TIMEOUT: expected a number of seconds"):
        _env.jit_timeout()


def test_explain_names_the_changed_file_outside_the_roots(lib: SimpleNamespace) -> None:
    from cubinstore.internals import explain_key

    header = lib.host / "cfg.h"
    header.write_text("#define FACTOR 2\n")
    source, _ = _outside_tu(header, "include_in_tu")
    _compile(lib, source)
    header.write_text("#define FACTOR 9\n")
    changed = _compile(lib, source)
    text = explain_key(JitIndex(lib.store.local), changed.key.hex)
    assert f"file outside the roots: {header} changed content" in text
