"""Operators built on cubinstore's kernel families.

    import cubinstore.launch, cubinstore.ops
    cubinstore.ops.set_library(cubinstore.launch.open("bazel-bin/kernels/manifest.json"))
    d = cubinstore.ops.gemm(a, b)          # a: M x K, b: N x K, bf16 CUDA tensors -> a @ b.T

Operators take their kernels from one process-wide `Library`, set once with
`set_library` (a `Library`, or a manifest path opened with the default store), or
opened on first use from `CUBINSTORE_MANIFEST` (a path or `sha256:<hex>`).
Nothing touches CUDA until an operator runs, and nothing here imports torch: with torch, an
operator is also a torch custom op (`torch.ops.cubinstore.gemm`, registered on first use;
see `_gemm_op.py`), which is what `torch.compile` puts in its graphs.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from cubinstore._core import knobs as _env
from cubinstore.errors import KernelNotFoundError
from cubinstore.ops.gemm import gemm

if TYPE_CHECKING:
    from cubinstore.launch import Library

__all__ = ["gemm", "get_library", "set_library"]

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
    default = _env.manifest()
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
