"""Message text: how an untrusted value appears in an error message or a log line."""

from __future__ import annotations

__all__ = ["show"]


def show(value: object, limit: int = 80) -> str:
    """``repr`` of an untrusted value, cut short so messages stay one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
