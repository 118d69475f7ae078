"""Child processes the tests synchronise with: their lines read with a bound, never a sleep."""

from __future__ import annotations

import select
import subprocess

import pytest


def read_line(proc: subprocess.Popen[str], what: str, timeout: float) -> str:
    """The child's next stdout line; fails (never hangs) if the child dies or stays silent for
    ``timeout`` seconds (a bound on a broken child only)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"child gave no {what!r} line; stderr:\n{err}")
    return line.rstrip("\n")
