"""cubinstore: fetch compiled CUDA kernels (CUBINs) by sha256 digest, verify them, launch them.

Public names: ``Manifest``/``KernelSpec`` (what a release contains), ``Store`` (where the
bytes come from, verified), ``open``/``Library``/``Kernel`` (load and launch),
``TensorMap``, ``Digest``, and the errors in ``cubinstore.errors``.
The subpackages ``cubinstore.ops``, ``.jit``, ``.launch``, ``.manifest``, ``.store`` and
``.tensormap`` are attributes too, imported on first access.
Nothing here imports CUDA; the GPU side loads lazily.
"""

from __future__ import annotations

import importlib

from cubinstore.errors import (
    BadArgumentError,
    BundleError,
    CubinstoreError,
    CudaError,
    ExpiredReleaseError,
    IncompatibleArchError,
    IntegrityError,
    KernelNotFoundError,
    LockTimeoutError,
    ManifestError,
    MissingBlobError,
    ParamLayoutError,
    RemoteUnavailableError,
    RollbackError,
    StoreError,
    TrustError,
    UnsafeStoreError,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; type checkers read it as True
if TYPE_CHECKING:
    from cubinstore._core.digest import Digest
    from cubinstore.launch import Kernel, Library, open
    from cubinstore.manifest import KernelSpec, Manifest, arch_compatible, parse_arch
    from cubinstore.store import Store, StoreStats
    from cubinstore.tensormap import TensorMap

# Imported on first use (PEP 562), so `import cubinstore` costs only the errors: a
# process that opens a manifest pays for the manifest, one that never launches never loads
# the launcher, and HTTP (http.client, ssl, email) comes in only with a remote.
_LAZY = {
    "Digest": "cubinstore._core.digest",
    "Kernel": "cubinstore.launch",
    "Library": "cubinstore.launch",
    "open": "cubinstore.launch",
    "KernelSpec": "cubinstore.manifest",
    "Manifest": "cubinstore.manifest",
    "arch_compatible": "cubinstore.manifest",
    "parse_arch": "cubinstore.manifest",
    "Store": "cubinstore.store",
    "StoreStats": "cubinstore.store",
    "TensorMap": "cubinstore.tensormap",
}


# The public subpackages, so that `import cubinstore` then `cubinstore.ops.gemm(...)` works as
# `import cubinstore.ops` does; none is imported before its first access (ops never imports
# torch, launch and tensormap load the driver on first use only).
_SUBMODULES = frozenset({"jit", "launch", "manifest", "ops", "store", "tensormap"})


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        # Importing a submodule binds it on this package, so this runs once per name.
        return importlib.import_module(f"cubinstore.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cubinstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__version__ = "0.1.0"

# A library logs, the application decides what is shown: every module that logs gets its logger
# from cubinstore._core.log, which gives the "cubinstore" logger a NullHandler first (so `import
# cubinstore` itself does not import logging).

__all__ = [
    "BadArgumentError",
    "BundleError",
    "CubinstoreError",
    "CudaError",
    "Digest",
    "ExpiredReleaseError",
    "IncompatibleArchError",
    "IntegrityError",
    "Kernel",
    "KernelNotFoundError",
    "KernelSpec",
    "Library",
    "LockTimeoutError",
    "Manifest",
    "ManifestError",
    "MissingBlobError",
    "ParamLayoutError",
    "RemoteUnavailableError",
    "RollbackError",
    "Store",
    "StoreError",
    "StoreStats",
    "TensorMap",
    "TrustError",
    "UnsafeStoreError",
    "arch_compatible",
    "open",
    "parse_arch",
]
