"""Fill the local store with many blobs: a bounded pool of parallel downloads, one filesystem sync per group of blobs.

Each blob goes through ``Store.get`` (verified, per-digest lock, one download across
processes); the pool only overlaps the waiting. The bytes are dropped as soon as they are
stored, so memory stays at about ``jobs`` blobs whatever the closure's size.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TypeVar

from cubinstore._digest import Digest
from cubinstore._log import get_logger
from cubinstore._memory import MemoryStore
from cubinstore.errors import CubinstoreError
from cubinstore.store import Store

__all__ = ["fetch_blobs", "run_each", "without_memory"]

T = TypeVar("T")

_log = get_logger(__name__)


def without_memory(store: Store) -> Store:
    """``store`` minus its in-process memory layer: a prefetch never reads a blob twice."""
    return Store([layer for layer in store.layers if not isinstance(layer, MemoryStore)], strict=store.strict,
                 backfill=store.backfill)


def run_each(items: Sequence[T], fn: Callable[[T], int], *, jobs: int,
             progress: Callable[[int, int, int], None] | None = None) -> list[int | CubinstoreError]:
    """``fn(item)`` for every item with at most ``jobs`` in flight: each result (bytes handled, for
    the progress line) or the ``CubinstoreError`` it raised, in ``items`` order.

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
                results[i] = exc
            if progress is not None:
                progress(i + 1, total, nbytes)
        return results

    next_index = itertools.count()  # next() on it is atomic under the GIL: each index taken once
    finished: queue.SimpleQueue[tuple[int, int | CubinstoreError | BaseException]] = queue.SimpleQueue()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            i = next(next_index)
            if i >= total:
                return
            try:
                outcome: int | CubinstoreError | BaseException = fn(items[i])
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

    Writes are grouped (``LocalStore.batch(grouped=True)``): one filesystem sync per group of
    blobs, then their renames; every blob is durable and in place when this returns.
    """
    local = store.local

    def one(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        return len(store.get(digest, size, name=names(digest)))

    # Each blob is durable before it is visible (no power loss leaves a short entry at a final
    # path: an offline host may have nowhere to refetch it from), one sync per group of blobs
    # rather than one fsync each; each directory is fsynced once when the batch ends (see
    # LocalStore.batch).
    with local.batch(grouped=True) if local is not None else nullcontext():
        results = run_each(blobs, one, jobs=jobs, progress=progress)
    return [str(r) for r in results if isinstance(r, CubinstoreError)]
