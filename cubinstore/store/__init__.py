"""``Store``: layers tried in order (memory, local directory, Bazel disk cache, HTTP remotes).

Every byte a layer returns is verified here (size first, then sha256) before it is
stored in a faster layer or returned; what ``get`` returns is exactly the verified
``bytes`` object. A miss in the local store takes a per-digest lock across processes
and re-checks before going further, so N processes needing one blob download it once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cubinstore._core import knobs as _env
from cubinstore._core.abi import MAX_BLOB_SIZE
from cubinstore._core.digest import EMPTY_SHA256_HEX, Digest, verify
from cubinstore._core.text import show
from cubinstore.store.layer import Layer, UNSIZED_LIMIT, limit_for
from cubinstore.store.local.cas import LocalLayer
from cubinstore._core.log import get_logger
from cubinstore.store.memory import MemoryLayer
from cubinstore.store.sources import DirectorySource, DiskCacheLayer
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    IntegrityError,
    LockTimeoutError,
    MissingBlobError,
    RemoteUnavailableError,
    StoreError,
)

if TYPE_CHECKING:
    from cubinstore.store.http import HttpLayer

__all__ = [
    "default_store",
    "DirectorySource",
    "DiskCacheLayer",
    "HttpLayer",
    "Layer",
    "LocalLayer",
    "MemoryLayer",
    "Store",
    "StoreStats",
    "UNSIZED_LIMIT",
]

_log = get_logger(__name__)


# The layers' names before 2026-12-06, when "store" meant both the whole (Store) and a layer:
# still importable, the same classes.
LocalStore = LocalLayer
MemoryStore = MemoryLayer
DiskCacheStore = DiskCacheLayer


def __getattr__(name: str) -> Any:
    # http.client pulls in ssl and email: a process with no remote never imports them.
    if name in ("HttpLayer", "HttpStore"):
        from cubinstore.store.http import HttpLayer

        return HttpLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class StoreStats:
    """Counters of one ``Store`` in this process (``cubinstore stats`` shows the local store's totals)."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    verification_failures: int = 0


class Store:
    """Verified blobs by digest from an ordered list of layers.

    ``strict``: raise ``StoreError`` when a verified blob cannot be written to a cache
    layer (``prefetch`` wants that); by default a full disk only logs a warning and the
    verified bytes are still returned. ``backfill=False`` leaves the layers unchanged.
    """

    def __init__(self, layers: Iterable[Layer], *, strict: bool = False, backfill: bool = True) -> None:
        self.layers: tuple[Layer, ...] = tuple(layers)
        for layer in self.layers:
            if not isinstance(layer, Layer):
                raise BadArgumentError(f"Store layers must be Layer instances, got {show(layer)}")
        self.strict = strict
        self.backfill = backfill
        # Fixed with the layers: the first one that locks, and the local store that keeps the counts.
        self._lock_at = next((i for i, layer in enumerate(self.layers) if layer.lockable), len(self.layers))
        self._local = next((layer for layer in self.layers if isinstance(layer, LocalLayer)), None)
        self._counts = {"hits": 0, "misses": 0, "bytes_fetched": 0, "verification_failures": 0}
        self._counts_lock = threading.Lock()
        # The hit path: the local store when only trusted in-process layers (memory) come before it.
        front = self.layers[:self._lock_at]
        self._fast: LocalLayer | None = None
        if self._local is not None and self.layers.index(self._local) == self._lock_at and all(layer.trusted for layer in front):
            self._fast = self._local
        self._front = front

    @classmethod
    def from_env(cls, *, extra_remotes: Sequence[str] = (), strict: bool = False) -> Store:
        """memory -> local (CUBINSTORE_HOME or the user cache dir) -> CUBINSTORE_DISK_CACHE ->
        ``extra_remotes`` + CUBINSTORE_REMOTE, the remotes left out when CUBINSTORE_OFFLINE is set."""
        layers: list[Layer] = []
        if _env.memory_bytes() > 0:
            layers.append(MemoryLayer(_env.memory_bytes()))
        layers.append(LocalLayer(_env.home()))
        disk_cache = _env.disk_cache()
        if disk_cache is not None:
            layers.append(DiskCacheLayer(disk_cache))
        remotes = [*extra_remotes, *_env.remotes()]
        if remotes:
            from cubinstore.store.http import redact
            from cubinstore.store.remotes import remote_layer
        if _env.offline():
            if remotes:
                _log.debug("CUBINSTORE_OFFLINE is set: not using remotes %s", ", ".join(map(redact, remotes)))
        else:
            layers.extend(remote_layer(url) for url in dict.fromkeys(remotes))
        return cls(layers, strict=strict)

    def sharing_layers(self) -> Store:
        """A new Store over the same layer objects (their caches and files shared), with counters and
        a layer list of its own: a layer added to it (an OCI registry a release is opened from) is
        not added to this one."""
        return Store(self.layers, strict=self.strict, backfill=self.backfill)

    @property
    def local(self) -> LocalLayer | None:
        """The first local directory layer, if any."""
        return self._local

    @property
    def stats(self) -> StoreStats:
        with self._counts_lock:
            return StoreStats(**self._counts)

    def get(self, digest: Digest | str, size: int | None = None, *, name: str | None = None) -> bytes:
        """The verified bytes of ``digest`` (``size`` bytes when given); ``name`` (a kernel id) is used in errors.

        Raises ``BadArgumentError`` (before any I/O) for a malformed digest or size,
        ``IntegrityError`` when only bad bytes were found, ``RemoteUnavailableError`` when
        a remote could not answer, ``MissingBlobError`` when every layer missed.
        """
        fast = self._fast
        if (fast is not None and digest.__class__ is Digest and size.__class__ is int and 0 < size <= MAX_BLOB_SIZE  # type: ignore[operator]
                and digest.hex != EMPTY_SHA256_HEX):
            # The hit path, for a well-formed request (the checks below, passed): the trusted layers
            # in front (in-process memory: bytes verified when stored), then one read and check of
            # the local entry (``LocalLayer.read_verified``). A None there takes the layered path
            # below, which words what went wrong, quarantines bad bytes and fetches.
            for layer in self._front:
                data = layer.read(digest, size)
                if data is not None:
                    self._count_hit(None)  # an in-process memory hit stays in-process
                    return data
            data = fast.read_verified(digest, size)  # type: ignore[arg-type]
            if data is not None:
                if self._front and self.backfill:
                    self._backfill(digest, data, self._lock_at, name)
                self._count_hit(fast)
                if _log.isEnabledFor(logging.DEBUG):
                    _log.debug("%s%s: hit in %s (%d bytes)", digest, _for(name), fast.name, len(data))
                return data
        digest = Digest.parse(digest)
        if digest.is_empty_blob:
            raise BadArgumentError(f"{digest}{_for(name)} is the digest of zero bytes, which is not a CUBIN")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOB_SIZE):
            raise BadArgumentError(f"invalid size {show(size)} for {digest}{_for(name)}: expected 1..{MAX_BLOB_SIZE} bytes")

        outcomes: list[str] = []
        errors: list[CubinstoreError] = []
        lock_at = self._lock_at
        found = self._try(digest, size, name, range(min(lock_at + 1, len(self.layers))), outcomes, errors)
        lock = self.layers[lock_at].lock(digest) if found is None and lock_at + 1 < len(self.layers) else None
        if lock is not None:
            with _or_unlocked(lock, self.layers[lock_at], digest, strict=self.strict):
                # Another process may have filled the blob while we waited for the lock.
                found = self._try(digest, size, name, range(lock_at, len(self.layers)), outcomes, errors)
                # Store before releasing the lock, or a waiter re-checks too early and downloads again.
                if found is not None and self.backfill:
                    self._backfill(digest, found[1], found[0], name)
        elif found is not None and self.backfill:
            self._backfill(digest, found[1], found[0], name)
        if found is None:
            self._count(misses=1)
            self._persist(misses=1)
            raise self._failure(digest, size, name, outcomes, errors)
        index, data = found
        layer = self.layers[index]
        if layer.cache:
            self._count_hit(None if layer.trusted else self._local)  # in-process memory hits stay in-process
        else:
            self._count(misses=1, bytes_fetched=len(data))
            self._persist(misses=1, bytes_fetched=len(data))
        return data

    def get_local(self, digest: Digest, size: int) -> bytes | None:
        """The verified bytes of ``digest`` if the local store has them whole, else None; counted as a hit.

        A bulk reader's fast path: one read and one hash (``LocalLayer.read_verified``), none of
        ``get``'s layering. Anything else (a miss, a link, bad bytes) is None and changes nothing:
        the caller then calls ``get``, which quarantines a bad entry and fetches the blob from
        the other layers.
        """
        local = self._local
        data = None if local is None else local.read_verified(digest, size)
        if data is not None:
            self._count_hit(local)
        return data

    # -- internals ------------------------------------------------------------------------------

    def _count_hit(self, local: LocalLayer | None) -> None:
        """One hit: in this Store's counters, and in ``local``'s persistent ones unless None (memory hits)."""
        with self._counts_lock:  # the hot path: no keyword dicts
            self._counts["hits"] += 1
        if local is not None:
            local.add_hit()

    def _try(self, digest: Digest, size: int | None, name: str | None, indices: Iterable[int],
             outcomes: list[str], errors: list[CubinstoreError]) -> tuple[int, bytes] | None:
        for i in indices:
            layer = self.layers[i]
            try:
                data = layer.read(digest, size)
            except CubinstoreError as exc:
                outcomes.append(f"{layer.name}: {exc}")
                errors.append(exc)
                if isinstance(exc, IntegrityError):
                    self._count(verification_failures=1)
                    self._persist(verification_failures=1)
                continue
            if data is None:
                outcomes.append(f"{layer.name}: miss")
                continue
            if type(data) is not bytes:  # verify (and later store) an immutable copy
                data = bytes(data)
            if not layer.trusted:
                try:
                    if len(data) > limit_for(size):
                        raise IntegrityError(
                            f"size mismatch for {digest}{_for(name)} from {layer.name}: "
                            f"expected {'at most ' if size is None else ''}{limit_for(size)} bytes, got more"
                        )
                    verify(data, digest, size, where=layer.name, name=name)
                except IntegrityError as exc:
                    self._count(verification_failures=1)
                    self._persist(verification_failures=1)
                    outcomes.append(f"{layer.name}: {exc}")
                    errors.append(exc)
                    _log.warning("%s", exc)
                    try:
                        layer.discard(digest, size, str(exc))
                    except CubinstoreError as discard_error:  # e.g. quarantine not permitted: still never served
                        _log.warning("cannot discard bad %s in %s: %s", digest, layer.name, discard_error)
                    continue
            if _log.isEnabledFor(logging.DEBUG):  # its arguments cost more than the check
                _log.debug("%s%s: hit in %s (%d bytes)", digest, _for(name), layer.name, len(data))
            return i, data
        return None

    def _backfill(self, digest: Digest, data: bytes, index: int, name: str | None) -> None:
        for layer in self.layers[:index]:
            if not layer.writable:
                continue
            try:
                layer.write_verified(digest, data)  # `data` is the immutable bytes verified above
            except StoreError as exc:
                if self.strict:
                    raise StoreError(f"cannot store {digest}{_for(name)} in {layer.name}: {exc}") from exc
                _log.warning("cannot store %s%s in %s (serving verified bytes anyway): %s", digest, _for(name), layer.name, exc)

    def _failure(self, digest: Digest, size: int | None, name: str | None, outcomes: list[str],
                 errors: list[CubinstoreError]) -> CubinstoreError:
        tried = "; ".join(dict.fromkeys(outcomes)) or "no layers configured"  # the re-check under the lock repeats
        hint = ""
        if not any(layer.remote for layer in self.layers):
            hint = (
                " (no remote store: CUBINSTORE_OFFLINE is set)" if _env.offline()
                else " (no remote store configured: set CUBINSTORE_REMOTE or run `cubinstore prefetch --remote URL`)"
            )
        message = f"{digest}{_for(name)}{f' ({size} bytes)' if size else ''} not available: {tried}{hint}"
        # The worst outcome decides the type: bad bytes > an unreachable remote > a clean miss.
        if any(isinstance(e, IntegrityError) for e in errors):
            return IntegrityError(message)
        if any(isinstance(e, RemoteUnavailableError) for e in errors):
            return RemoteUnavailableError(message)
        if errors:
            return StoreError(message)
        return MissingBlobError(message)

    def _count(self, **delta: int) -> None:
        with self._counts_lock:
            for key, value in delta.items():
                self._counts[key] += value

    def _persist(self, **delta: int) -> None:
        local = self._local
        if local is not None:
            local.add_stats(delta)

    def __repr__(self) -> str:
        return f"Store([{', '.join(layer.name for layer in self.layers)}])"


@contextmanager
def _or_unlocked(lock: AbstractContextManager[None], layer: Layer, digest: Digest, *, strict: bool) -> Iterator[None]:
    """Hold ``lock``; if it cannot even be taken (a read-only or refused store, not a timeout),
    go on without it: the lock only orders writes into that layer, and those will fail too,
    so the blob is fetched into the layers that can take it (memory)."""
    try:
        lock.__enter__()
    except LockTimeoutError:
        raise
    except StoreError as exc:
        if strict:
            raise
        _log.debug("cannot lock %s in %s (%s): fetching without storing it there", digest, layer.name, exc)
        yield
        return
    try:
        yield
    except BaseException as exc:
        if not lock.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        lock.__exit__(None, None, None)


def _for(name: str | None) -> str:
    return f" ({name})" if name else ""


_default: tuple[tuple[object, ...], Store] | None = None
_default_lock = threading.Lock()


def default_store() -> Store:
    """The store a call that names none uses: ``Store.from_env()``, one per process (so every
    caller shares its memory layer and counters), built again when a variable that shapes it
    changes. The one definition: ``open``, ``Manifest.load``, ``Library``, ``jit`` and channels use it."""
    global _default
    config = (_env.home(), _env.remotes(), _env.disk_cache(), _env.offline(), _env.memory_bytes(), _env.verify_full())
    with _default_lock:
        if _default is None or _default[0] != config:
            store = Store.from_env()
            if store.local is not None:
                # Decide now how first loads check (and import xxhash where they check records): a
                # process's first kernel load then pays for neither.
                store.local.trusts_records()
            _default = (config, store)
        return _default[1]
