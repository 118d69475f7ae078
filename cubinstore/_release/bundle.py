"""Offline bundles: a plain tar of ``manifest.json`` and ``cas/<hex>`` for each blob of its closure.

``unpack`` trusts nothing in the tar: the manifest must come first (so ``--expect`` is
checked before any blob), member names, types and sizes are checked against a fixed
layout and the manifest before any data is read, every blob is streamed and hashed
against its name, and nothing enters the CAS until the whole bundle has verified.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from collections.abc import Callable
from contextlib import nullcontext
from itertools import count, repeat
from pathlib import Path
from typing import BinaryIO

from cubinstore._core.abi import MAX_MANIFEST_BYTES
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore._core.userfile import open_regular
from cubinstore.store.local.files import atomic_file
from cubinstore.store.local.cas import LocalLayer
from cubinstore._core.log import get_logger
from cubinstore.errors import BundleError, ManifestError, StoreError
from cubinstore.manifest import Manifest
from cubinstore.store import Store

__all__ = ["MANIFEST_NAME", "pack", "unpack"]

_log = get_logger(__name__)

MANIFEST_NAME = "manifest.json"
_BLOB_RE = re.compile(r"cas/([0-9a-f]{64})", re.ASCII)
_MAX_MEMBERS = 100_000
_MAX_TOTAL = 16 * 1024 * 1024 * 1024
_CHUNK = 1 << 20
_MAX_READ = _CHUNK + 512  # one chunk of member data (or one 512-byte header) per read
# pack writes the bundle in pieces of about this size. Bigger writes get the page cache's large
# folios, whose first touch is far dearer on the 2-core VM host measured (perf, 10,000 blobs: the
# kernel's copy into the page cache, copy_folio_from_iter_atomic, was 20-24% of pack's CPU with
# 1 MiB writes, 0.4-0.6% with these; tar writes 10 KiB records). 2,900 writes of 46 MB cost little.
_WRITE_CHUNK = 16 << 10

_ZEROS = bytes(tarfile.BLOCKSIZE)
# The fields of _member's USTAR header that do not depend on the member: mode, uid, gid; mtime;
# after the checksum: type, no link name, magic and version, no user, group or device numbers.
_MODE_IDS = b"0000444\0" b"0000000\0" b"0000000\0"
_MTIME = b"00000000000\0"
_AFTER_CHECKSUM = (tarfile.REGTYPE + bytes(100) + tarfile.POSIX_MAGIC + bytes(64) + bytes(16)).ljust(
    tarfile.BLOCKSIZE - 156, b"\0")
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(b" " * 8) + sum(_AFTER_CHECKSUM)
_NAME_FILL = bytes(100 - 4 - 64)  # a blob member's name, cas/<64 hex>, is 68 of the field's 100 bytes
_BLOB_FIXED_SUM = _FIXED_SUM + sum(b"cas/")
_MAX_FAST_SIZE = 8**11  # sizes that fit the 11 octal digits of the size field
_WRITEBACK_EVERY = 8 << 20
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None
Progress = Callable[[int, int, int], None]  # (done, total, bytes so far)


def _member(name: str, size: int) -> tarfile.TarInfo:
    # Fixed metadata so the same manifest always packs to the same bytes.
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o444
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _ustar_header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header tarfile writes for ``_member(name, size)``, built directly.

    tarfile spends more per member than reading and hashing a small CUBIN; a bundle of
    10,000 blobs is written at close to ``tar``'s speed this way. The bytes are the same
    (tests compare them with ``TarInfo.tobuf``), so bundles stay reproducible.
    """
    raw_name = name.encode("ascii")
    if len(raw_name) > 100 or size >= 8**11:
        return _member(name, size).tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o\0" % size
    # The checksum is the sum of the header's bytes (its own field as spaces): the fixed fields'
    # share is summed once, so a member sums only its name and size.
    checksum = _FIXED_SUM + sum(raw_name) + sum(size_field)
    return b"".join([
        raw_name.ljust(100, b"\0"), _MODE_IDS, size_field, _MTIME, b"%06o\0 " % checksum, _AFTER_CHECKSUM,
    ])


def pack(manifest: Manifest, store: Store, out: Path, *, progress: Progress | None = None) -> int:
    """Write a bundle of ``manifest`` and its closure (verified bytes from ``store``) to ``out``; returns its size.

    Blobs are read one at a time and streamed into a temp file renamed at the end, so
    memory stays at one blob plus a 16 KiB write buffer, and a failed pack leaves no partial
    bundle. The tar is what ``tarfile`` writes (USTAR, fixed metadata): members, two zero
    blocks, records of 10 KiB.
    """
    out = Path(out)
    blobs = manifest.blobs
    total_blobs = len(blobs)
    local = store.local
    fallback: Store | None = None  # store without its memory layer, made at the first blob local lacks
    block = tarfile.BLOCKSIZE
    pads = [_ZEROS[:i] for i in range(block)]
    hits = 0
    by_size: dict[int, tuple[bytes, int]] = {}
    with atomic_file(out, buffering=0) as f, local.session() if local is not None else nullcontext():  # each shard opened once
        fd = f.fileno()
        parts: list[bytes] = []  # what is not yet written: at most _WRITE_CHUNK bytes plus one member
        pending = 0
        written = 0  # bytes handed to the kernel
        started = 0  # the disk has been asked to write the bundle up to here

        def flush() -> None:
            nonlocal pending, written, started
            buf = memoryview(b"".join(parts))
            parts.clear()
            while buf:
                buf = buf[os.write(fd, buf[:_WRITE_CHUNK]):]  # a big manifest or blob too, in pieces
            written += pending
            pending = 0
            if written - started >= _WRITEBACK_EVERY and _FADV_DONTNEED is not None:
                # Start writing what is written so far (asynchronously, as the pages are not
                # needed again here): the fsync before the rename then waits for the last few
                # MiB, not for the whole bundle.
                try:
                    os.posix_fadvise(fd, started, written - started, _FADV_DONTNEED)
                except OSError:
                    pass  # only a hint
                started = written

        raw = manifest.raw
        pad = -len(raw) % block
        parts += (_ustar_header(MANIFEST_NAME, len(raw)), raw, pads[pad])
        pending += block + len(raw) + pad
        # A whole local entry in one read and one hash (LocalLayer.read_verified_entries); anything
        # else through get, which quarantines a bad entry and fetches from the other layers.
        found = local.read_verified_entries(blobs) if local is not None else repeat(None)
        done_bytes = 0
        try:
            for i, (digest, size), data in zip(count(1), blobs, found):
                hex_ = digest.hex
                if data is None:
                    if fallback is None:
                        from cubinstore._release.prefetch import without_memory  # only here: most packs never miss

                        fallback = without_memory(store)  # each blob is read once: caching it would only copy it
                    data = fallback.get(digest, size, name=", ".join(manifest.ids_of(digest)))
                else:
                    hits += 1
                sized = by_size.get(size)
                if sized is None:  # the header's fields after the name, and their sum, once per size
                    if size >= _MAX_FAST_SIZE:
                        raise BundleError(f"blob {digest} has {size} bytes, more than a tar member holds")
                    size_field = b"%011o\0" % size
                    sized = by_size[size] = (_NAME_FILL + _MODE_IDS + size_field + _MTIME,
                                             _BLOB_FIXED_SUM + sum(size_field))
                # _ustar_header(f"cas/{hex_}", size), in pieces joined with the member's data
                raw_name = hex_.encode("ascii")
                pad = -size % block
                parts += (b"cas/", raw_name, sized[0], b"%06o\0 " % (sized[1] + sum(raw_name)), _AFTER_CHECKSUM,
                          data, pads[pad])
                pending += block + size + pad
                if pending >= _WRITE_CHUNK:
                    flush()
                done_bytes += size
                if progress:
                    progress(i, total_blobs, done_bytes)
        finally:
            if hits and local is not None:
                local.add_stats({"hits": hits})  # counted once, as get_local counted each
        end = 2 * block
        end += -(written + pending + end) % tarfile.RECORDSIZE
        parts.append(bytes(end))
        pending += end
        flush()
        total = written
    _log.debug("packed %s (%d blobs, %d bytes) into %s", manifest.digest, len(blobs), total, out)
    return total


class _BoundedReads(io.RawIOBase):
    """The bundle file, refusing any single read larger than ``_MAX_READ``.

    tarfile reads a GNU long-name or PAX header's whole declared size in one call; a
    header declaring gigabytes would be read into memory before we see the member.
    Every read this module makes itself is chunked, so a large read can only be such a header.
    """

    def __init__(self, f: BinaryIO, path: Path) -> None:
        super().__init__()
        self._f = f
        self._path = path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0 or n > _MAX_READ:
            raise BundleError(f"bundle {self._path}: a header declares {n} bytes of metadata; refusing to read it")
        return self._f.read(n)

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def _check_member(member: tarfile.TarInfo, path: Path) -> re.Match[str] | None:
    """The member's blob-name match (None for the manifest); refuses anything else."""
    name = member.name
    match = _BLOB_RE.fullmatch(name)
    if name != MANIFEST_NAME and match is None:
        raise BundleError(f"bundle {path}: unexpected member {show(name)}; expected {MANIFEST_NAME} and cas/<64 hex>")
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise BundleError(f"bundle {path}: member {show(name)} is not a regular file")
    if member.issparse():  # a sparse member declares far more bytes than the file holds
        raise BundleError(f"bundle {path}: member {show(name)} is a sparse file; bundles hold plain files only")
    return match


def _read_manifest(tar: tarfile.TarFile, path: Path, expect: Digest | None) -> Manifest:
    member = tar.next()
    if member is None or member.name != MANIFEST_NAME:
        raise BundleError(f"bundle {path} has no {MANIFEST_NAME} as its first member"
                          + (f" (found {show(member.name)})" if member is not None else ""))
    _check_member(member, path)
    if not 0 < member.size <= MAX_MANIFEST_BYTES:
        raise BundleError(f"bundle {path}: member {show(member.name)} has size {member.size}, expected 1..{MAX_MANIFEST_BYTES}")
    handle = tar.extractfile(member)
    if handle is None:
        raise BundleError(f"bundle {path}: cannot read member {show(member.name)}")
    raw = b"".join(iter(lambda: handle.read(_CHUNK), b""))
    if len(raw) != member.size:
        raise BundleError(f"bundle {path}: member {show(member.name)} truncated: {len(raw)} of {member.size} bytes")
    manifest = Manifest.from_bytes(raw, source=f"{path}:{MANIFEST_NAME}")
    # Checked before any blob is read: a bundle of another release costs nothing.
    if expect is not None and manifest.digest != expect:
        raise BundleError(f"bundle {path}: manifest is {manifest.digest}, expected {expect}")
    return manifest


def _stage_blobs(tar: tarfile.TarFile, path: Path, manifest: Manifest, local: LocalLayer,
                 staged: list[tuple[str, Digest]], progress: Progress | None) -> None:
    """Stream each blob member into a staged temp file, verifying size and hash as it goes."""
    needed = {digest.hex: (digest, size) for digest, size in manifest.blobs}
    declared = sum(size for _, size in needed.values())
    if declared > _MAX_TOTAL:
        raise BundleError(f"bundle {path}: its manifest names {declared} bytes of blobs, more than the {_MAX_TOTAL} allowed")
    count = 1
    done = 0
    seen: set[str] = set()
    while True:
        member = tar.next()
        if member is None:
            break
        count += 1
        if count > _MAX_MEMBERS:
            raise BundleError(f"bundle {path} has more than {_MAX_MEMBERS} members")
        match = _check_member(member, path)
        if match is None:
            raise BundleError(f"bundle {path}: duplicate member {show(member.name)}")
        hex_ = match.group(1)
        if hex_ not in needed:
            raise BundleError(f"bundle {path}: blob sha256:{hex_} is not referenced by its manifest")
        if hex_ in seen:
            raise BundleError(f"bundle {path}: duplicate member {show(member.name)}")
        seen.add(hex_)
        digest, size = needed[hex_]
        ids = ", ".join(manifest.ids_of(digest))
        if member.size != size:  # checked on the header: nothing read yet
            raise BundleError(f"bundle {path}: blob {digest} ({ids}) has {member.size} bytes, expected {size}")
        handle = tar.extractfile(member)
        if handle is None:
            raise BundleError(f"bundle {path}: cannot read member {show(member.name)}")
        out, tmp = local.new_staged(digest)
        staged.append((tmp, digest))
        hasher = hashlib.sha256()
        got = 0
        with out:
            while chunk := handle.read(_CHUNK):
                hasher.update(chunk)
                out.write(chunk)
                got += len(chunk)
            out.flush()  # made durable with all the others before any rename (LocalLayer.sync_staged)
        if got != size:
            raise BundleError(f"bundle {path}: member {show(member.name)} truncated: {got} of {size} bytes")
        if hasher.hexdigest() != hex_:
            raise BundleError(f"bundle {path}: blob cas/{hex_} ({ids}) hashes to sha256:{hasher.hexdigest()}; "
                              "the bundle was modified")
        done += size
        if progress:
            progress(len(staged), len(needed), done)
    missing = sorted(set(needed) - seen)
    if missing:
        digest = needed[missing[0]][0]
        raise BundleError(f"bundle {path}: missing blob {digest} ({', '.join(manifest.ids_of(digest))})")


def unpack(path: str | Path, local: LocalLayer, *, expect: Digest | None = None,
           progress: Progress | None = None, pin: bool = False) -> Manifest:
    """Verify the bundle at ``path`` member by member, then store the manifest and every blob in ``local``.

    ``expect`` pins the manifest digest: a bundle with any other manifest is rejected before
    any blob is read. Blobs stream into temp files beside their CAS names (memory stays at one chunk) and enter
    the CAS only once the whole bundle has verified. ``pin`` pins the manifest under the
    same lock gc takes, so no gc can run between the blobs landing and the pin.
    """
    path = Path(path)
    staged: list[tuple[str, Digest]] = []
    try:
        with open_regular(path, "bundle", BundleError) as f:
            size = os.fstat(f.fileno()).st_size
            if size > _MAX_TOTAL:
                raise BundleError(f"bundle {path} is {size} bytes, more than the {_MAX_TOTAL} allowed")
            try:
                # Plain tar only: no decompression bombs, and member sizes come from headers we check.
                with tarfile.open(fileobj=_BoundedReads(f, path), mode="r:") as tar, \
                        local.session():  # type: ignore[arg-type]
                    manifest = _read_manifest(tar, path, expect)
                    _stage_blobs(tar, path, manifest, local, staged, progress)
            except (BundleError, StoreError, ManifestError):
                raise
            except (tarfile.TarError, EOFError, ValueError, UnicodeError, OverflowError) as exc:
                raise BundleError(f"bundle {path} is not a valid tar file: {exc}") from exc
            except OSError as exc:
                raise BundleError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
        # Everything verified: publish. A failure here leaves only complete, verified entries.
        from cubinstore._release.maint import pin as pin_manifest  # unpack's only: pack never imports it
        from cubinstore._release.maint import pins_lock

        try:
            local.sync_staged(staged)  # every staged byte durable before any rename
            # The renames: made durable together by one more sync when the batch ends.
            with pins_lock(local) if pin else nullcontext(), local.batch(sync_each=False):
                local.write(manifest.digest, manifest.raw)
                staged.reverse()  # committed from the end: each pop is O(1)
                while staged:
                    tmp, digest = staged[-1]
                    local.commit_staged(tmp, digest)
                    staged.pop()
                if pin:
                    pin_manifest(local, manifest, locked=True)
        except StoreError as exc:
            raise StoreError(f"unpacking {path} into {local.root}: {exc}") from exc
    finally:
        for tmp, digest in staged:
            local.drop_staged(tmp, digest)
    _log.debug("unpacked %s (%d blobs) from %s into %s", manifest.digest, len(manifest.blobs), path, local.root)
    return manifest
