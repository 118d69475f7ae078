"""Running a helper program whose output is hostile data: a time limit, an output limit, its whole
process group killed past either. The demangler (``demangle``) and the toolchain probes
(``key``: ``nvcc --version``, ``gcc -v``, ``gcc -E -v``) run through it. Standard library only."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping

__all__ = ["run_bounded"]


def run_bounded(argv: list[str], data: bytes, timeout: float, limit: int,
                env: Mapping[str, str] | None = None) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of ``argv`` fed ``data``; raises ``TimeoutError`` after ``timeout``
    seconds and ``OverflowError`` past ``limit`` bytes of output, the process group killed either way.
    ``env``: the child's whole environment (None: this process's)."""
    with tempfile.TemporaryFile() as stdin:  # a file, not a pipe: a child that never reads cannot block us
        stdin.write(data)
        stdin.seek(0)
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=None if env is None else dict(env))
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    finished = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in out:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                    out[key.fd] += chunk
                    if len(out[key.fd]) > limit:
                        raise OverflowError
        try:
            status = proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
        finished = True
    finally:
        if not finished:  # its whole session: a child it started may hold the pipes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return status, bytes(out[out_fd]), bytes(out[err_fd])
