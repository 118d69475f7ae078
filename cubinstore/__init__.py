"""cubinstore: fetch compiled CUDA kernels (CUBINs) by sha256 digest, verify them, launch them.

Public names: ``Manifest``/``KernelSpec`` (what a release contains), ``Store`` (where the
bytes come from, verified), ``open``/``Library``/``Kernel`` (load and launch),
``TensorMap``, ``Digest``, and the errors in ``cubinstore.errors``.
Nothing here imports CUDA; the GPU side loads lazily.
"""

from __future__ import annotations

import logging

from cubinstore._digest import Digest
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
from cubinstore.launch import Kernel, Library, open
from cubinstore.manifest import KernelSpec, Manifest, arch_compatible, parse_arch
from cubinstore.store import Store, StoreStats
from cubinstore.tensormap import TensorMap

__version__ = "0.1.0"

# A library logs, the application decides what is shown: without this, Python's last-resort
# handler prints our warnings to stderr when the application configured no logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

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
