"""Hit counters off the hot path: in memory, flushed in batches and at exit, never lost.

A hit must write nothing (no stats lock, no stats.json rewrite, no mtime bump of a fresh
entry); counts still add up across processes, and each blob is hashed once per fetch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest
from helpers.blobs import disk_cache_with, random_blob

from cubinstore import Digest, Store
from cubinstore.store import LocalLayer, MemoryLayer
from cubinstore.store.local.stats import FLUSH_SECONDS

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]


def blob(n: int = 5000, seed: int | None = 0) -> tuple[Digest, bytes]:
    return random_blob(n, seed)


class Syscalls:
    """Counts the file-changing calls the store makes (the ones a hit must not make)."""

    NAMES = ("replace", "rename", "utime", "mkdir", "unlink", "fsync")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.opened_for_write: list[Any] = []
        for name in self.NAMES:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(name, real))
        real_open = os.open

        def counting_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                self.opened_for_write.append(path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", counting_open)

    def _wrap(self, name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args[:1]))
            return real(*args, **kwargs)
        return wrapper

    def clear(self) -> None:
        self.calls.clear()
        self.opened_for_write.clear()


def test_a_local_hit_writes_nothing_and_is_counted_on_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalLayer(tmp_path / "home")
    blobs = [blob(seed=i) for i in range(20)]
    for digest, data in blobs:
        local.write(digest, data)
    syscalls = Syscalls(monkeypatch)
    for digest, data in blobs:
        assert Store([local]).get(digest, len(data)) == data  # a fresh Store each time: no memory layer
    assert syscalls.calls == [] and syscalls.opened_for_write == []
    assert not local.stats_path.exists()
    assert local.read_stats()["hits"] == 20  # pending counts are flushed by a read
    assert local.stats_path.exists()


def test_a_memory_hit_touches_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = LocalLayer(tmp_path / "home")
    digest, data = blob()
    local.write(digest, data)
    store = Store([MemoryLayer(), local])
    store.get(digest, len(data))
    syscalls = Syscalls(monkeypatch)
    real_open = os.open
    opened: list[Any] = []
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    for _ in range(100):
        assert store.get(digest, len(data)) is store.get(digest, len(data))
    assert opened == [] and syscalls.calls == []


def test_counts_are_flushed_in_batches(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home", flush_events=10)
    digest, data = blob()
    local.write(digest, data)
    for _ in range(9):
        Store([local]).get(digest, len(data))
    assert not local.stats_path.exists()
    Store([local]).get(digest, len(data))  # the 10th count flushes
    assert b'"hits": 10' in local.stats_path.read_bytes()


def test_counts_of_a_quiet_process_are_flushed_after_a_while(tmp_path: Path) -> None:
    clock = [1000.0]
    local = LocalLayer(tmp_path / "home", clock=types.SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    local.add_stats({"hits": 1})
    assert not local.stats_path.exists()
    clock[0] += FLUSH_SECONDS
    local.add_stats({"hits": 1})
    assert b'"hits": 2' in local.stats_path.read_bytes()


def _child(home: Path, body: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), CUBINSTORE_HOME=str(home))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, capture_output=True, text=True, timeout=120)


def test_counts_of_many_processes_add_up_at_exit(tmp_path: Path) -> None:
    home = tmp_path / "home"
    local = LocalLayer(home)
    digest, data = blob()
    local.write(digest, data)
    body = f"""
        from cubinstore import Digest, Store
        from cubinstore.store import LocalLayer
        local = LocalLayer({str(home)!r})
        for _ in range(50):
            Store([local]).get(Digest({digest.hex!r}), {len(data)})
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)],
                              env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()  # type: ignore[union-attr]
    assert LocalLayer(home).read_stats()["hits"] == 300


def test_a_forked_child_does_not_count_its_parents_pending_hits_again(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = _child(home, f"""
        import os
        from cubinstore.store import LocalLayer
        local = LocalLayer({str(home)!r})
        local.add_stats({{"hits": 3}})
        pid = os.fork()
        if pid == 0:
            local.add_stats({{"hits": 1}})
            raise SystemExit(0)  # a normal exit: the child's atexit flush runs
        os.waitpid(pid, 0)
    """)
    assert result.returncode == 0, result.stderr
    assert LocalLayer(home).read_stats()["hits"] == 4


def test_a_fetched_blob_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = [blob(seed=i) for i in range(5)]
    source = disk_cache_with(tmp_path / "disk_cache", blobs)
    local = LocalLayer(tmp_path / "home")
    store = Store([MemoryLayer(), local, source])
    hashed: list[int] = []
    real_sha256 = hashlib.sha256  # every hash anywhere (Digest.of, verify) goes through it
    monkeypatch.setattr(hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real_sha256(data))
    for digest, data in blobs:
        assert store.get(digest, len(data)) == data
    assert len(hashed) == len(blobs)
    for digest, data in blobs:  # memory hits: no hash at all
        store.get(digest, len(data))
    assert len(hashed) == len(blobs)
    assert all(local.path_for(d).read_bytes() == data for d, data in blobs)


def test_a_hit_bumps_the_mtime_of_an_old_entry_only(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    old, fresh = blob(seed=1), blob(seed=2)
    for digest, data in (old, fresh):
        local.write(digest, data)
    long_ago = time.time() - 10 * 86400
    os.utime(local.path_for(old[0]), (long_ago, long_ago))
    written = local.path_for(fresh[0]).stat().st_mtime_ns
    for digest, data in (old, fresh):
        Store([local]).get(digest, len(data))
    assert local.path_for(old[0]).stat().st_mtime > long_ago + 86400  # gc's LRU clock moved
    assert local.path_for(fresh[0]).stat().st_mtime_ns == written


def test_a_cas_directory_replaced_under_a_live_process_is_found_again(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    a, b = blob(seed=1), blob(seed=2)
    local.write(*a)
    assert local.read(a[0], len(a[1])) == a[1]  # the process now holds v1/cas open
    os.rename(local.cas_dir, tmp_path / "old-cas")
    local.write(*b)
    assert local.read(b[0], len(b[1])) == b[1]
    local.write(*a)
    assert local.read(a[0], len(a[1])) == a[1]
