"""The one process-wide kernel library of the operators: set with `set_library`, else opened from
`CUBINSTORE_MANIFEST` on first use.

Its own module, below the operators, so an operator's module imports it rather than the
`cubinstore.ops` package that imports the operator.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from cubinstore._core import knobs
from cubinstore.errors import KernelNotFoundError

if TYPE_CHECKING:
    from cubinstore.launch import Library

__all__ = ["get_library", "set_library"]

_lock = threading.Lock()
_library: Library | None = None


def set_library(library: Library | str | os.PathLike[str] | None) -> None:
    """Use `library` for every operator: a `Library`, a manifest path, or None to unset."""
    if library is not None and not hasattr(library, "kernel"):
        from cubinstore import launch

        library = launch.open(library)
    with _lock:
        _set(library)


def _set(library: Library | None) -> None:
    global _library
    _library = library


def get_library() -> Library:
    """The library set with `set_library`, else the one `CUBINSTORE_MANIFEST` names.

    Raises `KernelNotFoundError` when neither is there.
    """
    with _lock:
        library = _library
    if library is not None:
        return library
    default = knobs.manifest()
    if default is None:
        raise KernelNotFoundError(
            "no kernel library for cubinstore.ops: set CUBINSTORE_MANIFEST to a manifest path or "
            "sha256 digest, or call cubinstore.ops.set_library('<path>/manifest.json') first"
        )
    from cubinstore import launch

    opened = launch.open(default)
    with _lock:
        if _library is None:
            _set(opened)
        return _library  # type: ignore[return-value]
