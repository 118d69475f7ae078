"""Offline bundles: pack/unpack round trip; every kind of tampering rejected before anything is stored."""

from __future__ import annotations

import io
import os
import random
import tarfile
from pathlib import Path

import pytest

from cubinstore import BundleError, CubinstoreError, Digest, Manifest, Store
from cubinstore.internals import pack, unpack
from cubinstore.store import LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def packed(make_release, tmp_path: Path):
    release = make_release(n=4, size=3000, seed=11)
    source = LocalLayer(tmp_path / "source")
    for hex_, data in release.blobs.items():
        source.write(Digest(hex_), data)
    manifest = Manifest.from_path(release.path)
    out = tmp_path / "bundle.tar"
    pack(manifest, Store([source]), out)
    return release, manifest, out


def members(path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]  # type: ignore[union-attr]


def rewrite(path: Path, items: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in items:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def entries(root: Path) -> list[Path]:
    cas = root / "v1" / "cas"
    return sorted(p for p in cas.rglob("*") if p.is_file()) if cas.exists() else []


def test_pack_unpack_round_trip_on_a_second_store(packed, tmp_path: Path) -> None:
    release, manifest, out = packed
    target = LocalLayer(tmp_path / "target")
    got = unpack(out, target, expect=manifest.digest)
    assert got.digest == manifest.digest
    for digest, size in manifest.blobs:
        assert Store([target]).get(digest, size) == release.blobs[digest.hex]
    # The manifest itself is stored, so an offline host can open it by digest.
    assert Manifest.from_digest(manifest.digest, Store([target])).kernels == manifest.kernels


def test_pack_is_deterministic(packed, tmp_path: Path) -> None:
    _, manifest, out = packed
    again = tmp_path / "again.tar"
    pack(manifest, Store([LocalLayer(tmp_path / "source")]), again)
    assert again.read_bytes() == out.read_bytes()
    names = [m.name for m, _ in members(out)]
    assert names[0] == "manifest.json" and all(n.startswith("cas/") for n in names[1:]) and len(names) == 5


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "symlink", "fifo", "directory"])
def test_pack_never_bundles_a_bad_local_entry_it_quarantines_and_refetches_it(packed, make_release, tmp_path: Path,
                                                                              damage: str) -> None:
    from helpers.blobs import disk_cache_with

    release, manifest, out = packed
    local = LocalLayer(tmp_path / "source")
    digest, size = manifest.blobs[1]
    path = local.path_for(digest)
    good = path.read_bytes()
    path.unlink()
    if damage == "flip":
        path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    elif damage == "truncate":
        path.write_bytes(good[:-1])
    elif damage == "extend":
        path.write_bytes(good + b"\0")
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "directory":
        path.mkdir()
    else:
        (tmp_path / "elsewhere").write_bytes(good)
        path.symlink_to(tmp_path / "elsewhere")
    cache = disk_cache_with(tmp_path / "disk_cache", [(digest, good)])
    again = tmp_path / "again.tar"
    pack(manifest, Store([local, cache]), again)
    assert again.read_bytes() == out.read_bytes()  # the good bytes, from the other layer
    if damage != "directory":  # a directory in the way is left there (the write fails, the bytes are served)
        assert local.path_for(digest).read_bytes() == good  # and the local entry replaced by them
    if damage in ("flip", "truncate", "extend"):
        assert len(list(local.quarantine_dir.iterdir())) == 1


def test_pack_counts_a_hit_per_local_blob_and_bumps_old_entries_for_gc(packed, tmp_path: Path) -> None:
    from cubinstore.store.local.root import TOUCH_AFTER

    _, manifest, out = packed
    local = LocalLayer(tmp_path / "source")
    before = local.read_stats()["hits"]
    old = local.path_for(manifest.blobs[0][0])
    recent = local.path_for(manifest.blobs[1][0])
    os.utime(old, (1e9, 1e9))
    stamp = recent.stat().st_mtime - TOUCH_AFTER / 2
    os.utime(recent, (stamp, stamp))
    again = tmp_path / "again.tar"
    pack(manifest, Store([local]), again)
    local.flush_stats()
    assert again.read_bytes() == out.read_bytes()
    assert local.read_stats()["hits"] == before + len(manifest.blobs)
    assert old.stat().st_mtime > 1e9 + TOUCH_AFTER  # gc's LRU clock moved
    assert recent.stat().st_mtime == stamp  # a recent entry is not written to


def test_pack_of_an_incomplete_store_fails_without_leaving_a_bundle(make_release, tmp_path: Path) -> None:
    release = make_release(n=2)
    out = tmp_path / "out.tar"
    with pytest.raises(CubinstoreError):
        pack(Manifest.from_path(release.path), Store([LocalLayer(tmp_path / "empty")]), out)
    assert not out.exists() and list(tmp_path.glob(".tmp.*")) == []


def tamper_blob_byte(items):
    info, data = items[1]
    items[1] = (info, bytes([data[0] ^ 1]) + data[1:])


def tamper_swap_blob(items):
    info, data = items[1]
    fake = b"\x7fELF evil" * 300
    items[1] = (info, fake)


def tamper_rename_blob(items):
    info, data = items[1]
    fake = b"\x7fELF evil" * 300
    info.name = "cas/" + Digest.of(fake).hex
    items[1] = (info, fake)


def tamper_drop_blob(items):
    del items[2]


def tamper_extra_member(items):
    info = tarfile.TarInfo("cas/" + "0" * 64)
    items.append((info, b"x" * 10))


def tamper_traversal(items):
    info = tarfile.TarInfo("../../etc/cron.d/evil")
    items.append((info, b"x"))


def tamper_absolute(items):
    info = tarfile.TarInfo("/tmp/evil")
    items.append((info, b"x"))


def tamper_symlink(items):
    info = tarfile.TarInfo("cas/" + "1" * 64)
    info.type = tarfile.SYMTYPE
    info.linkname = "/etc/passwd"
    items.append((info, None))


def tamper_duplicate(items):
    info, data = items[1]
    copy = tarfile.TarInfo(info.name)
    items.append((copy, data))


def tamper_no_manifest(items):
    del items[0]


@pytest.mark.parametrize(
    "tamper, message",
    [
        (tamper_blob_byte, "blob cas/"),
        (tamper_swap_blob, "blob sha256:"),
        (tamper_rename_blob, "blob sha256:"),
        (tamper_drop_blob, "missing blob sha256:"),
        (tamper_extra_member, "blob sha256:0000"),
        (tamper_traversal, "unexpected member '../../etc/cron.d/evil'"),
        (tamper_absolute, "unexpected member '/tmp/evil'"),
        (tamper_symlink, "member 'cas/1111"),
        (tamper_duplicate, "duplicate member 'cas/"),
        (tamper_no_manifest, "has no manifest.json"),
    ],
)
def test_tampered_bundle_is_rejected_and_nothing_is_stored(packed, tmp_path: Path, tamper, message: str) -> None:
    _, _, out = packed
    items = members(out)
    tamper(items)
    bad = tmp_path / "bad.tar"
    rewrite(bad, items)
    target = LocalLayer(tmp_path / "target")
    with pytest.raises(BundleError) as info:
        unpack(bad, target)
    assert str(info.value).startswith(f"bundle {bad}") and message in str(info.value), str(info.value)
    assert entries(target.root) == []


def test_modified_manifest_is_caught_by_expect(packed, tmp_path: Path, tools) -> None:
    release, manifest, out = packed
    items = members(out)
    doc = dict(release.doc, kernels=release.doc["kernels"][:2])  # a consistent but different release
    blobs = {k["digest"].split(":")[1] for k in doc["kernels"]}
    items = [(items[0][0], tools.canonical(doc))] + [(i, d) for i, d in items[1:] if i.name[4:] in blobs]
    bad = tmp_path / "bad.tar"
    rewrite(bad, items)
    target = LocalLayer(tmp_path / "target")
    with pytest.raises(BundleError, match=rf"^bundle {bad}: manifest is sha256:\w+, expected {manifest.digest}"):
        unpack(bad, target, expect=manifest.digest)
    assert entries(target.root) == []
    assert unpack(bad, target).digest != manifest.digest  # without a pin it is a valid bundle


def test_invalid_manifest_in_bundle_is_a_manifest_error(packed, tmp_path: Path) -> None:
    _, _, out = packed
    items = members(out)
    items[0] = (items[0][0], items[0][1].replace(b'"schema":"cubinstore/manifest/v1"', b'"schema":"v0"'))
    bad = tmp_path / "bad.tar"
    rewrite(bad, items)
    with pytest.raises(CubinstoreError, match=r"^invalid manifest .*bad\.tar:manifest\.json: schema"):
        unpack(bad, LocalLayer(tmp_path / "target"))


def test_truncated_and_random_bundles_raise_only_typed_errors(packed, tmp_path: Path) -> None:
    _, _, out = packed
    data = out.read_bytes()
    rng = random.Random(5)
    target = LocalLayer(tmp_path / "target")
    bad = tmp_path / "fuzz.tar"
    cases = [data[:n] for n in (0, 100, 511, 512, 1500, len(data) // 2, len(data) - 1024)]
    for _ in range(150):
        mutated = bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        cases.append(bytes(mutated))
    cases.append(rng.randbytes(4096))
    rejected = 0
    for case in cases:
        bad.write_bytes(case)
        try:
            unpack(bad, target)
        except CubinstoreError:
            rejected += 1
    assert rejected >= len(cases) - 150  # every truncation and random file; flips in padding may pass
    report_entries = entries(target.root)
    for path in report_entries:  # anything stored came from a bundle that fully verified
        assert Digest.of(path.read_bytes()).hex == path.name


# -- memory bombs: declared sizes are checked on headers, data is streamed -------------------------

def _octal(value: int, width: int) -> bytes:
    return f"{value:0{width - 1}o}".encode() + b"\0"


def gnu_sparse_member(name: str, declared: int, stored: bytes) -> bytes:
    """A GNU sparse header ('S') whose map says ``declared`` bytes, most of them a hole."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    info.mode = 0o444
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[156] = ord("S")
    # One sparse entry: the stored bytes sit at the very end of a `declared`-byte file.
    header[386:398] = _octal(declared - len(stored), 12)
    header[398:410] = _octal(len(stored), 12)
    header[482] = 0  # no extended sparse headers
    header[483:495] = _octal(declared, 12)  # the real (declared) size
    header[148:156] = b"        "
    header[148:156] = f"{sum(header):06o}".encode() + b"\0 "
    return bytes(header) + stored + b"\0" * (-len(stored) % 512)


_UNPACK_UNDER_A_MEMORY_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[3]), int(sys.argv[3])))
from cubinstore import CubinstoreError
from cubinstore.internals import unpack
from cubinstore.store import LocalLayer
try:
    unpack(sys.argv[1], LocalLayer(sys.argv[2]))
except CubinstoreError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
print("unpacked")
"""


def run_unpack_limited(bundle: Path, home: Path, limit: int = 768 << 20):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", _UNPACK_UNDER_A_MEMORY_LIMIT, str(bundle), str(home), str(limit)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


def test_a_sparse_member_declaring_a_gigabyte_is_refused_without_reading_it(tmp_path: Path, tools) -> None:
    # A manifest that names a 1 GiB blob, and a 10 KiB sparse member that claims to be it.
    stored = b"\x7fELF" + bytes(10_000)
    declared = 1 << 30
    fake = tools.kernel_doc("axpy", {"dtype": "f32", "vec": 1}, "sm_90a", stored)
    fake["size"] = declared
    doc = {"schema": "cubinstore/manifest/v1", "kernels": [fake]}
    raw = tools.canonical(doc)
    bundle = tmp_path / "sparse.tar"
    head = tarfile.TarInfo("manifest.json")
    head.size = len(raw)
    with open(bundle, "wb") as f:
        f.write(head.tobuf(format=tarfile.GNU_FORMAT) + raw + b"\0" * (-len(raw) % 512))
        f.write(gnu_sparse_member(f"cas/{fake['digest'].split(':')[1]}", declared, stored))
        f.write(b"\0" * 1024)
    assert bundle.stat().st_size < 20_000
    result = run_unpack_limited(bundle, tmp_path / "home")
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr[-2000:])
    assert result.stdout.startswith(f"BundleError bundle {bundle}: member 'cas/") and "sparse" in result.stdout
    assert entries(tmp_path / "home") == []


def test_a_large_blob_is_streamed_not_held_in_memory(tmp_path: Path, tools) -> None:
    data = b"\x7fELF" + random.Random(1).randbytes((96 << 20) - 4)  # larger than the memory limit allows twice
    doc = {"schema": "cubinstore/manifest/v1", "kernels": [tools.kernel_doc("axpy", {"dtype": "f32", "vec": 1}, "sm_90a", data)]}
    raw = tools.canonical(doc)
    bundle = tmp_path / "big.tar"
    with tarfile.open(bundle, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, body in (("manifest.json", raw), (f"cas/{Digest.of(data).hex}", data)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    del data
    # Python and the package need well under 100 MiB of address space beyond the baseline;
    # holding the member whole (or twice, as bytes and as a joined copy) would not fit.
    result = run_unpack_limited(bundle, tmp_path / "home", limit=(96 + 80) << 20)
    assert result.returncode == 0, (result.stdout, result.stderr[-2000:])
    assert result.stdout == "unpacked\n"
    assert len(entries(tmp_path / "home")) == 2


def test_expect_is_checked_before_any_blob_is_read(packed, tmp_path: Path) -> None:
    release, manifest, out = packed
    items = members(out)
    # The blob members are links (refused when read); a bundle of another release is refused on its manifest alone.
    links = []
    for info, _ in items[1:]:
        link = tarfile.TarInfo(info.name)
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        links.append((link, None))
    items = [items[0], *links]
    bad = tmp_path / "other.tar"
    rewrite(bad, items)
    other = Digest.of(b"another manifest")
    with pytest.raises(BundleError, match=rf"^bundle {bad}: manifest is {manifest.digest}, expected {other}"):
        unpack(bad, LocalLayer(tmp_path / "target"), expect=other)


def test_a_member_whose_header_size_differs_from_the_manifest_is_refused_before_reading(packed, tmp_path: Path) -> None:
    release, manifest, out = packed
    items = members(out)
    info, data = items[1]
    items[1] = (info, data + bytes(1 << 20))  # the header now says 1 MiB more than the manifest does
    bad = tmp_path / "bigger.tar"
    rewrite(bad, items)
    digest, size = next((d, s) for d, s in manifest.blobs if d.hex == info.name[4:])
    with pytest.raises(BundleError, match=rf"^bundle {bad}: blob {digest} \(.*\) has {size + (1 << 20)} bytes, expected {size}"):
        unpack(bad, LocalLayer(tmp_path / "target"))
