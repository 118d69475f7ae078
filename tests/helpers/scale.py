"""Counting work instead of timing it: what the size-doubling tests compare."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any


def count_work(fn: Callable[[], Any]) -> int:
    """Python calls, C calls and bytecodes ``fn`` runs (its threads too): grows with the input, not the host."""
    events = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        frame.f_trace_opcodes = True
        events += 1
        return trace

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        if event == "c_call":
            events += 1

    threading.settrace(trace)
    threading.setprofile(profile)
    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
        threading.settrace(None)  # type: ignore[arg-type]
        threading.setprofile(None)  # type: ignore[arg-type]
    return events


def assert_linear(work: Callable[[int], int], n: int = 400) -> None:
    """work(2n) / work(n) stays near 2 (a quadratic step gives about 4)."""
    small, large = work(n), work(2 * n)
    assert large < 2.6 * small, f"work at {n}: {small}, at {2 * n}: {large} (ratio {large / small:.2f})"
