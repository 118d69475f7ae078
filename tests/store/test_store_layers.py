"""Store composition: from_env, offline mode, the Bazel disk-cache view, build trees, env accessors."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.blobs import random_blob

from cubinstore import BadArgumentError, Digest, IntegrityError, MissingBlobError, Store
from cubinstore.internals import knobs as _env
from cubinstore.store import DirectorySource, DiskCacheLayer, HttpLayer, LocalLayer, MemoryLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def blob(n: int = 3000, seed: int | None = None) -> tuple[Digest, bytes]:
    return random_blob(n, seed)


def test_from_env_orders_memory_local_disk_cache_remotes(clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUBINSTORE_DISK_CACHE", str(tmp_path / "dc"))
    monkeypatch.setenv("CUBINSTORE_REMOTE", "http://127.0.0.1:1/a, http://127.0.0.1:2/b,")
    store = Store.from_env(extra_remotes=["http://127.0.0.1:3/c"])
    kinds = [type(layer) for layer in store.layers]
    assert kinds == [MemoryLayer, LocalLayer, DiskCacheLayer, HttpLayer, HttpLayer, HttpLayer]
    assert store.local is not None and store.local.root == clean_env
    assert [layer.url for layer in store.layers if isinstance(layer, HttpLayer)] == [
        "http://127.0.0.1:3/c", "http://127.0.0.1:1/a", "http://127.0.0.1:2/b"]


def test_offline_never_builds_a_remote_and_a_miss_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBINSTORE_REMOTE", "http://127.0.0.1:1/a")
    monkeypatch.setenv("CUBINSTORE_OFFLINE", "1")
    store = Store.from_env(extra_remotes=["http://127.0.0.1:3/c"])
    assert not any(isinstance(layer, HttpLayer) for layer in store.layers)
    digest, data = blob()
    with pytest.raises(MissingBlobError, match=r".*\(no remote store: CUBINSTORE_OFFLINE is set\)$"):
        store.get(digest, len(data), name="k")


def test_default_home_is_the_user_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUBINSTORE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _env.home() == tmp_path / "xdg" / "cubinstore"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert _env.home() == tmp_path / "h" / ".cache" / "cubinstore"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("CUBINSTORE_OFFLINE", "maybe", "CUBINSTORE_OFFLINE: expected one of 1/0/true/false"),
        ("CUBINSTORE_HTTP_TIMEOUT", "fast", "CUBINSTORE_HTTP_TIMEOUT: expected a number of seconds, got 'fast'"),
        ("CUBINSTORE_HTTP_TIMEOUT", "-1", "CUBINSTORE_HTTP_TIMEOUT: expected a positive number of seconds, got '-1'"),
        ("CUBINSTORE_HTTP_TIMEOUT", "nan", "CUBINSTORE_HTTP_TIMEOUT: expected a positive number"),
        ("CUBINSTORE_HTTP_RETRIES", "2.5", "CUBINSTORE_HTTP_RETRIES: expected a non-negative integer, got '2.5'"),
        ("CUBINSTORE_HTTP_RETRIES", "-1", "CUBINSTORE_HTTP_RETRIES: expected a non-negative integer"),
        ("CUBINSTORE_REMOTE", "ftp://x", "invalid remote URL 'ftp://x'"),
    ],
)
def test_bad_environment_values_are_typed_errors_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(BadArgumentError) as info:
        Store.from_env()
        _env.http_timeout(), _env.http_retries()
    assert str(info.value).startswith(message)


def test_environment_accessors_parse_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBINSTORE_HTTP_TIMEOUT", "2.5")
    monkeypatch.setenv("CUBINSTORE_HTTP_RETRIES", "0")
    monkeypatch.setenv("CUBINSTORE_OFFLINE", "Yes")
    monkeypatch.setenv("CUBINSTORE_MEMORY_BYTES", "0")
    assert _env.http_timeout() == 2.5 and _env.http_retries() == 0 and _env.offline() is True
    assert not any(isinstance(layer, MemoryLayer) for layer in Store.from_env().layers)
    remote = HttpLayer("http://127.0.0.1:9")
    assert remote.read_timeout == 2.5 and remote.retries == 0
    assert {v.name for v in _env.VARIABLES} >= {"CUBINSTORE_HOME", "CUBINSTORE_REMOTE", "CUBINSTORE_DISK_CACHE",
                                                 "CUBINSTORE_OFFLINE", "CUBINSTORE_HTTP_TIMEOUT", "CUBINSTORE_HTTP_RETRIES"}


@pytest.mark.parametrize("layout", ["sharded", "flat"])
def test_bazel_disk_cache_view_reads_both_layouts(tmp_path: Path, layout: str) -> None:
    digest, data = blob()
    disk_cache = tmp_path / "disk_cache"
    path = disk_cache / "cas" / digest.hex[:2] / digest.hex if layout == "sharded" else disk_cache / "cas" / digest.hex
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    (disk_cache / "ac").mkdir()
    local = LocalLayer(tmp_path / "local")
    store = Store([local, DiskCacheLayer(disk_cache)])
    assert store.get(digest, len(data)) == data
    assert local.path_for(digest).read_bytes() == data
    assert store.stats.misses == 1 and store.stats.bytes_fetched == len(data)


def test_corrupt_disk_cache_entry_is_skipped_and_left_alone(tmp_path: Path) -> None:
    digest, data = blob()
    disk_cache = tmp_path / "disk_cache"
    path = disk_cache / "cas" / digest.hex[:2] / digest.hex
    path.parent.mkdir(parents=True)
    path.write_bytes(data[::-1])
    second = MemoryLayer()
    second.write(digest, data)
    store = Store([LocalLayer(tmp_path / "local"), DiskCacheLayer(disk_cache), second])
    assert store.get(digest, len(data)) == data
    assert store.stats.verification_failures == 1
    assert path.read_bytes() == data[::-1]  # Bazel's directory is never modified


def test_build_tree_source_finds_blobs_by_content_not_name(tmp_path: Path) -> None:
    tree = tmp_path / "bazel-bin"
    d1, b1 = blob(seed=1)
    d2, b2 = blob(seed=2)  # same size as b1: found by hash among same-size files
    (tree / "kernels" / "axpy").mkdir(parents=True)
    (tree / "kernels" / "axpy" / "whatever_name.cubin").write_bytes(b1)
    (tree / "kernels" / "axpy" / "other.cubin").write_bytes(b2)
    (tree / "kernels" / "axpy" / "not_a_cubin.o").write_bytes(blob(seed=3)[1])
    source = DirectorySource(tree)
    store = Store([source], backfill=False)
    assert store.get(d2, len(b2)) == b2 and store.get(d1, len(b1)) == b1
    d3, b3 = blob(seed=3)
    with pytest.raises(MissingBlobError):
        store.get(d3, len(b3))


def test_bad_bytes_outrank_a_clean_miss_in_the_error_type(tmp_path: Path) -> None:
    digest, data = blob()
    path = tmp_path / "dc" / "cas" / digest.hex
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(len(data)))
    store = Store([LocalLayer(tmp_path / "local"), DiskCacheLayer(tmp_path / "dc"), DiskCacheLayer(tmp_path / "empty")])
    with pytest.raises(IntegrityError, match=r".*disk cache .*/dc: digest mismatch.*; disk cache .*/empty: miss"):
        store.get(digest, len(data))


def test_memory_layer_evicts_least_recently_used() -> None:
    memory = MemoryLayer(max_bytes=250)
    blobs = [blob(100, seed=i) for i in range(3)]
    memory.write(*blobs[0])
    memory.write(*blobs[1])
    assert memory.read(blobs[0][0], 100) is not None  # touch 0: 1 is now the oldest
    memory.write(*blobs[2])
    assert memory.read(blobs[1][0], 100) is None
    assert memory.read(blobs[0][0], 100) is not None and memory.read(blobs[2][0], 100) is not None


def test_a_build_tree_of_same_size_blobs_hashes_each_file_once(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # A family's CUBINs often share a size: finding each of n blobs must not hash n files each time.
    import hashlib as _hashlib

    from cubinstore.store import DirectorySource

    blobs = [random_blob(4096, seed=i) for i in range(60)]
    for i, (_, data) in enumerate(blobs):
        (tmp_path / f"k{i}.cubin").write_bytes(data)
    hashed: list[int] = []
    real = _hashlib.sha256
    monkeypatch.setattr(_hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real(b))  # the standard library's
    source = DirectorySource(tmp_path)
    for digest, data in reversed(blobs):  # the worst order for a scan in directory order
        assert source.read(digest, len(data)) == data
    assert len(hashed) <= 2 * len(blobs)  # each file hashed once, a remembered one checked once more


def test_a_build_tree_read_from_many_threads_finds_every_blob(tmp_path) -> None:  # noqa: ANN001
    # publish and prefetch read the tree from many threads: none may miss a blob another is hashing.
    from concurrent.futures import ThreadPoolExecutor

    from cubinstore.store import DirectorySource

    blobs = [random_blob(4096, seed=i) for i in range(200)]
    for i, (_, data) in enumerate(blobs):
        (tmp_path / f"k{i}.cubin").write_bytes(data)
    source = DirectorySource(tmp_path)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda blob: source.read(blob[0], len(blob[1])), blobs))
    assert got == [data for _, data in blobs]


def test_the_layers_names_before_the_rename_still_import() -> None:
    # "Store" names the whole; each layer is a ...Layer. The earlier names are the same classes.
    import cubinstore.store as store
    from cubinstore.store import DiskCacheStore, HttpStore, LocalStore, MemoryStore  # type: ignore[attr-defined]

    assert (LocalStore, MemoryStore, DiskCacheStore, HttpStore) == (
        store.LocalLayer, store.MemoryLayer, store.DiskCacheLayer, store.HttpLayer)
    assert all(issubclass(cls, store.Layer) for cls in (LocalStore, MemoryStore, DiskCacheStore, HttpStore))
