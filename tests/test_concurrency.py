"""Many processes and threads needing the same blobs: one download per blob, every file valid."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest, Store
from cubinstore._maint import verify_store
from cubinstore.store import HttpStore, LocalStore

pytestmark = pytest.mark.usefixtures("clean_env")


def upload(url: str, blobs: dict[str, bytes]) -> None:
    remote = HttpStore(url)
    for hex_, data in blobs.items():
        remote.put(Digest(hex_), data)


def test_16_processes_prefetching_one_manifest_download_each_blob_once(nginx, make_release, cli_env, clean_env: Path) -> None:
    release = make_release(n=6, size=200_000)
    url = nginx.base(slow=True)  # 1 MB/s: downloads overlap, so the per-digest lock is exercised
    upload(url, release.blobs)
    procs = [
        subprocess.Popen([sys.executable, "-m", "cubinstore", "prefetch", str(release.path), "--remote", url],
                         env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(16)
    ]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    for code, _out, err in results:
        assert code == 0, err
    for hex_ in release.blobs:
        assert nginx.requests("GET", hex_) == 1, f"sha256:{hex_} downloaded {nginx.requests('GET', hex_)} times"
    local = LocalStore(clean_env)
    report = verify_store(local)
    manifest = Manifest.from_path(release.path)
    assert report.corrupt == [] and report.ok == len(release.blobs) + 1  # + the manifest itself
    for digest, _size in manifest.blobs:
        assert local.path_for(digest).read_bytes() == release.blobs[digest.hex]
    assert list(clean_env.rglob(".tmp.*")) == []
    stats = local.read_stats()
    assert stats["bytes_fetched"] == sum(map(len, release.blobs.values()))
    assert stats["misses"] == len(release.blobs) and stats["hits"] == 15 * len(release.blobs)


def test_threads_of_one_process_share_one_download(nginx, make_release, tmp_path: Path) -> None:
    release = make_release(n=1, size=300_000)
    url = nginx.base(slow=True)
    upload(url, release.blobs)
    (hex_, data), = release.blobs.items()
    results: list[bytes] = []
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            results.append(Store([LocalStore(tmp_path), HttpStore(url)]).get(Digest(hex_), len(data)))
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and results == [data] * 8
    assert nginx.requests("GET", hex_) == 1
