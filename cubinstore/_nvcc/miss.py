"""A call no local record answers: the remote's record, else a compile through ``cubinstore.jit``.

The toolchain's identity (toolkit programs and libdevice, host compiler, the nvcc program when
it is not the toolkit's own) is taken here and kept for the hit path (``calls.read_env``). The
compile is ``cubinstore._jit.compiler.compile``: the JIT's content key, one compile per key
across processes (16 ranks asking at once run one nvcc), a private directory with relative
paths (the CUBIN's bytes do not depend on where the library is installed), nothing indexed
from a compile that was killed or failed. A failing compile is handed to the real nvcc, which
prints its own messages and exits with its own code. After a compile (or a JIT index hit) the
call is recorded (``record``) and, for CI, published; the miss is kept for ``warmset export``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import xxhash

from cubinstore._core import knobs
from cubinstore._core.log import get_logger
from cubinstore._jit.inputs import join_below
from cubinstore._nvcc import calls, probes
from cubinstore._nvcc.argv import Call
from cubinstore._nvcc.hit import answer_from_records, bases, emit, env_name, labelled_flags, write_output
from cubinstore._nvcc.real import exec_real, real_nvcc
from cubinstore.errors import CubinstoreError, JitCompileError
from cubinstore.store import Store, default_store

if TYPE_CHECKING:
    from cubinstore._jit.compiler import Compiled

__all__ = ["answer", "build_record", "toolchain"]

_log = get_logger("cubinstore.nvcc")
_RACY_NS = 2_000_000_000  # a file changed this recently may change again unseen by its stats


def _facts(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def toolchain(store: Store, program: str) -> dict[str, Any]:
    """This host's toolchain identity (``calls`` env record), written for the hit path when its
    files are not racy. ``program``: the nvcc this call runs."""
    from cubinstore._jit.key import hash_file, host_compiler, toolkit_core

    local = store.local
    core = toolkit_core(local=local)
    host = host_compiler(local=local)
    own = os.path.realpath(program) == os.path.realpath(core.root / "bin" / "nvcc")
    program_id = None if own else hash_file(program, "xxh3", what="CUBINSTORE_NVCC")
    identity = xxhash.xxh3_128_hexdigest(calls.canonical({
        "toolkit": core.identity, "host": {"name": host.name, "identity": host.identity}, "program": program_id}))
    paths = [*core.id_paths, *host.id_paths, program]
    facts = [*(None if f is None else list(f) for f in core.id_facts), *(None if f is None else list(f) for f in host.id_facts),
             _facts(program)]
    name = env_name()
    doc = {"schema": calls.ENV_SCHEMA, "name": name, "identity": identity, "toolkit": str(core.root),
           "program": program, "program_id": program_id, "paths": paths, "facts": facts}
    now = time.time_ns()
    if local is not None and all(f is None or now - max(f[3], f[4]) > _RACY_NS for f in facts):
        try:
            local.write_file(("nvcc", "env", name[:2]), name + ".json", calls.canonical(doc), durable=False)
        except CubinstoreError as exc:
            _log.warning("cubinstore-nvcc: cannot keep the toolchain identity: %s", exc)
    return doc


def _cuda_prefix(files: list[tuple[str, str, str]]) -> str | None:
    """Where the toolkit's headers are below its root, as nvcc's dependency list spells them."""
    prefixes = {rel[:rel.index("include/") + len("include/")] for label, rel, _ in files
                if label == "cuda" and "include/" in rel}
    if len(prefixes) > 1:
        return None
    return prefixes.pop() if prefixes else "include/"


def build_record(found: Compiled, call: Call, toolkit: str, text: bytes) -> dict | None:
    """The call record of ``found`` (None when its compile's reads cannot be enumerated).

    The JIT's dependency list is a store file: ``get_deps`` refuses a path that is not below its
    root (a ``StoreError`` naming the file and the path, which ``answer`` reports), and each file
    is read only if it is a regular file (a FIFO is never opened for a blocking read), within
    ``calls.MAX_HEADER_BYTES`` each, ``calls.MAX_RECORD_FILES`` files and
    ``calls.MAX_RECORD_READ_BYTES`` together."""
    from cubinstore._jit import compiler

    index = compiler.JitIndex(found.store.local, knobs.lock_timeout())
    deps = index.get_deps(found.key.hex)
    if deps is None:
        _log.info("cubinstore-nvcc: JIT %s kept no dependency list; the call is not recorded", found.key)
        return None
    files, _ = deps
    if len(files) > calls.MAX_RECORD_FILES:
        _log.info("cubinstore-nvcc: JIT %s read over %d files; the call is not recorded", found.key, calls.MAX_RECORD_FILES)
        return None
    where = bases(call, toolkit)
    contents = [(".", compiler.SOURCE_NAME, text)]
    total = 0
    for label, rel, digest in files:
        path = join_below(where[label], rel, calls.record_rel_ok) if label in where else None
        if path is None:
            return None  # a root this call lacks, or a spelling no record may name (``calls.record_problem``)
        data = calls.read_path(path, min(calls.MAX_HEADER_BYTES, calls.MAX_RECORD_READ_BYTES - total))
        if data is None or "xxh3:" + xxhash.xxh3_128_hexdigest(data) != digest:
            # Changed since the compile read it (the next call compiles and records), not a
            # regular file, or over the limits: not recorded.
            _log.info("cubinstore-nvcc: JIT %s: %s/%s is not as the compile read it; the call is not recorded",
                      found.key, label, rel)
            return None
        total += len(data)
        contents.append((label, rel, data))
    prefix = _cuda_prefix(files)
    if prefix is None:
        return None
    roots = [(label, prefix if label == "cuda" else "") for label in where]
    try:
        places = probes.places(contents, roots)
    except probes.Incomplete as exc:
        _log.info("cubinstore-nvcc: JIT %s: %s; the call is not recorded", found.key, exc)
        return None
    absent = sorted([label, rel] for label, rel in places if calls._absent(f"{where[label]}/{rel}"))
    out = index.get_output(found.key.hex) or ("", "")
    record = {"key": found.key.hex, "digest": str(found.digest), "size": found.size,
              "files": [list(f) for f in files], "absent": absent,
              "outside": [list(f) for f in found.key.parts.outside], "stdout": out[0], "stderr": out[1]}
    return record if calls.record_problem(record) is None else None


def keep(store: Store, key: str, record: dict) -> None:
    """Put ``record`` first among call key ``key``'s records (locked read-modify-write)."""
    local = store.local
    root = str(local.root)
    with local.file_lock(("nvcc", "locks", key[:2]), key + ".lock", what=f"nvcc call {key}"):
        same = (record["key"], record["digest"])
        older = [r for r in calls.read_records(root, key) if (r["key"], r["digest"]) != same]
        doc = {"schema": calls.RECORDS_SCHEMA, "call": key, "records": [record, *older][:calls.MAX_RECORDS]}
        local.write_file(("nvcc", "calls", key[:2]), key + ".json",
                         calls.canonical(doc),
                         durable=False)


def answer(call: Call, args: list[str], text: bytes, env: dict | None = None) -> int:
    """Answer a call the hit path could not: remote, else compile; 0 on success. ``env``: the
    toolchain identity the hit path read (its stats vouched for it), else None (taken here)."""
    try:
        store = default_store()
        if env is None:
            self_path = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None
            env = toolchain(store, real_nvcc(self_path))
            checked = False
        else:
            checked = True  # the hit path checked the local records with this identity
        key = calls.call_key(text, call.arch, call.kind, labelled_flags(call), len(call.include_dirs), env["identity"])
        where = bases(call, env["toolkit"])
        root = str(store.local.root)
        # The hit path's check, with the identity just taken (its stats may not vouch for it yet).
        if not checked and answer_from_records(call, root, key, env["toolkit"]):
            return 0
        if not knobs.offline() and knobs.remotes():
            from cubinstore._nvcc import remote

            fetched = remote.fetch(store, key, where, call.kind)
            if fetched is not None:
                record, data = fetched
                keep(store, key, record)
                write_output(call.output, data)
                emit(record, call, env["toolkit"])
                return 0
        return _compile(store, env, key, call, args, text)
    except CubinstoreError as exc:
        # The cache failed, not the compile: say so on stderr and let nvcc do the work.
        print(f"cubinstore-nvcc: {exc}; running nvcc uncached", file=sys.stderr, flush=True)
        return exec_real(args)


def _compile(store: Store, env: dict, key: str, call: Call, args: list[str], text: bytes) -> int:
    """Compile through the JIT, record the call, and answer it."""
    from cubinstore._jit import compiler
    from cubinstore._nvcc import remote, warm

    # The program to run is this environment's, never one a store file names.
    program = real_nvcc(os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None)
    if program != env["program"]:
        env = toolchain(store, program)
        key = calls.call_key(text, call.arch, call.kind, labelled_flags(call), len(call.include_dirs), env["identity"])
    own = env.get("program_id") is None

    def run(argv: list[str], work: Any) -> Any:
        return compiler.run_nvcc(argv if own else [program, *argv[1:]], work)

    try:
        found = compiler.compile(text.decode("utf-8", "surrogateescape"), include_dirs=list(call.include_dirs),
                                 flags=list(call.flags), arch=call.arch, store=store, nvcc=run,
                                 program=env.get("program_id"), kind=call.kind)
    except JitCompileError:
        return exec_real(args)  # nvcc prints why, with its own exit code
    data = store.get(found.digest, found.size, name=f"JIT {found.key}")
    record = build_record(found, call, env["toolkit"], text)
    if record is not None:
        keep(store, key, record)
        if found.compiled:
            warm.note(store, key, call, text, record)
        if knobs.nvcc_publish():
            for problem in remote.publish(store, key, record, data, call.kind):
                # CI asked to publish: a failed upload is said on stderr (Bazel's are silent; ours are not).
                print(f"cubinstore-nvcc: publishing call {key} failed: {problem}", file=sys.stderr, flush=True)
    write_output(call.output, data)
    out = record or {"stdout": "", "stderr": ""}
    if record is None and found.compiled:
        got = compiler.JitIndex(store.local, knobs.lock_timeout()).get_output(found.key.hex)
        out = {"stdout": got[0], "stderr": got[1]} if got else out
    emit(out, call, env["toolkit"])
    return 0
