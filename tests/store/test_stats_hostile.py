"""stats.json in a shared store is written by whoever can write the store: a hostile one never
fails a load or a flush, and is never read further than ``MAX_STATS_FILE`` bytes. What is not
ours is logged and counts as zero, so the next flush starts the file over."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers.blobs import random_blob

from cubinstore import Store
from cubinstore.store import LocalLayer
from cubinstore.store.local.stats import MAX_STATS_FILE, STAT_KEYS

pytestmark = pytest.mark.usefixtures("clean_env")


def store_with_blob(tmp_path: Path) -> tuple[LocalLayer, Store, int]:
    """A local store flushing on every count (so a hit flushes), one blob in it, and its size."""
    local = LocalLayer(tmp_path / "shared", flush_events=1)
    digest, data = random_blob(5000)
    local.write(digest, data)
    return local, Store([local]), len(data)


def test_a_deeply_nested_stats_file_fails_neither_a_hit_nor_a_flush(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    local, store, size = store_with_blob(tmp_path)
    local.stats_path.write_bytes(b"[" * (MAX_STATS_FILE - 1))  # under the size limit: parsed, too deep
    digest, data = random_blob(5000)
    with caplog.at_level(logging.WARNING, logger="cubinstore"):
        assert store.get(digest, size) == data  # the hit flushes (flush_events=1)
        local.add_stats({"misses": 1})  # and a second flush, over the file the first one wrote
    assert any(r.getMessage().startswith(f"ignoring malformed stats file {local.stats_path}: JSON nested too deeply")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # The bad file counted as zero and was replaced: this process's counts alone, nothing lost since.
    assert json.loads(local.stats_path.read_bytes()) == {**dict.fromkeys(STAT_KEYS, 0), "hits": 1, "misses": 1}
    assert local.read_stats()["hits"] == 1


def test_an_oversized_stats_file_is_ignored_not_read_as_its_first_bytes(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    local, store, size = store_with_blob(tmp_path)
    # Valid JSON up to the limit: read as its first MAX_STATS_FILE + 1 bytes, it would parse.
    local.stats_path.write_bytes(b'{"hits": 5000}' + b" " * MAX_STATS_FILE)
    with caplog.at_level(logging.WARNING, logger="cubinstore"):
        assert local.read_stats()["hits"] == 0
    assert any(r.getMessage().startswith(f"ignoring stats file {local.stats_path}: expected at most {MAX_STATS_FILE} "
                                         "bytes, got more") for r in caplog.records)
    digest, data = random_blob(5000)
    assert store.get(digest, size) == data
    assert json.loads(local.stats_path.read_bytes())["hits"] == 1
