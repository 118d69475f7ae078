"""Fill the local store with many blobs: a bounded pool of parallel downloads, one filesystem sync per group of blobs.

Each blob goes through ``Store.get`` (verified, per-digest lock, one download across
processes); the pool only overlaps the waiting. The bytes are dropped as soon as they are
stored, so memory stays at about ``jobs`` blobs whatever the closure's size.
"""

from __future__ import annotations

import errno
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, TypeVar

from cubinstore._core.digest import Digest
from cubinstore.store.local.cas import LocalLayer
from cubinstore._core.log import get_logger
from cubinstore.store.memory import MemoryLayer
from cubinstore.errors import CubinstoreError, LockTimeoutError, StoreError, UnsafeStoreError
from cubinstore.store import Store

if TYPE_CHECKING:
    from cubinstore.manifest import Manifest

__all__ = ["blob_names", "closure", "fetch_blobs", "run_each", "store_failure", "without_memory"]

T = TypeVar("T")

_log = get_logger(__name__)

# A write that fails with one of these fails for every blob after it: the store's filesystem is
# full or read-only, not one entry.
_STORE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def closure(manifest: Manifest, archs: set[str] | None) -> list[tuple[Digest, int]]:
    """The blobs of ``manifest`` a host of ``archs`` (None: every arch) needs, sorted by digest: the
    kernels' CUBINs, and the source bundle of each family JIT template that compiles for one of them."""
    blobs = {(k.digest, k.size) for k in manifest.kernels if archs is None or k.arch in archs}
    blobs.update((t.bundle, t.bundle_size) for t in manifest.jit_templates.values()
                 if archs is None or not t.archs or archs.intersection(t.archs))
    return sorted(blobs, key=lambda b: b[0].hex)


def blob_names(manifest: Manifest, digest: Digest) -> str:
    """What blob ``digest`` of ``manifest`` is, for a message: the kernel ids it serves."""
    ids = manifest.ids_of(digest)  # one index per manifest: linear over the closure
    if ids:
        return ", ".join(ids)
    # Not a CUBIN: the source bundle of a family's JIT template (a manifest has a few).
    return ", ".join(f"{family} JIT sources" for family, t in manifest.jit_templates.items() if t.bundle == digest)


def without_memory(store: Store) -> Store:
    """``store`` minus its in-process memory layer: a prefetch never reads a blob twice."""
    return Store([layer for layer in store.layers if not isinstance(layer, MemoryLayer)], strict=store.strict,
                 backfill=store.backfill)


def store_failure(local: LocalLayer | None, exc: CubinstoreError) -> StoreError | None:
    """The error to stop on when ``exc``, raised for one blob, is about the store itself, so that
    every blob after it would fail the same way; None when it is about that blob alone.

    About the store: an ``UnsafeStoreError`` (a link or a directory others can write, on the way
    to the store), a write refused because the filesystem is full or read-only, or a store root
    that no longer opens (a fresh open of ``local``'s root and ``v1`` is tried; it raises the
    error that names the root and the cause). A ``Store`` words a failed read into its "not
    available" message without chaining it, hence the fresh open rather than the message.
    """
    if not isinstance(exc, StoreError) or isinstance(exc, LockTimeoutError):
        return None  # a missing or bad blob, an unreachable remote, one entry's lock held elsewhere
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, UnsafeStoreError):
            return cause
        if isinstance(cause, OSError) and cause.errno in _STORE_ERRNOS:
            where = local.root if local is not None else cause.filename
            return StoreError(f"cannot write to the store at {where}: {cause.strerror or cause}")
        cause = cause.__cause__ or cause.__context__
    if local is not None:
        try:
            local.list_dir(())  # the root and v1 open: the failure was this blob's
        except StoreError as probe:
            return probe
    return None


class _Stop:
    """A job's report that the store failed: ``error`` is what ``run_each`` raises."""

    __slots__ = ("error",)

    def __init__(self, error: CubinstoreError) -> None:
        self.error = error


def run_each(items: Sequence[T], fn: Callable[[T], int], *, jobs: int,
             progress: Callable[[int, int, int], None] | None = None,
             fatal: Callable[[CubinstoreError], CubinstoreError | None] | None = None) -> list[int | CubinstoreError]:
    """``fn(item)`` for every item with at most ``jobs`` in flight: each result (bytes handled, for
    the progress line) or the ``CubinstoreError`` it raised, in ``items`` order.

    ``fatal(error)``, called for each item's error by the job that ran it, returns the error that
    makes going on pointless (``store_failure``: the store itself cannot be used), or None. That
    error is raised once, and the items' own errors are dropped: one line about the store, not
    one per item. A job that met it takes no further item, so at most ``jobs`` items are tried
    once the store has failed.

    ``progress(done, total, bytes)`` is called from this thread as items finish. One job runs
    in this thread (no hand-off per item: on a busy host two thread switches per blob cost more
    than the blob). More jobs are ``jobs`` threads, each taking the next item when it is free,
    that report to this thread through one queue: no future per item, nothing per item that
    grows with the number in flight.
    """
    total = len(items)
    results: list[int | CubinstoreError] = [0] * total
    if total == 0:
        return results
    if jobs <= 1 or total == 1:
        nbytes = 0
        for i, item in enumerate(items):
            try:
                results[i] = fn(item)
                nbytes += results[i]  # type: ignore[operator]
            except CubinstoreError as exc:
                stop_with = fatal(exc) if fatal is not None else None
                if stop_with is not None:
                    raise stop_with
                results[i] = exc
            if progress is not None:
                progress(i + 1, total, nbytes)
        return results

    next_index = itertools.count()  # next() on it is atomic under the GIL: each index taken once
    finished: queue.SimpleQueue[tuple[int, int | CubinstoreError | BaseException | _Stop]] = queue.SimpleQueue()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            i = next(next_index)
            if i >= total:
                return
            try:
                outcome: int | CubinstoreError | BaseException | _Stop = fn(items[i])
            except CubinstoreError as exc:
                outcome = exc
                try:  # decided here, before this job can take another item
                    stop_with = fatal(exc) if fatal is not None else None
                except BaseException as fatal_exc:  # noqa: BLE001 - handed to the caller's thread below
                    stop_with, outcome = None, fatal_exc
                if stop_with is not None:
                    stop.set()
                    outcome = _Stop(stop_with)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                outcome = exc
            finished.put((i, outcome))

    threads = [threading.Thread(target=worker, name=f"cubinstore-job-{j}", daemon=True)
               for j in range(min(jobs, total))]
    for t in threads:
        t.start()
    done = nbytes = 0
    try:
        while done < total:
            i, outcome = finished.get()
            done += 1
            if isinstance(outcome, _Stop):
                raise outcome.error  # the finally below waits for the items in flight
            if isinstance(outcome, CubinstoreError):
                results[i] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results[i] = outcome
                nbytes += outcome
            if progress is not None:
                progress(done, total, nbytes)
    finally:
        stop.set()  # on an error: no worker starts another item
        for t in threads:
            t.join()
    return results


def fetch_blobs(store: Store, blobs: Sequence[tuple[Digest, int]], *, names: Callable[[Digest], str],
                jobs: int, progress: Callable[[int, int, int], None] | None = None) -> list[str]:
    """Get every blob through ``store`` with at most ``jobs`` in flight; the failures, in ``blobs`` order.

    A failure about the store rather than one blob (``store_failure``) is raised once, as a
    ``StoreError`` naming the store, and no further blob is tried.

    Writes are grouped (``LocalLayer.batch(grouped=True)``): one filesystem sync per group of
    blobs, then their renames; every blob is durable and in place when this returns.
    """
    local = store.local

    def one(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        return len(store.get(digest, size, name=names(digest)))

    # Each blob is durable before it is visible (no power loss leaves a short entry at a final
    # path: an offline host may have nowhere to refetch it from), one sync per group of blobs
    # rather than one fsync each; each directory is fsynced once when the batch ends (see
    # LocalLayer.batch).
    with local.batch(grouped=True) if local is not None else nullcontext():
        results = run_each(blobs, one, jobs=jobs, progress=progress,
                           fatal=lambda exc: store_failure(local, exc))
    return [str(r) for r in results if isinstance(r, CubinstoreError)]
