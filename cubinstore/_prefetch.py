"""Fill the local store with many blobs: a bounded pool of parallel downloads, one filesystem sync at the end.

Each blob goes through ``Store.get`` (verified, per-digest lock, one download across
processes); the pool only overlaps the waiting. The bytes are dropped as soon as they are
stored, so memory stays at about ``jobs`` blobs whatever the closure's size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext

from cubinstore._digest import Digest
from cubinstore._memory import MemoryStore
from cubinstore.errors import CubinstoreError
from cubinstore.store import Store

__all__ = ["fetch_blobs", "run_each", "without_memory"]

T = TypeVar("T")

_log = logging.getLogger(__name__)


def without_memory(store: Store) -> Store:
    """``store`` minus its in-process memory layer: a prefetch never reads a blob twice."""
    return Store([layer for layer in store.layers if not isinstance(layer, MemoryStore)], strict=store.strict,
                 backfill=store.backfill)


def run_each(items: Sequence[T], fn: Callable[[T], int], *, jobs: int,
             progress: Callable[[int, int, int], None] | None = None) -> list[int | CubinstoreError]:
    """``fn(item)`` for every item with at most ``jobs`` in flight: each result (bytes handled, for
    the progress line) or the ``CubinstoreError`` it raised, in ``items`` order.

    ``progress(done, total, bytes)`` is called from this thread after each item. At most
    ``2 * jobs`` items are submitted at a time: a queue of 10,000 blobs never becomes 10,000 futures.
    """
    results: list[int | CubinstoreError] = [0] * len(items)
    done = nbytes = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending: dict[Future[int], int] = {}
        queue = iter(enumerate(items))
        try:
            while True:
                for i, item in queue:
                    pending[pool.submit(fn, item)] = i
                    if len(pending) >= 2 * jobs:
                        break
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    i = pending.pop(future)
                    try:
                        results[i] = future.result()
                        nbytes += results[i]  # type: ignore[operator]
                    except CubinstoreError as exc:
                        results[i] = exc
                    done += 1
                    if progress is not None:
                        progress(done, len(items), nbytes)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return results


def fetch_blobs(store: Store, blobs: Sequence[tuple[Digest, int]], *, names: Callable[[Digest], str],
                jobs: int, progress: Callable[[int, int, int], None] | None = None) -> list[str]:
    """Get every blob through ``store`` with at most ``jobs`` in flight; the failures, in ``blobs`` order.

    Writes are batched (``LocalStore.batch``): the filesystem is synced once, when every blob is in.
    """
    local = store.local

    def one(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        return len(store.get(digest, size, name=names(digest)))

    # Each blob is fsynced before its rename, so no power loss leaves a short entry at a final
    # path (an offline host may have nowhere to refetch it from); each directory is fsynced
    # once when the batch ends (see LocalStore.batch).
    with local.batch(sync_each=True) if local is not None else nullcontext():
        results = run_each(blobs, one, jobs=jobs, progress=progress)
    return [str(r) for r in results if isinstance(r, CubinstoreError)]
