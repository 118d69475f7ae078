"""Records (xxh3-128 beside sha256, an xattr of each CAS entry): a first load from a store this user
owns checks size and record instead of sha256, and still never returns bad bytes.

Every case counts what ``LocalLayer.read_verified`` checked (``LocalLayer.checks``) and what the
layered ``Store.get`` did (quarantine, refetch): no wall clock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import native as native_paths
from helpers.blobs import disk_cache_with, random_blob

from cubinstore import BadArgumentError, Digest, Manifest
from cubinstore.internals import pack, unpack, verify_store
from cubinstore.store import LocalLayer, Store
from cubinstore.store.local import record

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture(autouse=True)
def _user_xattrs(tmp_path: Path) -> None:
    """Records live in user xattrs: a filesystem without them keeps none (every load uses sha256,
    which the other store tests cover), so there is nothing here to test."""
    probe = tmp_path / "xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.cubinstore.probe", b"1")
    except OSError as exc:
        pytest.skip(f"{tmp_path} has no user xattrs ({exc.strerror})")
    finally:
        probe.unlink()


@pytest.fixture(autouse=True, params=native_paths.PATHS)
def read_path(request: pytest.FixtureRequest, clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case on both paths of ``read_verified``: the compiled helper's one call, and Python's."""
    native_paths.use(monkeypatch, request.param)
    return request.param


REPO = Path(__file__).resolve().parents[2]
RECORD = record.NAME


def filled(root: Path, n: int = 3, size: int = 50_000) -> list[tuple[Digest, bytes]]:
    blobs = [random_blob(size + i, seed=i) for i in range(n)]
    local = LocalLayer(root)
    for digest, data in blobs:
        local.write(digest, data)
    return blobs


def fresh(root: Path, *remote: tuple[Digest, bytes], tmp: Path | None = None) -> tuple[Store, LocalLayer]:
    """A new process's view: a new LocalLayer (nothing decided or held) and, given blobs, a disk
    cache holding good copies to refetch from."""
    local = LocalLayer(root)
    layers: list = [local]
    if remote:
        assert tmp is not None
        layers.append(disk_cache_with(tmp / "remote", list(remote)))
    return Store(layers), local


def load(root: Path, digest: Digest, data: bytes, tmp: Path) -> tuple[bytes, LocalLayer, Store]:
    store, local = fresh(root, (digest, data), tmp=tmp)
    got = store.get(digest, len(data))
    return got, local, store


def quarantined(root: Path) -> list[str]:
    q = root / "v1" / "quarantine"
    return sorted(p.name.split(".")[0] for p in q.iterdir()) if q.is_dir() else []


# -- the record is written with every entry ---------------------------------------------------

def test_every_write_path_records_the_entry(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (d1, b1), (d2, b2) = random_blob(30_000, 1), random_blob(30_001, 2)
    local = LocalLayer(root)
    local.write(d1, b1)  # a plain write
    with local.batch(grouped=True):  # prefetch's grouped write
        local.write(d2, b2)
    for digest, data in ((d1, b1), (d2, b2)):
        value = os.getxattr(local.path_for(digest), RECORD)
        assert record.matches(value, digest.hex, data)


def test_unpacked_entries_carry_records(tmp_path: Path, make_release) -> None:
    release = make_release(n=3, size=20_000, seed=5)
    bundle = tmp_path / "release.tar"
    source = disk_cache_with(tmp_path / "disk_cache", [(Digest(h), b) for h, b in release.blobs.items()])
    pack(Manifest.from_path(release.path), Store([source]), bundle)
    root = tmp_path / "target"
    local = LocalLayer(root)
    unpack(bundle, local)
    for hex_, data in release.blobs.items():
        assert record.matches(os.getxattr(local.path_for(Digest(hex_)), RECORD), hex_, data)
    store, fresh_local = fresh(root)
    for hex_, data in release.blobs.items():
        assert store.get(Digest(hex_), len(data)) == data
    assert fresh_local.checks["xxh3"] == len(release.blobs) and fresh_local.checks["sha256"] == 0


# -- detection at load, in both modes --------------------------------------------------------------

def flip_bit(path: Path, at: int = 1234) -> None:
    with open(path, "r+b") as f:  # in place: same inode, so the record stays attached
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def same_size_in_place(path: Path) -> None:
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(bytes(len(data)))  # zeros, same size, same inode


DAMAGES = {"flipped bit": flip_bit, "truncation": truncate, "same-size overwrite": same_size_in_place}


@pytest.mark.parametrize("mode", ["auto", "full"])
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_is_caught_quarantined_and_refetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    mode: str, damage: str) -> None:
    root = tmp_path / "store"
    (digest, data), *_ = filled(root)
    monkeypatch.setenv("CUBINSTORE_VERIFY", mode)
    DAMAGES[damage](root / "v1" / "cas" / digest.hex[:2] / digest.hex)
    got, local, store = load(root, digest, data, tmp_path)
    assert got == data
    assert local.checks["xxh3"] == 0  # nothing passed a record check
    assert quarantined(root) == [digest.hex]
    assert store.stats.misses == 1 and store.stats.verification_failures >= 1
    # the refetched entry is whole and recorded again: the next process checks its record
    _, local2, _ = load(root, digest, data, tmp_path)
    assert local2.checks == {"xxh3": int(mode == "auto"), "sha256": int(mode == "full"), "recorded": 0,
                             "stale records": 0}


def test_a_swapped_file_carries_a_record_naming_another_digest(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (d1, b1), (d2, b2), _ = filled(root, size=50_000)
    # same size needed for the size check to pass: make two same-size blobs
    (d3, b3), (d4, b4) = random_blob(40_000, 10), random_blob(40_000, 11)
    LocalLayer(root).write(d3, b3)
    LocalLayer(root).write(d4, b4)
    p3 = root / "v1" / "cas" / d3.hex[:2] / d3.hex
    p4 = root / "v1" / "cas" / d4.hex[:2] / d4.hex
    os.replace(p4, p3)  # d4's file (and its own, valid record) now sits at d3's name
    got, local, _ = load(root, d3, b3, tmp_path)
    assert got == b3
    assert local.checks["xxh3"] == 0
    assert quarantined(root) == [d3.hex]


def test_a_stale_record_falls_back_to_sha256_and_is_rewritten(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (digest, data), *_ = filled(root)
    path = root / "v1" / "cas" / digest.hex[:2] / digest.hex
    value = bytearray(os.getxattr(path, RECORD))
    value[-1] ^= 1  # the bytes are sound; their record is not
    os.setxattr(path, RECORD, bytes(value))
    got, local, _ = load(root, digest, data, tmp_path)
    assert got == data and quarantined(root) == []
    assert local.checks == {"xxh3": 0, "sha256": 1, "recorded": 0, "stale records": 1}
    assert record.matches(os.getxattr(path, RECORD), digest.hex, data)


def test_a_missing_record_is_untrusted_then_recorded(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs = filled(root)
    for digest, _ in blobs:
        os.removexattr(root / "v1" / "cas" / digest.hex[:2] / digest.hex, RECORD)
    store, local = fresh(root)
    assert [store.get(d, len(b)) for d, b in blobs] == [b for _, b in blobs]
    assert local.checks == {"xxh3": 0, "sha256": 3, "recorded": 3, "stale records": 0}
    store, local = fresh(root)
    assert [store.get(d, len(b)) for d, b in blobs] == [b for _, b in blobs]
    assert local.checks == {"xxh3": 3, "sha256": 0, "recorded": 0, "stale records": 0}


def test_a_garbage_record_is_never_trusted(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (digest, data), *_ = filled(root)
    path = root / "v1" / "cas" / digest.hex[:2] / digest.hex
    flip_bit(path)
    os.setxattr(path, RECORD, b"\x01" + bytes(48))  # a record someone wrote by hand
    got, local, _ = load(root, digest, data, tmp_path)
    assert got == data and local.checks["xxh3"] == 0 and quarantined(root) == [digest.hex]


# -- the ownership rule decides the mode -------------------------------------------------------------

def test_verify_full_hashes_every_first_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    blobs = filled(root)
    monkeypatch.setenv("CUBINSTORE_VERIFY", "full")
    store, local = fresh(root)
    for d, b in blobs:
        assert store.get(d, len(b)) == b
    assert local.checks["sha256"] == 3 and local.checks["xxh3"] == 0 and not local.trusts_records()


def test_a_bad_verify_mode_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    (digest, data), *_ = filled(root)
    monkeypatch.setenv("CUBINSTORE_VERIFY", "fast")
    with pytest.raises(BadArgumentError, match="CUBINSTORE_VERIFY.*auto, full.*'fast'"):
        fresh(root)[0].get(digest, len(data))


@pytest.mark.parametrize("where", ["root", "v1", "cas", "shard"])
def test_a_group_writable_directory_means_sha256(tmp_path: Path, where: str) -> None:
    root = tmp_path / "store"
    blobs = filled(root)
    digest = blobs[0][0]
    target = {"root": root, "v1": root / "v1", "cas": root / "v1" / "cas",
              "shard": root / "v1" / "cas" / digest.hex[:2]}[where]
    target.chmod(0o775)
    store, local = fresh(root)
    assert store.get(digest, len(blobs[0][1])) == blobs[0][1]
    assert local.checks["xxh3"] == 0 and local.checks["sha256"] == 1
    assert local.checks["recorded"] == 0  # not ours to write into


def test_an_entry_writable_by_others_means_sha256(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (digest, data), *_ = filled(root)
    (root / "v1" / "cas" / digest.hex[:2] / digest.hex).chmod(0o666)
    store, local = fresh(root)
    assert store.get(digest, len(data)) == data
    assert local.checks["xxh3"] == 0 and local.checks["sha256"] == 1


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="chown to another uid and mounts need root")


@needs_root
@pytest.mark.parametrize("where", ["root", "entry"])
def test_a_store_or_entry_owned_by_another_uid_means_sha256(tmp_path: Path, where: str) -> None:
    root = tmp_path / "store"
    blobs = filled(root)
    digest, data = blobs[0]
    os.chown(root if where == "root" else root / "v1" / "cas" / digest.hex[:2] / digest.hex, 54321, 54321)
    store, local = fresh(root)
    assert store.get(digest, len(data)) == data
    assert local.checks["xxh3"] == 0 and local.checks["sha256"] == 1


CHILD_READ_ONLY = textwrap.dedent("""
    import json, sys
    from cubinstore import Digest
    from cubinstore.store import LocalLayer, Store
    root, blobs = sys.argv[1], json.loads(sys.argv[2])
    local = LocalLayer(root)
    store = Store([local])
    for hex_, size in blobs:
        store.get(Digest(hex_), size)
    print(json.dumps(local.checks))
""")


@needs_root
def test_a_read_only_mount_of_an_owned_store_checks_records_and_writes_none(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare/mount")
    root = tmp_path / "store"
    blobs = filled(root)
    os.removexattr(root / "v1" / "cas" / blobs[0][0].hex[:2] / blobs[0][0].hex, RECORD)  # one without
    mnt = tmp_path / "ro"
    mnt.mkdir()
    arg = str([[d.hex, len(b)] for d, b in blobs]).replace("'", '"')
    script = (f"mount --bind {root} {mnt} && mount -o remount,bind,ro {mnt} && "
              f"exec {sys.executable} -c \"$CHILD\" {mnt} '{arg}'")
    env = {**os.environ, "CHILD": CHILD_READ_ONLY, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "mount" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"no private mounts here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    import json

    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    # two by record; the one without a record by sha256, and no record could be written (EROFS)
    assert checks == {"xxh3": 2, "sha256": 1, "recorded": 0, "stale records": 0}


# -- crashes -----------------------------------------------------------------------------------------

CHILD_CRASH = textwrap.dedent("""
    import os, sys
    from cubinstore import Digest
    from cubinstore.store import LocalLayer, Store
    root, hex_, size, where = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    data = bytes.fromhex(sys.stdin.readline().strip())

    def stop(*args, **kwargs):  # tell the parent where we are, then wait to be killed
        sys.stdout.write("at " + where + "\\n")
        sys.stdout.flush()
        sys.stdin.readline()
        raise SystemExit("not killed")

    if where == "rename":  # the entry's temp file is written, its record attached; not yet renamed
        real_replace = os.replace
        def replace(src, dst, **kw):
            if dst == hex_:
                stop()
            return real_replace(src, dst, **kw)
        os.replace = replace
        LocalLayer(root).write(Digest(hex_), data)
    else:  # "record": an entry without a record was verified by sha256; its record is being written
        os.setxattr = lambda *a, **k: stop()  # the standard library's: a record is an xattr (record.write)
        Store([LocalLayer(root)]).get(Digest(hex_), size)
""")


@pytest.mark.parametrize("where", ["rename", "record"])
def test_a_kill_between_entry_and_record_loses_nothing(tmp_path: Path, where: str) -> None:
    root = tmp_path / "store"
    digest, data = random_blob(50_000, 7)
    path = root / "v1" / "cas" / digest.hex[:2] / digest.hex
    if where == "record":
        LocalLayer(root).write(digest, data)
        os.removexattr(path, RECORD)
    child = subprocess.Popen([sys.executable, "-c", CHILD_CRASH, str(root), digest.hex, str(len(data)), where],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(data.hex() + "\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == f"at {where}"  # synchronised: the child is there now
    child.kill()
    child.wait(timeout=30)
    if where == "rename":
        assert not path.exists()  # neither entry nor record: a crash before the rename leaves a temp only
    else:
        assert path.read_bytes() == data and RECORD not in os.listxattr(path)
    got, local, _ = load(root, digest, data, tmp_path)
    assert got == data
    if where == "record":  # loaded by sha256, recorded this time
        assert local.checks == {"xxh3": 0, "sha256": 1, "recorded": 1, "stale records": 0}
    assert record.matches(os.getxattr(path, RECORD), digest.hex, data)


# -- verify ------------------------------------------------------------------------------------------

def test_verify_checks_and_repairs_records(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs = filled(root, n=4)
    cas = root / "v1" / "cas"
    os.removexattr(cas / blobs[0][0].hex[:2] / blobs[0][0].hex, RECORD)
    stale = cas / blobs[1][0].hex[:2] / blobs[1][0].hex
    os.setxattr(stale, RECORD, b"\x01" + bytes(48))
    flip_bit(cas / blobs[2][0].hex[:2] / blobs[2][0].hex)  # corrupt: quarantined, its record irrelevant
    report = verify_store(LocalLayer(root))
    assert report.ok == 3 and len(report.corrupt) == 1
    assert report.records == {"ok": 1, "recorded": 1, "re-recorded": 1, "none": 0}
    again = verify_store(LocalLayer(root))
    assert again.records == {"ok": 3, "recorded": 0, "re-recorded": 0, "none": 0}


def test_verify_cli_reports_records(tmp_path: Path, cli_env: dict[str, str]) -> None:
    root = Path(cli_env["CUBINSTORE_HOME"])
    filled(root, n=2)
    proc = subprocess.run([sys.executable, "-m", "cubinstore", "verify"], env=cli_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "records (xxh3-128, checked at first load instead of sha256): 2 ok" in proc.stdout
