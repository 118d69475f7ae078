"""``cubinstore-nvcc``: nvcc to its caller, a content-addressed cache underneath.

    DG_JIT_NVCC_COMPILER=cubinstore-nvcc python serve.py      # DeepGEMM's JIT, unchanged

A call ``argv.parse`` can model (one ``.cu`` to ``-cubin -o``) is answered from a call record
(``hit``, ``calls``) when one checks: the verified CUBIN is written to ``-o`` atomically and the
first compile's stdout and stderr are replayed with this call's names, with no nvcc process and
no import beyond those modules. Otherwise ``miss`` asks the remote cache, else compiles through
``cubinstore.jit`` (a private directory, relative paths, one compile per key across processes),
and records the call. Every other call is handed to the real nvcc unchanged (``real.exec_real``:
same argv, working directory, environment, output and exit code).
"""

from __future__ import annotations

import os
import sys

from cubinstore._core import knobs
from cubinstore._nvcc.argv import PassThrough, parse

__all__ = ["main"]


def _exec_real(args: list[str]) -> int:
    from cubinstore._nvcc.real import exec_real
    from cubinstore.errors import CubinstoreError

    try:
        return exec_real(args)
    except CubinstoreError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    call = parse(args, os.getcwd(), knobs.nvcc_overrides())
    if isinstance(call, PassThrough):
        return _exec_real(args)
    try:
        from cubinstore._nvcc.hit import fast_hit, read_source
    except ImportError as exc:  # xxhash: the package without its jit extra
        print(f"cubinstore-nvcc: {exc}; install the jit extra (pip install 'cubinstore[jit]')", file=sys.stderr, flush=True)
        return 1
    text = read_source(call.source)
    if text is None:
        return _exec_real(args)  # nvcc says what is wrong with it
    env = None
    try:
        answered, env = fast_hit(call, text)
        if answered:
            return 0
    except OSError:
        pass  # a record or output it could not use: the slow path decides
    from cubinstore._nvcc.miss import answer

    return answer(call, args, text, env)


if __name__ == "__main__":
    sys.exit(main())
