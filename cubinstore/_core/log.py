"""Module loggers under ``cubinstore``, which stays silent unless the application configures logging.

A module that logs imports this (not ``logging`` at package import), so ``import cubinstore``
does not pay for ``logging`` and what it pulls in (``traceback``, ``re``, ``threading``...).
The ``NullHandler`` is attached before any of our loggers exists: without it, Python's
last-resort handler would print our warnings to stderr in an application that configured none.
"""

from __future__ import annotations

import logging

__all__ = ["get_logger"]

logging.getLogger("cubinstore").addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a ``cubinstore.*`` module's ``__name__``)."""
    return logging.getLogger(name)
