"""Fill the local store with many blobs: a bounded pool of parallel downloads, one filesystem sync at the end.

Each blob goes through ``Store.get`` (verified, per-digest lock, one download across
processes); the pool only overlaps the waiting. The bytes are dropped as soon as they are
stored, so memory stays at about ``jobs`` blobs whatever the closure's size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext

from cubinstore._digest import Digest
from cubinstore._memory import MemoryStore
from cubinstore.errors import CubinstoreError
from cubinstore.store import Store

__all__ = ["fetch_blobs", "without_memory"]

_log = logging.getLogger(__name__)


def without_memory(store: Store) -> Store:
    """``store`` minus its in-process memory layer: a prefetch never reads a blob twice."""
    return Store([layer for layer in store.layers if not isinstance(layer, MemoryStore)], strict=store.strict,
                 backfill=store.backfill)


def fetch_blobs(store: Store, blobs: Sequence[tuple[Digest, int]], *, names: Callable[[Digest], str],
                jobs: int, progress: Callable[[int, int, int], None] | None = None) -> list[str]:
    """Get every blob through ``store`` with at most ``jobs`` in flight; the failures, in ``blobs`` order.

    ``progress(done, total, bytes)`` is called from this thread after each blob. Writes are
    batched (``LocalStore.batch``): the filesystem is synced once, when every blob is in.
    """
    local = store.local
    failures: dict[int, str] = {}
    done = 0
    nbytes = 0

    def one(digest: Digest, size: int) -> int:
        return len(store.get(digest, size, name=names(digest)))

    # One filesystem sync at the end instead of a flush per blob (see LocalStore.batch).
    with (local.batch(sync_each=False) if local is not None else nullcontext()), \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending: dict[Future[int], int] = {}
        queue = iter(enumerate(blobs))
        try:
            while True:
                # At most 2 * jobs submitted: the queue of 10,000 blobs is not materialised as futures.
                for i, (digest, size) in queue:
                    pending[pool.submit(one, digest, size)] = i
                    if len(pending) >= 2 * jobs:
                        break
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    i = pending.pop(future)
                    try:
                        nbytes += future.result()
                    except CubinstoreError as exc:
                        failures[i] = str(exc)
                    done += 1
                    if progress is not None:
                        progress(done, len(blobs), nbytes)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return [failures[i] for i in sorted(failures)]

