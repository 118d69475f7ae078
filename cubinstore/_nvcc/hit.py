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
from cubinstore._jit.inputs import MAX_SOURCE_BYTES
from cubinstore._nvcc import calls
from cubinstore._nvcc.argv import Call

__all__ = ["bases", "emit", "env_name", "fast_hit", "labelled_flags", "printable", "read_source", "replay_text",
           "write_output"]


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


# What a terminal would act on rather than show: escape sequences whole (CSI, OSC, two-character),
# then every other C0 and C1 control, DEL, a carriage return not ending a line, and the raw bytes
# 0x80-0x9f that surrogateescape kept of output that was not UTF-8 (C1 on an 8-bit terminal).
_ESCAPE_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -~])")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\udc80-\udc9f]|\r(?!\n)")


def printable(text: str) -> str:
    """``text`` without what would drive the terminal (``_ESCAPE_RE``, ``_CONTROL_RE``): a record's
    streams are a store file's (or a remote's) words, shown, never obeyed. Newlines, tabs and
    CRLF line ends stay, which is all nvcc and the host compiler print into a file."""
    return _CONTROL_RE.sub("", _ESCAPE_RE.sub("", text))


def emit(record: dict, call: Call, toolkit: str) -> None:
    """Replay a record's streams as this call's, printable only (``printable``).

    Stripped here, where every replay is written (a local or remote record, the JIT's kept output
    on the compile path), rather than refused in ``record_problem``: a refusal would leave the
    JIT's output file unguarded, and would make a compile whose own output holds a control byte
    (``-Xcompiler -fdiagnostics-color=always``, a BEL in a ``#pragma message``) unrecordable, so
    that every such call compiled again."""
    for stream, text in ((sys.stdout, record["stdout"]), (sys.stderr, record["stderr"])):
        if text:
            stream.buffer.write(printable(replay_text(text, call, toolkit)).encode("utf-8", "surrogateescape"))
            stream.flush()


def read_source(path: str) -> bytes | None:
    """The TU's bytes (at most ``MAX_SOURCE_BYTES`` of a regular file); None when it cannot be read (nvcc says why)."""
    return calls.read_path(path, MAX_SOURCE_BYTES)


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
