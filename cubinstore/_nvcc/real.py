"""The real nvcc behind ``cubinstore-nvcc``: ``CUBINSTORE_NVCC``, else the toolkit the JIT finds.

Never ``cubinstore-nvcc`` itself, also when it is installed as ``nvcc`` first on ``PATH``: the
toolkit search takes only a directory holding ``bin/nvcc`` *and* ``nvvm/bin/cicc`` (a toolkit),
and a program whose real path is this script's is refused with an error naming it.
"""

from __future__ import annotations

import os
import sys

from cubinstore._core import knobs
from cubinstore.errors import BadArgumentError

__all__ = ["exec_real", "real_nvcc"]


def real_nvcc(self_path: str | None) -> str:
    """The absolute path of the nvcc to run; ``self_path``: this script's real path (refused)."""
    configured = knobs.nvcc()
    if configured is not None:
        program = os.path.abspath(str(configured))
        source = "CUBINSTORE_NVCC"
    else:
        from cubinstore._jit.key import locate_toolkit  # only when no CUBINSTORE_NVCC: it is the slow import

        root, found_by = locate_toolkit()
        program = os.path.join(str(root), "bin", "nvcc")
        source = f"the CUDA toolkit ({found_by})"
    if self_path is not None and os.path.realpath(program) == self_path:
        raise BadArgumentError(
            f"cubinstore-nvcc: {source} names {program}, which is cubinstore-nvcc itself; set CUBINSTORE_NVCC "
            "to the real nvcc (e.g. /usr/local/cuda/bin/nvcc)"
        )
    if not os.access(program, os.X_OK) or not os.path.isfile(program):
        raise BadArgumentError(f"cubinstore-nvcc: {source} names {program}, which is not an executable file")
    return program


def exec_real(args: list[str]) -> int:
    """Run the real nvcc in this process's place: same arguments, directory, environment, streams."""
    program = real_nvcc(os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(program, [program, *args])
    return 127  # not reached
