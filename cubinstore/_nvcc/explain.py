"""``cubinstore explain --nvcc -- <nvcc arguments>``: why a ``cubinstore-nvcc`` call missed, or that it hits.

Run with the library's own arguments (from its log, or with ``CUBINSTORE_NVCC`` set as it ran).
The report says whether the call is cached at all (else which word makes it a pass-through);
for a cached one, each record of its call key and why it does not hold here (which file the
compile read changed, or which place a lookup would now find a file at: a shadowing header);
with no record of the call key, the JIT key the call computes and, against the nearest key
the store knows, which part differs (TU text, a file under an include root, a flag, the
toolkit, the host compiler, the arch: ``cubinstore._jit.explain``).
"""

from __future__ import annotations

import os
import sys

from cubinstore._core import knobs
from cubinstore._nvcc import calls
from cubinstore._nvcc.argv import PassThrough, parse
from cubinstore._nvcc.hit import bases, labelled_flags, read_source

__all__ = ["explain_call"]


def explain_call(args: list[str], cwd: str | None = None) -> str:
    """The report for the nvcc call ``args`` (without the program name), run from ``cwd``."""
    from cubinstore._jit import compiler
    from cubinstore._jit.explain import explain_key
    from cubinstore._nvcc.miss import toolchain
    from cubinstore._nvcc.real import real_nvcc
    from cubinstore.store import default_store

    call = parse(args, cwd or os.getcwd(), knobs.nvcc_overrides())
    if isinstance(call, PassThrough):
        return f"not cached: {call.why}; cubinstore-nvcc hands this call to the real nvcc unchanged\n"
    text = read_source(call.source)
    if text is None:
        return f"not cached: cannot read the source {call.source}\n"
    store = default_store()
    program = real_nvcc(os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None)
    env = toolchain(store, program)
    key = calls.call_key(text, call.arch, call.kind, labelled_flags(call), len(call.include_dirs), env["identity"])
    where = bases(call, env["toolkit"])
    records = calls.read_records(str(store.local.root), key)
    lines = [f"cubinstore-nvcc call {key} ({call.source_arg} -> {call.output_arg}, {call.arch}): "
             f"{len(records)} record(s) in {store.local.root}"]
    for record in records:
        why = calls.check(record, where)
        state = "holds: the call is a hit" if why is None else f"does not hold: {why}"
        if why is not None and why.endswith("appeared"):
            state += " (a file there would be found by an #include of the compile, before or instead of the one it read)"
        lines.append(f"  record of JIT key xxh3:{record['key']} ({record['digest']}): {state}")
    if any(calls.check(r, where) is None for r in records):
        return "\n".join(lines) + "\n"
    if not records:
        lines.append("  no record: the TU text, a flag, the arch, the number of include roots or the toolchain "
                     "differs from every call compiled here")
    jit_key = compiler.key(text.decode("utf-8", "surrogateescape"), include_dirs=list(call.include_dirs),
                           flags=list(call.flags), arch=call.arch, store=store, program=env["program_id"],
                           kind=call.kind)
    index = compiler.JitIndex(store.local, knobs.lock_timeout())
    index.put_parts(jit_key.hex, jit_key.parts)  # what explain compares
    lines.append(f"the JIT key of this call: {jit_key}")
    return "\n".join(lines) + "\n" + explain_key(index, jit_key.hex)
