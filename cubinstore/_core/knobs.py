"""Every environment variable cubinstore reads: one ``Variable`` descriptor each, read through typed accessors.

Nothing else in the package touches ``os.environ`` (tests/core/test_knobs.py checks it). Values are
read at call time (not import time) so tests and long-lived processes see changes.
``VARIABLES`` is the one table of the ``CUBINSTORE_*`` variables: README's "Environment
variables" table is checked against it (names, types, defaults), so neither drifts.
Also read here, with the meaning they have for ``third_party/cuda``: ``CUDA_PATH``,
``CUDA_HOME``, ``PATH`` (finding the toolkit) and ``XDG_CACHE_HOME``/``LOCALAPPDATA`` (the
user cache directory).
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING

from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError

if TYPE_CHECKING:  # pathlib is imported when a path is read: cubinstore-nvcc's hit path reads none as a Path
    from pathlib import Path

__all__ = [
    "VARIABLES",
    "Variable",
    "allow_shared_store",
    "verify_full",
    "native",
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
    "nvcc",
    "nvcc_publish",
    "offline",
    "registry_auth_files",
    "remotes",
    "trust_policy",
]

# What each type reads as: path (a Path, None when unset or empty), URLs (comma-separated),
# bool (1/0/true/false/yes/no/on/off; empty is false), seconds (positive, finite), int
# (non-negative, base 10), str (stripped).
TYPES = ("path", "URLs", "bool", "seconds", "int", "str")


class Variable:
    """One environment variable: its name, type (one of ``TYPES``), default and meaning.

    ``default`` is the value an unset variable reads as (None: no value), ``shown`` how the
    README writes a default that is computed (the user cache directory). A plain class, not a
    dataclass: ``cubinstore-nvcc`` imports this module on every call, and ``dataclasses`` costs
    more to import than the whole of a cache hit's work.
    """

    __slots__ = ("name", "type", "default", "doc", "shown")

    def __init__(self, name: str, type: str, default: object, doc: str, shown: str | None = None) -> None:  # noqa: A002
        self.name, self.type, self.default, self.doc, self.shown = name, type, default, doc, shown

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, {self.type!r}, {self.default!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Variable) and all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __hash__(self) -> int:
        return hash(self.name)

    def get(self) -> object:
        """The variable's value, parsed by its type (what its accessor below returns, before any fallback)."""
        return _READERS[self.type](self)

    @property
    def default_text(self) -> str:
        """The default as README's table writes it."""
        if self.shown is not None:
            return self.shown
        if self.default is None or self.default == ():
            return "(none)"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


HOME = Variable("CUBINSTORE_HOME", "path", None, "root of the local store", shown="user cache dir/cubinstore")
REMOTE = Variable("CUBINSTORE_REMOTE", "URLs", (), "comma-separated remotes, tried in order: HTTP CAS base URLs, oci://HOST[:PORT]/REPO registries")
DISK_CACHE = Variable("CUBINSTORE_DISK_CACHE", "path", None, "Bazel --disk_cache directory, read only")
OFFLINE = Variable("CUBINSTORE_OFFLINE", "bool", False, "never touch the network; a local miss is an error")
HTTP_TIMEOUT = Variable("CUBINSTORE_HTTP_TIMEOUT", "seconds", 30.0, "read timeout: longest wait for the next bytes")
HTTP_CONNECT_TIMEOUT = Variable("CUBINSTORE_HTTP_CONNECT_TIMEOUT", "seconds", 5.0, "TCP/TLS connect timeout")
HTTP_RETRIES = Variable("CUBINSTORE_HTTP_RETRIES", "int", 3, "retries after the first attempt (5xx, timeouts)")
HTTP_DEADLINE = Variable("CUBINSTORE_HTTP_DEADLINE", "seconds", 120.0, "total time for one blob, retries included")
LOCK_TIMEOUT = Variable("CUBINSTORE_LOCK_TIMEOUT", "seconds", 600.0, "longest wait for another process's download")
MEMORY_BYTES = Variable("CUBINSTORE_MEMORY_BYTES", "int", 256 * 1024 * 1024, "in-process cache size; 0 disables it")
MANIFEST = Variable("CUBINSTORE_MANIFEST", "str", None, "manifest cubinstore.ops opens by default: a path or sha256:<hex>")
JIT = Variable("CUBINSTORE_JIT", "bool", True, "a JIT miss may run nvcc at run time; off: only index hits")
JIT_TIMEOUT = Variable("CUBINSTORE_JIT_TIMEOUT", "seconds", 600.0,
                       "longest a JIT compile may run; past it nvcc and every process it started are killed")
HOST_CC = Variable("CUBINSTORE_HOST_CC", "str", "gcc", "host compiler (a name on /usr/bin:/bin) of Bazel and the JIT")
CUTLASS_INCLUDE = Variable("CUBINSTORE_CUTLASS_INCLUDE", "path", None,
                           "CUTLASS/CuTe include root of Bazel and of family JIT templates")
ALLOW_SHARED_STORE = Variable("CUBINSTORE_ALLOW_SHARED_STORE", "bool", False,
                              "write to a local store whose directories other users can write")
TRUST_POLICY = Variable("CUBINSTORE_TRUST_POLICY", "path", None, "trust policy file for channel:NAME (signed releases)")
FETCH_JOBS = Variable("CUBINSTORE_FETCH_JOBS", "int", 16, "blobs prefetch downloads (and publish uploads) at once")
NVCC = Variable("CUBINSTORE_NVCC", "path", None, "the real nvcc cubinstore-nvcc runs", shown="the toolkit's bin/nvcc")
VERIFY = Variable("CUBINSTORE_VERIFY", "str", "auto",
                  "auto: a first load from a store you own checks size and xxh3-128; full: sha256 on every first load")
NVCC_PUBLISH = Variable("CUBINSTORE_NVCC_PUBLISH", "bool", False,
                        "cubinstore-nvcc uploads what it compiles to CUBINSTORE_REMOTE (trusted writers, CI)")
NATIVE = Variable("CUBINSTORE_NATIVE", "bool", True,
                  "a first load's read and driver calls, and each launch, in the compiled helper, where it was built; "
                  "off: Python only")

VARIABLES: tuple[Variable, ...] = (
    HOME, REMOTE, DISK_CACHE, OFFLINE, HTTP_TIMEOUT, HTTP_CONNECT_TIMEOUT, HTTP_RETRIES, HTTP_DEADLINE,
    LOCK_TIMEOUT, MEMORY_BYTES, MANIFEST, JIT, JIT_TIMEOUT, HOST_CC, CUTLASS_INCLUDE, ALLOW_SHARED_STORE,
    TRUST_POLICY, FETCH_JOBS, NVCC, NVCC_PUBLISH, VERIFY, NATIVE,
)

# Not ours, read as third_party/cuda/cuda_toolkit.bzl reads them: where the JIT finds the toolkit.
CUDA_PATH = Variable("CUDA_PATH", "path", None, "the first place the CUDA toolkit is looked for")
CUDA_HOME = Variable("CUDA_HOME", "path", None, "the second place the CUDA toolkit is looked for")

# Not ours, read as skopeo, podman and docker read them: the files registry credentials are in.
REGISTRY_AUTH_FILE = Variable("REGISTRY_AUTH_FILE", "path", None, "containers-auth.json file of skopeo and podman")
XDG_RUNTIME_DIR = Variable("XDG_RUNTIME_DIR", "path", None, "holds containers/auth.json (`skopeo login`)")
DOCKER_CONFIG = Variable("DOCKER_CONFIG", "path", None, "docker's configuration directory (config.json)")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _raw(var: Variable) -> str | None:
    value = os.environ.get(var.name)
    return None if value is None else value.strip()


def _bool(var: Variable) -> bool:
    value = _raw(var)
    if value is None:
        return bool(var.default)
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise BadArgumentError(f"{var.name}: expected one of 1/0/true/false/yes/no/on/off, got {show(value)}")


def _seconds(var: Variable) -> float:
    value = _raw(var)
    if not value:
        return float(var.default)  # type: ignore[arg-type]
    try:
        seconds = float(value)
    except ValueError:
        raise BadArgumentError(f"{var.name}: expected a number of seconds, got {show(value)}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadArgumentError(f"{var.name}: expected a positive number of seconds, got {show(value)}")
    return seconds


def _count(var: Variable) -> int:
    value = _raw(var)
    if not value:
        return int(var.default)  # type: ignore[call-overload]
    try:
        count = int(value, 10)
    except ValueError:
        raise BadArgumentError(f"{var.name}: expected a non-negative integer, got {show(value)}") from None
    if count < 0:
        raise BadArgumentError(f"{var.name}: expected a non-negative integer, got {show(value)}")
    return count


def _path(var: Variable) -> Path | None:
    value = _raw(var)
    if not value:
        return None
    if "\0" in value:
        raise BadArgumentError(f"{var.name}: path contains a NUL byte: {show(value)}")
    from pathlib import Path

    return Path(value).expanduser()


def _urls(var: Variable) -> tuple[str, ...]:
    value = _raw(var)
    if not value:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _str(var: Variable) -> str | None:
    return _raw(var) or var.default  # type: ignore[return-value]


_READERS = {"path": _path, "URLs": _urls, "bool": _bool, "seconds": _seconds, "int": _count, "str": _str}


def user_cache_dir() -> Path:
    """The platform's per-user cache directory (XDG on Linux)."""
    from pathlib import Path

    return Path(user_cache_dir_str())


def user_cache_dir_str() -> str:
    """``user_cache_dir()`` as a string, computed without pathlib."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        return base if base else os.path.join(os.path.expanduser("~"), "AppData", "Local")
    if sys.platform == "darwin":
        return os.path.join(os.path.expanduser("~"), "Library", "Caches")
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    # XDG says a relative value is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return xdg
    return os.path.join(os.path.expanduser("~"), ".cache")


def home() -> Path:
    """Root of the local store: ``CUBINSTORE_HOME``, else ``<user cache dir>/cubinstore``."""
    from pathlib import Path

    return Path(home_str())


def home_str() -> str:
    """``home()`` as a string, computed without pathlib (the hit path of ``cubinstore-nvcc``)."""
    value = _raw(HOME)
    if not value:
        return os.path.join(user_cache_dir_str(), "cubinstore")
    if "\0" in value:
        raise BadArgumentError(f"{HOME.name}: path contains a NUL byte: {show(value)}")
    return os.path.expanduser(value)


def remotes() -> tuple[str, ...]:
    """``CUBINSTORE_REMOTE`` split on commas; empty items are dropped. URLs are validated by the HTTP store."""
    return _urls(REMOTE)


def registry_auth_files() -> list[Path]:
    """The files an ``oci://`` remote's credentials are read from, first match wins (the order
    of containers-auth.json(5)): ``REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``,
    then docker's ``$DOCKER_CONFIG/config.json`` (default ``~/.docker/config.json``)."""
    from pathlib import Path

    files = [p for p in (_path(REGISTRY_AUTH_FILE),) if p is not None]
    runtime = _path(XDG_RUNTIME_DIR)
    if runtime is not None:
        files.append(runtime / "containers" / "auth.json")
    docker = _path(DOCKER_CONFIG)
    files.append((docker if docker is not None else Path(os.path.expanduser("~")) / ".docker") / "config.json")
    return files


def disk_cache() -> Path | None:
    """``CUBINSTORE_DISK_CACHE``: a Bazel ``--disk_cache`` directory, or None."""
    return _path(DISK_CACHE)


def offline() -> bool:
    """``CUBINSTORE_OFFLINE``: when true no remote store is ever contacted."""
    return _bool(OFFLINE)


def http_timeout() -> float:
    """``CUBINSTORE_HTTP_TIMEOUT``: read timeout in seconds."""
    return _seconds(HTTP_TIMEOUT)


def http_connect_timeout() -> float:
    """``CUBINSTORE_HTTP_CONNECT_TIMEOUT``: connect timeout in seconds."""
    return _seconds(HTTP_CONNECT_TIMEOUT)


def http_retries() -> int:
    """``CUBINSTORE_HTTP_RETRIES``: retries after the first attempt."""
    return _count(HTTP_RETRIES)


def http_deadline() -> float:
    """``CUBINSTORE_HTTP_DEADLINE``: total seconds for one blob, retries included."""
    return _seconds(HTTP_DEADLINE)


def lock_timeout() -> float:
    """``CUBINSTORE_LOCK_TIMEOUT``: seconds to wait for another process holding a digest's lock."""
    return _seconds(LOCK_TIMEOUT)


def memory_bytes() -> int:
    """``CUBINSTORE_MEMORY_BYTES``: capacity of the in-process cache."""
    return _count(MEMORY_BYTES)


def fetch_jobs() -> int:
    """``CUBINSTORE_FETCH_JOBS``: parallel downloads of ``prefetch``, uploads of ``publish`` (sized for a CDN; 1 is sequential)."""
    return max(1, _count(FETCH_JOBS))


def manifest() -> str | None:
    """``CUBINSTORE_MANIFEST``: the manifest ``cubinstore.ops`` opens when none was set."""
    return _str(MANIFEST)


def allow_shared_store() -> bool:
    """``CUBINSTORE_ALLOW_SHARED_STORE``: write even where other users can write the store's directories."""
    return _bool(ALLOW_SHARED_STORE)


_VERIFY_MODES = ("auto", "full")


def verify_full() -> bool:
    """``CUBINSTORE_VERIFY``: ``full`` keeps sha256 on every first load, even from a store this user owns."""
    value = (_raw(VERIFY) or str(VERIFY.default)).lower()
    if value not in _VERIFY_MODES:
        raise BadArgumentError(f"{VERIFY.name}: expected one of {', '.join(_VERIFY_MODES)}, got {show(value)}")
    return value == "full"


def native() -> bool:
    """``CUBINSTORE_NATIVE``: use the compiled first-load helper (``cubinstore._core.native``) where it was built."""
    return _bool(NATIVE)


def trust_policy() -> Path | None:
    """``CUBINSTORE_TRUST_POLICY``: the trust policy file that ``channel:NAME`` is verified against."""
    return _path(TRUST_POLICY)


# -- the JIT (cubinstore.jit) ---------------------------------------------------------------------
# CUDA_PATH, CUDA_HOME, PATH and CUBINSTORE_HOST_CC mean what they mean to
# third_party/cuda/cuda_toolkit.bzl, so the JIT finds the toolkit and compiler Bazel would.

def jit() -> bool:
    """``CUBINSTORE_JIT``: whether a miss may run nvcc at run time (off: index hits only)."""
    return _bool(JIT)


def jit_timeout() -> float:
    """``CUBINSTORE_JIT_TIMEOUT``: seconds one JIT compile may run before it is killed."""
    return _seconds(JIT_TIMEOUT)


def host_cc() -> str:
    """``CUBINSTORE_HOST_CC``: the host compiler's command name on /usr/bin:/bin (default gcc)."""
    return _str(HOST_CC)


def cuda_path() -> Path | None:
    """``CUDA_PATH``: the first place the toolkit is looked for."""
    return _path(CUDA_PATH)


def cuda_home() -> Path | None:
    """``CUDA_HOME``: the second place the toolkit is looked for."""
    return _path(CUDA_HOME)


def which(command: str) -> str | None:
    """``command`` looked up on ``$PATH`` (the last place the toolkit is looked for)."""
    import shutil

    return shutil.which(command, path=os.environ.get("PATH"))


# -- cubinstore-nvcc ------------------------------------------------------------------------------

#: Variables that change what nvcc or the host compiler does without a word on the command line:
#: ``cubinstore-nvcc`` hands a call made under any of them to the real nvcc (its compile runs
#: in a clean environment, so it could not honour them).
NVCC_OVERRIDES: tuple[str, ...] = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CPATH", "C_INCLUDE_PATH",
                                   "CPLUS_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")


def nvcc() -> Path | None:
    """``CUBINSTORE_NVCC``: the nvcc ``cubinstore-nvcc`` runs (None: the toolkit's)."""
    return _path(NVCC)


def nvcc_publish() -> bool:
    """``CUBINSTORE_NVCC_PUBLISH``: ``cubinstore-nvcc`` uploads its compiles to the remote (CI only)."""
    return _bool(NVCC_PUBLISH)


def nvcc_overrides() -> list[str]:
    """The ``NVCC_OVERRIDES`` that are set (to anything but the empty string)."""
    return [name for name in NVCC_OVERRIDES if os.environ.get(name)]


def toolchain_environment() -> tuple[str, ...]:
    """What decides which nvcc, toolkit and host compiler a compile uses (raw values, "" when
    unset): the name of ``cubinstore-nvcc``'s cache of their identities on this host."""
    names = (NVCC.name, CUDA_PATH.name, CUDA_HOME.name, "PATH", HOST_CC.name)
    return tuple(f"{n}={os.environ.get(n, '')}" for n in names)


def cutlass_include() -> Path | None:
    """``CUBINSTORE_CUTLASS_INCLUDE``: the CUTLASS/CuTe include root (Bazel's repository rule and the JIT)."""
    return _path(CUTLASS_INCLUDE)
