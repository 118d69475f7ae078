"""The hit path of ``cubinstore-nvcc``: a call answered from a call record, with nothing but this
module, ``calls``, ``argv`` and the knobs imported.

The call's names (``bases``, ``labelled_flags``), the replay of nvcc's messages with this call's
names (``replay_text``) and the atomic write of ``-o`` (``write_output``) are shared with the
miss path (``miss``).
"""

from __future__ import annotations

import os
import re
import sys

import xxhash

from cubinstore._core import knobs
from cubinstore._nvcc import calls
from cubinstore._nvcc.argv import Call

__all__ = ["bases", "emit", "env_name", "fast_hit", "labelled_flags", "read_source", "replay_text", "write_output"]

_MAX_SOURCE = 64 << 20


def env_name() -> str:
    """The name of this host's toolchain identity record: what decides the toolchain, hashed."""
    return xxhash.xxh3_128_hexdigest("\0".join(knobs.toolchain_environment()).encode("utf-8", "surrogateescape"))


def labelled_flags(call: Call) -> list[str]:
    """The call's flags as keyed: each ``-isystem`` directory by its label ``flagpath/<i>``."""
    out, i, n = [], 0, 0
    flags = call.flags
    while i < len(flags):
        if flags[i] == "-isystem":
            out.extend(["-isystem", f"{{flagpath/{n}}}"])
            n, i = n + 1, i + 2
        else:
            out.append(flags[i])
            i += 1
    return out


def bases(call: Call, toolkit: str) -> dict[str, str]:
    """Where each root label is for this call."""
    out = {f"inc/{i}": d for i, d in enumerate(call.include_dirs)}
    flags = call.flags
    out.update({f"flagpath/{n}": flags[i + 1] for n, i in enumerate(j for j, f in enumerate(flags) if f == "-isystem")})
    out["cuda"] = toolkit
    return out


_PRIVATE_RE = re.compile(r"(?<![\w/.])(?:inc/([0-9]+)/|flagpath/([0-9]+)/|(cuda/bin/\.\./)|(cubinstore_jit\.cu)\b)")


def replay_text(text: str, call: Call, toolkit: str) -> str:
    """nvcc's message text with the compile directory's names replaced by this call's, as nvcc
    would have printed them: ``inc/<i>/`` by the ``-I`` as spelled, the TU by its argument."""
    isystem = [call.flags[i + 1] for i, f in enumerate(call.flags) if f == "-isystem"]

    def name(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            i = int(m.group(1))
            return call.include_args[i].rstrip("/") + "/" if i < len(call.include_args) else m.group(0)
        if m.group(2) is not None:
            i = int(m.group(2))
            return isystem[i].rstrip("/") + "/" if i < len(isystem) else m.group(0)
        if m.group(3) is not None:
            return toolkit.rstrip("/") + "/bin/../"
        return call.source_arg

    return _PRIVATE_RE.sub(name, text)


def write_output(path: str, data: bytes) -> None:
    """``data`` to ``path`` atomically: a temp file beside it, renamed over it (a reader never
    sees half a CUBIN; a kill leaves at most the temp file, never a partial ``path``)."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.cubinstore.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def emit(record: dict, call: Call, toolkit: str) -> None:
    """Replay a record's streams as this call's."""
    for stream, text in ((sys.stdout, record["stdout"]), (sys.stderr, record["stderr"])):
        if text:
            stream.buffer.write(replay_text(text, call, toolkit).encode("utf-8", "surrogateescape"))
            stream.flush()


def read_source(path: str) -> bytes | None:
    """The TU's bytes (at most 64 MiB of a regular file); None when it cannot be read (nvcc says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    return calls.read_open(fd, _MAX_SOURCE)


def fast_hit(call: Call, text: bytes) -> tuple[bool, dict | None]:
    """Answer ``call`` from a call record that checks: (answered, the toolchain identity record
    when its stats vouch for it, which the miss path then need not take again)."""
    root = knobs.home_str()
    env = calls.read_env(root, env_name())
    if env is None:
        return False, None
    key = calls.call_key(text, call.arch, call.kind, labelled_flags(call), len(call.include_dirs), env["identity"])
    return answer_from_records(call, root, key, env["toolkit"]), env


def answer_from_records(call: Call, root: str, key: str, toolkit: str) -> bool:
    """Answer ``call`` from the first record of call key ``key`` that holds here and whose output
    the local CAS has, verified; False when none does."""
    where = bases(call, toolkit)
    for record in calls.read_records(root, key):
        if calls.check(record, where) is not None:
            continue
        data = calls.artifact(root, record, call.kind)
        if data is None:
            continue
        write_output(call.output, data)
        emit(record, call, toolkit)
        return True
    return False
