"""cubinstore: fetch compiled CUDA kernels (CUBINs) by sha256 digest, verify them, launch them.

Public names: ``Manifest``/``KernelSpec`` (what a release contains), ``Store`` (where the
bytes come from, verified), ``open``/``Library``/``Kernel`` (load and launch),
``TensorMap``, ``Digest``, and the errors in ``cubinstore.errors``.
Nothing here imports CUDA; the GPU side loads lazily.
"""

from __future__ import annotations

from cubinstore._digest import Digest
from cubinstore.errors import (
    BadArgumentError,
    BundleError,
    CubinstoreError,
    CudaError,
    IncompatibleArchError,
    IntegrityError,
    KernelNotFoundError,
    LockTimeoutError,
    ManifestError,
    MissingBlobError,
    ParamLayoutError,
    RemoteUnavailableError,
    StoreError,
)
from cubinstore.launch import Kernel, Library, open
from cubinstore.manifest import KernelSpec, Manifest, arch_compatible, parse_arch
from cubinstore.store import Store, StoreStats
from cubinstore.tensormap import TensorMap

__version__ = "0.1.0"

__all__ = [
    "BadArgumentError",
    "BundleError",
    "CubinstoreError",
    "CudaError",
    "Digest",
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
    "Store",
    "StoreError",
    "StoreStats",
    "TensorMap",
    "arch_compatible",
    "open",
    "parse_arch",
]
