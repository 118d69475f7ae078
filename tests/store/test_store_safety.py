"""The local store against other local users: links inside the store, shared permissions,
read-only stores, and what the library prints (nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.blobs import disk_cache_with, random_blob

from cubinstore import Digest, Manifest, Store, StoreError, UnsafeStoreError
from cubinstore.internals import gc, pack, pin, unpack, unpin, verify_store
from cubinstore.store import LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]


def blob(n: int = 4000, seed: int | None = 0) -> tuple[Digest, bytes]:
    return random_blob(n, seed)


def everything_under(path: Path) -> list[Path]:
    return sorted(path.rglob("*"))


# Each case plants a symlink at one directory of the layout; the operation must neither
# follow it (nothing appears in the attacker's directory) nor hang or crash untyped.
@pytest.mark.parametrize("link", ["v1", "v1/cas/SHARD", "v1/quarantine", "v1/pins", "v1/locks/SHARD", "v1/locks",
                                  "v1/staging"])
def test_a_symlinked_store_directory_is_never_written_through(tmp_path: Path, link: str, make_release) -> None:
    release = make_release(n=1, size=4000, seed=3)
    (hex_, data), = release.blobs.items()
    digest = Digest(hex_)
    root = tmp_path / "home"
    local = LocalLayer(root)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    planted = root / link.replace("SHARD", hex_[:2])
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(elsewhere, target_is_directory=True)
    source = disk_cache_with(tmp_path / "disk_cache", [(digest, data)])
    manifest = Manifest.from_path(release.path)
    bundle = tmp_path / "release.tar"
    pack(manifest, Store([source]), bundle)
    if link == "v1/quarantine":  # a corrupt entry for the store to quarantine through the link
        local.path_for(digest).parent.mkdir(parents=True)
        local.path_for(digest).write_bytes(bytes(len(data)))

    attempts = [
        lambda: Store([local, source]).get(digest, len(data)),
        lambda: Store([local, source], strict=True).get(digest, len(data)),
        lambda: local.write(digest, data),
        lambda: pin(local, manifest),
        lambda: unpin(local, manifest.digest),
        lambda: gc(local, 0),
        lambda: verify_store(local),
        lambda: local.discard(digest, len(data), "test"),
        lambda: local.add_stats({"hits": 1}),
        lambda: unpack(bundle, local, pin=True),
    ]
    for i, attempt in enumerate(attempts):
        try:
            attempt()
        except StoreError:
            pass  # refused: fine, as long as nothing was written through the link
        assert everything_under(elsewhere) == [], f"attempt {i} wrote through {planted}: {everything_under(elsewhere)}"
    assert planted.is_symlink()  # never replaced or followed


def test_writing_through_a_symlinked_shard_is_a_typed_error_naming_the_link(tmp_path: Path) -> None:
    digest, data = blob()
    local = LocalLayer(tmp_path / "home")
    shard = local.cas_dir / digest.hex[:2]
    shard.parent.mkdir(parents=True)
    shard.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(UnsafeStoreError, match=rf"^refusing to use {shard} is a symlink or not a directory"):
        local.write(digest, data)


def test_a_symlinked_shard_is_a_miss_and_the_next_layer_serves(tmp_path: Path) -> None:
    digest, data = blob()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / digest.hex).write_bytes(data)  # even the right bytes: the link is not followed
    local = LocalLayer(tmp_path / "home")
    (local.cas_dir).mkdir(parents=True)
    (local.cas_dir / digest.hex[:2]).symlink_to(outside, target_is_directory=True)
    store = Store([local, disk_cache_with(tmp_path / "dc", [(digest, data)])])
    assert store.get(digest, len(data)) == data
    assert store.stats.misses == 1


@pytest.mark.parametrize("mode", [0o775, 0o777, 0o757])
def test_a_store_writable_by_others_is_refused_for_writes_unless_declared_shared(tmp_path: Path, mode: int,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    digest, data = blob()
    root = tmp_path / "home"
    local = LocalLayer(root)
    local.write(digest, data)
    (local.cas_dir).chmod(mode)
    other, other_data = blob(seed=1)
    with pytest.raises(UnsafeStoreError, match=rf"^refusing to write to the store at {root}: {local.cas_dir} is writable by"):
        local.write(other, other_data)
    assert Store([local]).get(digest, len(data)) == data  # reads are verified: still served
    monkeypatch.setenv("CUBINSTORE_ALLOW_SHARED_STORE", "1")
    LocalLayer(root).write(other, other_data)
    assert Store([LocalLayer(root)]).get(other, len(other_data)) == other_data


def test_new_store_directories_are_not_group_writable_under_umask_002(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        local = LocalLayer(tmp_path / "home")
        digest, data = blob()
        local.write(digest, data)
        with local.lock(Digest.of(b"another")):
            pass
        local.add_stats({"hits": 1})
    finally:
        os.umask(old)
    dirs = [p for p in [local.root, *everything_under(local.root)] if p.is_dir()]
    assert dirs and all(p.stat().st_mode & 0o022 == 0 for p in dirs), [(p, oct(p.stat().st_mode)) for p in dirs]
    local.write(*blob(seed=2))  # and the store accepts its own directories


_READ_ONLY_READER = textwrap.dedent("""
    import sys
    from cubinstore import Digest, Store
    from cubinstore.store import DiskCacheLayer, LocalLayer, MemoryLayer
    have, want = Digest(sys.argv[3]), Digest(sys.argv[4])
    store = Store([MemoryLayer(), LocalLayer(sys.argv[1]), DiskCacheLayer(sys.argv[2])])
    a = store.get(have, int(sys.argv[5]))
    b = store.get(want, int(sys.argv[6]))
    b2 = store.get(want, int(sys.argv[6]))  # from memory now
    print("ok", len(a), len(b), store.stats.hits, store.stats.misses)
""")


def test_a_read_only_store_serves_what_it_has_and_fetches_the_rest_into_memory(tmp_path: Path) -> None:
    (have, have_data), (want, want_data) = blob(seed=1), blob(seed=2)
    root = tmp_path / "image"
    LocalLayer(root).write(have, have_data)
    cache = disk_cache_with(tmp_path / "remote", [(want, want_data)])
    for path in [root, *everything_under(root)]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    args = [sys.executable, "-c", _READ_ONLY_READER, str(root), str(cache.root), have.hex, want.hex,
            str(len(have_data)), str(len(want_data))]
    if os.geteuid() == 0:  # root ignores permission bits unless it drops its capabilities
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a store read only")
        args = [setpriv, "--inh-caps=-all", "--bounding-set=-all", *args]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=60,
                             env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)})
    finally:
        for path in [root, *everything_under(root)]:
            if path.is_dir():
                path.chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(len(have_data)), str(len(want_data)), "2", "1"]
    assert out.stderr == ""  # the library logs, never prints
    assert not (root / "v1" / "cas" / want.hex[:2] / want.hex).exists()


_WARNING_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from cubinstore import Digest, MissingBlobError, Store
    from cubinstore.store import LocalLayer
    local = LocalLayer(sys.argv[1])
    digest = Digest("ab" * 32)
    path = local.path_for(digest)
    path.parent.mkdir(parents=True)
    path.symlink_to("/etc/passwd")  # read() logs a warning and treats it as a miss
    try:
        Store([local]).get(digest, 10)
    except MissingBlobError:
        print("miss")
""")


def test_library_warnings_are_not_printed_without_logging_configured(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _WARNING_CHILD, str(tmp_path / "home")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "miss\n" and out.stderr == ""
