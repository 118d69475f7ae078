"""The cubinstore error hierarchy.

Every error raised on purpose by cubinstore is a ``CubinstoreError``. Messages
name the digest, kernel id, URL or path involved and say what to do next.
"""

from __future__ import annotations

__all__ = [
    "BadArgumentError",
    "BundleError",
    "CubinstoreError",
    "CubinFormatError",
    "CudaError",
    "DemanglerError",
    "DriverVersionError",
    "ExpiredReleaseError",
    "IncompatibleArchError",
    "IntegrityError",
    "JitCompileError",
    "JitTimeoutError",
    "KernelNotFoundError",
    "LockTimeoutError",
    "ManifestError",
    "MissingBlobError",
    "ParamLayoutError",
    "RemoteUnavailableError",
    "RollbackError",
    "StoreError",
    "TrustError",
    "UnsafeStoreError",
]


class CubinstoreError(Exception):
    """Base class of every error cubinstore raises on purpose."""


class BadArgumentError(CubinstoreError, ValueError):
    """A caller passed a malformed value (digest, URL, arch, size, env var, flag)."""


class ManifestError(CubinstoreError):
    """A manifest is unreadable or does not follow the ``cubinstore/manifest/v1`` schema."""


class KernelNotFoundError(CubinstoreError, LookupError):
    """No kernel in the manifest matches the id, family or parameters asked for."""


class IncompatibleArchError(CubinstoreError):
    """The manifest has no CUBIN that the running GPU's compute capability can load."""


class IntegrityError(CubinstoreError):
    """Bytes did not match their digest or expected size; they were never used."""


class MissingBlobError(CubinstoreError, LookupError):
    """No store layer has the blob (every layer answered a clean miss)."""


class RemoteUnavailableError(CubinstoreError):
    """A remote store could not be reached or kept failing after retries."""


class StoreError(CubinstoreError):
    """The local store could not be read or written (disk full, permissions, rename failure)."""


class LockTimeoutError(StoreError):
    """A per-digest lock stayed held by another process for longer than the lock timeout."""


class BundleError(CubinstoreError):
    """An offline bundle (``pack``/``unpack``) is malformed or does not match its manifest."""


class ParamLayoutError(ManifestError):
    """The manifest's declared parameter types do not match the CUBIN's real parameter layout."""


class CubinFormatError(ManifestError):
    """Bytes a manifest names as a CUBIN are not a well-formed CUDA ELF file (or, for a PTX arch
    ``compute_...``, not PTX text for that target)."""


class CudaError(CubinstoreError):
    """The CUDA driver refused a call (or is missing); the message names the call and its subject."""


class DriverVersionError(CudaError):
    """The host's CUDA driver is older than the oldest one a kernel's manifest says loads it; the
    message names both versions. Nothing was fetched or handed to the driver."""


class UnsafeStoreError(StoreError):
    """The local store's directories would let another user redirect or delete entries (a link
    inside the store, or a directory writable by others); nothing was written."""


class TrustError(CubinstoreError):
    """A signed release record could not be trusted: bad or unknown signature, revoked key,
    wrong channel, malformed record or trust policy."""


class RollbackError(TrustError):
    """A validly signed release record is older than one this host already accepted."""


class ExpiredReleaseError(TrustError):
    """A validly signed release record has passed its expiry (a frozen or stale channel)."""


class JitCompileError(CubinstoreError):
    """nvcc refused a JIT translation unit; the message holds the command (relative paths) and nvcc's output."""


class DemanglerError(CubinstoreError):
    """The demangler (``cu++filt`` or ``c++filt``) could not be found, could not run, hung or printed
    something other than names, while resolving an entry given as a C++ name."""


class JitTimeoutError(JitCompileError):
    """A JIT compile ran past its time limit (``CUBINSTORE_JIT_TIMEOUT`` or ``timeout=``): nvcc and
    every process it started were killed, the key's lock released and nothing cached."""
