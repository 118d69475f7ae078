"""Every environment variable cubinstore reads, through typed accessors.

Nothing else in the package calls ``os.environ``. Values are read at call time
(not import time) so tests and long-lived processes see changes.

=============================== ======== ================================= ==========================================
Variable                        Type     Default                           Meaning
=============================== ======== ================================= ==========================================
CUBINSTORE_HOME                 path     user cache dir + ``/cubinstore``  root of the local store (``<root>/v1/...``)
CUBINSTORE_REMOTE               URLs     (none)                            comma-separated HTTP CAS base URLs, tried in order
CUBINSTORE_DISK_CACHE           path     (none)                            Bazel ``--disk_cache`` directory, read only
CUBINSTORE_OFFLINE              bool     false                             never touch the network; a local miss is an error
CUBINSTORE_HTTP_TIMEOUT         seconds  30                                read timeout: longest wait for the next bytes
CUBINSTORE_HTTP_CONNECT_TIMEOUT seconds  5                                 TCP/TLS connect timeout
CUBINSTORE_HTTP_RETRIES         int      3                                 retries after the first attempt (5xx, timeouts)
CUBINSTORE_HTTP_DEADLINE        seconds  120                               total time for one blob, retries included
CUBINSTORE_LOCK_TIMEOUT         seconds  600                               longest wait for another process's download
CUBINSTORE_MEMORY_BYTES         int      268435456                         in-process cache size; 0 disables it
CUBINSTORE_MANIFEST             str      (none)                            manifest ``cubinstore.ops`` opens by default: a path or ``sha256:<hex>``
CUBINSTORE_JIT                  bool     true                              a JIT miss may run nvcc; off: only index hits
CUBINSTORE_JIT_TIMEOUT          seconds  600                               longest JIT compile; past it nvcc's process group is killed
CUBINSTORE_HOST_CC              str      gcc                               host compiler (name on /usr/bin:/bin) of Bazel and the JIT
CUBINSTORE_CUTLASS_INCLUDE      path     (none)                            CUTLASS/CuTe include root (Bazel, family JIT templates)
CUBINSTORE_ALLOW_SHARED_STORE   bool     false                             write to a store whose directories others can write
CUBINSTORE_TRUST_POLICY         path     (none)                            trust policy for ``channel:NAME`` (signed releases)
CUBINSTORE_FETCH_JOBS           int      16                                parallel downloads of ``prefetch`` (uploads of ``publish``)
=============================== ======== ================================= ==========================================
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cubinstore._core.digest import show
from cubinstore.errors import BadArgumentError

__all__ = [
    "VARIABLES",
    "Variable",
    "allow_shared_store",
    "cutlass_include",
    "disk_cache",
    "fetch_jobs",
    "home",
    "http_connect_timeout",
    "http_deadline",
    "http_retries",
    "http_timeout",
    "host_cc",
    "jit",
    "jit_timeout",
    "lock_timeout",
    "manifest",
    "memory_bytes",
    "offline",
    "remotes",
    "trust_policy",
]


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    default: str
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("CUBINSTORE_HOME", "path", "user cache dir/cubinstore", "root of the local store"),
    Variable("CUBINSTORE_REMOTE", "URLs", "", "comma-separated HTTP CAS base URLs, tried in order"),
    Variable("CUBINSTORE_DISK_CACHE", "path", "", "Bazel --disk_cache directory, read only"),
    Variable("CUBINSTORE_OFFLINE", "bool", "0", "never touch the network; a local miss is an error"),
    Variable("CUBINSTORE_HTTP_TIMEOUT", "seconds", "30", "read timeout"),
    Variable("CUBINSTORE_HTTP_CONNECT_TIMEOUT", "seconds", "5", "connect timeout"),
    Variable("CUBINSTORE_HTTP_RETRIES", "int", "3", "retries after the first attempt"),
    Variable("CUBINSTORE_HTTP_DEADLINE", "seconds", "120", "total time for one blob, retries included"),
    Variable("CUBINSTORE_LOCK_TIMEOUT", "seconds", "600", "longest wait for another process's download"),
    Variable("CUBINSTORE_MEMORY_BYTES", "int", "268435456", "in-process cache size; 0 disables it"),
    Variable("CUBINSTORE_MANIFEST", "str", "", "manifest cubinstore.ops opens by default: a path or sha256:<hex>"),
    Variable("CUBINSTORE_JIT", "bool", "1", "a JIT miss may run nvcc at run time; off: only index hits"),
    Variable("CUBINSTORE_JIT_TIMEOUT", "seconds", "600",
             "longest a JIT compile may run; past it nvcc and every process it started are killed (JitTimeoutError)"),
    Variable("CUBINSTORE_HOST_CC", "str", "gcc", "host compiler (a name on /usr/bin:/bin) of Bazel and the JIT"),
    Variable("CUBINSTORE_CUTLASS_INCLUDE", "path", "", "CUTLASS/CuTe include root of Bazel and of family JIT templates"),
    Variable("CUBINSTORE_ALLOW_SHARED_STORE", "bool", "0",
             "write to a local store whose directories other users can write (a store shared by a trusted group)"),
    Variable("CUBINSTORE_TRUST_POLICY", "path", "", "trust policy file for channel:NAME (signed releases)"),
    Variable("CUBINSTORE_FETCH_JOBS", "int", "16", "blobs prefetch downloads (and publish uploads) at once, each over a kept-alive connection"),
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def _bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise BadArgumentError(f"{name}: expected one of 1/0/true/false/yes/no/on/off, got {show(value)}")


def _seconds(name: str, default: float) -> float:
    value = _raw(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise BadArgumentError(f"{name}: expected a number of seconds, got {show(value)}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadArgumentError(f"{name}: expected a positive number of seconds, got {show(value)}")
    return seconds


def _count(name: str, default: int) -> int:
    value = _raw(name)
    if not value:
        return default
    try:
        count = int(value, 10)
    except ValueError:
        raise BadArgumentError(f"{name}: expected a non-negative integer, got {show(value)}") from None
    if count < 0:
        raise BadArgumentError(f"{name}: expected a non-negative integer, got {show(value)}")
    return count


def _path(name: str) -> Path | None:
    value = _raw(name)
    if not value:
        return None
    if "\0" in value:
        raise BadArgumentError(f"{name}: path contains a NUL byte: {show(value)}")
    return Path(value).expanduser()


def user_cache_dir() -> Path:
    """The platform's per-user cache directory (XDG on Linux)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        return Path(base) if base else Path.home() / "AppData" / "Local"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    # XDG says a relative value is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    return Path.home() / ".cache"


def home() -> Path:
    """Root of the local store: ``CUBINSTORE_HOME``, else ``<user cache dir>/cubinstore``."""
    return _path("CUBINSTORE_HOME") or user_cache_dir() / "cubinstore"


def remotes() -> tuple[str, ...]:
    """``CUBINSTORE_REMOTE`` split on commas; empty items are dropped. URLs are validated by the HTTP store."""
    value = _raw("CUBINSTORE_REMOTE")
    if not value:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def disk_cache() -> Path | None:
    """``CUBINSTORE_DISK_CACHE``: a Bazel ``--disk_cache`` directory, or None."""
    return _path("CUBINSTORE_DISK_CACHE")


def offline() -> bool:
    """``CUBINSTORE_OFFLINE``: when true no remote store is ever contacted."""
    return _bool("CUBINSTORE_OFFLINE", False)


def http_timeout() -> float:
    """``CUBINSTORE_HTTP_TIMEOUT``: read timeout in seconds."""
    return _seconds("CUBINSTORE_HTTP_TIMEOUT", 30.0)


def http_connect_timeout() -> float:
    """``CUBINSTORE_HTTP_CONNECT_TIMEOUT``: connect timeout in seconds."""
    return _seconds("CUBINSTORE_HTTP_CONNECT_TIMEOUT", 5.0)


def http_retries() -> int:
    """``CUBINSTORE_HTTP_RETRIES``: retries after the first attempt."""
    return _count("CUBINSTORE_HTTP_RETRIES", 3)


def http_deadline() -> float:
    """``CUBINSTORE_HTTP_DEADLINE``: total seconds for one blob, retries included."""
    return _seconds("CUBINSTORE_HTTP_DEADLINE", 120.0)


def lock_timeout() -> float:
    """``CUBINSTORE_LOCK_TIMEOUT``: seconds to wait for another process holding a digest's lock."""
    return _seconds("CUBINSTORE_LOCK_TIMEOUT", 600.0)


def memory_bytes() -> int:
    """``CUBINSTORE_MEMORY_BYTES``: capacity of the in-process cache."""
    return _count("CUBINSTORE_MEMORY_BYTES", 256 * 1024 * 1024)


def fetch_jobs() -> int:
    """``CUBINSTORE_FETCH_JOBS``: parallel downloads of ``prefetch``, uploads of ``publish`` (sized for a CDN; 1 is sequential)."""
    return max(1, _count("CUBINSTORE_FETCH_JOBS", 16))


def manifest() -> str | None:
    """``CUBINSTORE_MANIFEST``: the manifest ``cubinstore.ops`` opens when none was set."""
    return _raw("CUBINSTORE_MANIFEST") or None


def allow_shared_store() -> bool:
    """``CUBINSTORE_ALLOW_SHARED_STORE``: write even where other users can write the store's directories."""
    return _bool("CUBINSTORE_ALLOW_SHARED_STORE", False)


def trust_policy() -> Path | None:
    """``CUBINSTORE_TRUST_POLICY``: the trust policy file that ``channel:NAME`` is verified against."""
    return _path("CUBINSTORE_TRUST_POLICY")


# -- the JIT (cubinstore.jit) ---------------------------------------------------------------------
# CUDA_PATH, CUDA_HOME, PATH and CUBINSTORE_HOST_CC mean what they mean to
# third_party/cuda/cuda_toolkit.bzl, so the JIT finds the toolkit and compiler Bazel would.

def jit() -> bool:
    """``CUBINSTORE_JIT``: whether a miss may run nvcc at run time (off: index hits only)."""
    return _bool("CUBINSTORE_JIT", True)


def jit_timeout() -> float:
    """``CUBINSTORE_JIT_TIMEOUT``: seconds one JIT compile may run before it is killed."""
    return _seconds("CUBINSTORE_JIT_TIMEOUT", 600.0)


def host_cc() -> str:
    """``CUBINSTORE_HOST_CC``: the host compiler's command name on /usr/bin:/bin (default gcc)."""
    return _raw("CUBINSTORE_HOST_CC") or "gcc"


def cuda_path() -> Path | None:
    """``CUDA_PATH``: the first place the toolkit is looked for."""
    return _path("CUDA_PATH")


def cuda_home() -> Path | None:
    """``CUDA_HOME``: the second place the toolkit is looked for."""
    return _path("CUDA_HOME")


def which(command: str) -> str | None:
    """``command`` looked up on ``$PATH`` (the last place the toolkit is looked for)."""
    import shutil

    return shutil.which(command, path=os.environ.get("PATH"))


def cutlass_include() -> Path | None:
    """``CUBINSTORE_CUTLASS_INCLUDE``: the CUTLASS/CuTe include root (Bazel's repository rule and the JIT)."""
    return _path("CUBINSTORE_CUTLASS_INCLUDE")
