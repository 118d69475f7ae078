"""Offline bundles: a plain tar of ``manifest.json`` and ``cas/<hex>`` for each blob of its closure.

``unpack`` trusts nothing in the tar: member names, types and sizes are checked
against a fixed layout, every blob is hashed against its name and against the
manifest, and nothing is written to the store until the whole bundle has verified.
"""

from __future__ import annotations

import io
import logging
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

from cubinstore._digest import Digest, show
from cubinstore._files import atomic_file
from cubinstore._local import LocalStore
from cubinstore.errors import BundleError, StoreError
from cubinstore.manifest import MAX_BLOB_SIZE, MAX_MANIFEST_BYTES, Manifest
from cubinstore.store import Store

__all__ = ["MANIFEST_NAME", "pack", "unpack"]

_log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
_BLOB_RE = re.compile(r"cas/([0-9a-f]{64})", re.ASCII)
_MAX_MEMBERS = 100_000
_MAX_TOTAL = 16 * 1024 * 1024 * 1024

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


def pack(manifest: Manifest, store: Store, out: Path, *, progress: Progress | None = None) -> int:
    """Write a bundle of ``manifest`` and its closure (verified bytes from ``store``) to ``out``; returns its size.

    Blobs are fetched one at a time and streamed into a temp file renamed at the end, so
    memory stays at one blob and a failed pack leaves no partial bundle.
    """
    out = Path(out)
    blobs = manifest.blobs
    with atomic_file(out) as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            tar.addfile(_member(MANIFEST_NAME, len(manifest.raw)), io.BytesIO(manifest.raw))
            done_bytes = 0
            for i, (digest, size) in enumerate(blobs):
                names = ", ".join(k.id for k in manifest.kernels if k.digest == digest)
                data = store.get(digest, size, name=names)
                tar.addfile(_member(f"cas/{digest.hex}", len(data)), io.BytesIO(data))
                done_bytes += len(data)
                if progress:
                    progress(i + 1, len(blobs), done_bytes)
        total = f.tell()
    _log.debug("packed %s (%d blobs, %d bytes) into %s", manifest.digest, len(blobs), total, out)
    return total


def _read_members(path: Path) -> tuple[bytes, dict[str, bytes]]:
    manifest_raw: bytes | None = None
    blobs: dict[str, bytes] = {}
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
    if size > _MAX_TOTAL:
        raise BundleError(f"bundle {path} is {size} bytes, more than the {_MAX_TOTAL} allowed")
    try:
        # Plain tar only: no decompression bombs, and member sizes come from headers we check.
        with tarfile.open(path, mode="r:") as tar:
            count = 0
            while True:
                member = tar.next()
                if member is None:
                    break
                count += 1
                if count > _MAX_MEMBERS:
                    raise BundleError(f"bundle {path} has more than {_MAX_MEMBERS} members")
                name = member.name
                match = _BLOB_RE.fullmatch(name)
                if name != MANIFEST_NAME and match is None:
                    raise BundleError(f"bundle {path}: unexpected member {show(name)}; expected {MANIFEST_NAME} and cas/<64 hex>")
                if not member.isreg():
                    raise BundleError(f"bundle {path}: member {show(name)} is not a regular file")
                limit = MAX_MANIFEST_BYTES if match is None else MAX_BLOB_SIZE
                if member.size > limit or member.size <= 0:
                    raise BundleError(f"bundle {path}: member {show(name)} has size {member.size}, expected 1..{limit}")
                if (match is None and manifest_raw is not None) or (match is not None and match.group(1) in blobs):
                    raise BundleError(f"bundle {path}: duplicate member {show(name)}")
                handle = tar.extractfile(member)
                if handle is None:
                    raise BundleError(f"bundle {path}: cannot read member {show(name)}")
                data = handle.read(member.size)
                if len(data) != member.size:
                    raise BundleError(f"bundle {path}: member {show(name)} truncated: {len(data)} of {member.size} bytes")
                if match is None:
                    manifest_raw = data
                else:
                    blobs[match.group(1)] = data
    except BundleError:
        raise
    except (tarfile.TarError, EOFError, ValueError, UnicodeError, OverflowError) as exc:
        raise BundleError(f"bundle {path} is not a valid tar file: {exc}") from exc
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc.strerror or exc}") from exc
    if manifest_raw is None:
        raise BundleError(f"bundle {path} has no {MANIFEST_NAME}")
    return manifest_raw, blobs


def unpack(path: str | Path, local: LocalStore, *, expect: Digest | None = None,
           progress: Progress | None = None) -> Manifest:
    """Verify the whole bundle at ``path``, then store the manifest and every blob in ``local``.

    ``expect`` pins the manifest digest: a bundle with any other manifest is rejected.
    """
    path = Path(path)
    manifest_raw, blobs = _read_members(path)
    manifest = Manifest.from_bytes(manifest_raw, source=f"{path}:{MANIFEST_NAME}")
    if expect is not None and manifest.digest != expect:
        raise BundleError(f"bundle {path}: manifest is {manifest.digest}, expected {expect}")
    needed = {digest.hex: (digest, size) for digest, size in manifest.blobs}
    extra = sorted(set(blobs) - set(needed))
    if extra:
        raise BundleError(f"bundle {path}: blob sha256:{extra[0]} is not referenced by its manifest")
    for hex_, (digest, size) in needed.items():
        data = blobs.get(hex_)
        ids = ", ".join(k.id for k in manifest.kernels if k.digest == digest)
        if data is None:
            raise BundleError(f"bundle {path}: missing blob {digest} ({ids})")
        if len(data) != size:
            raise BundleError(f"bundle {path}: blob {digest} ({ids}) has {len(data)} bytes, expected {size}")
        actual = Digest.of(data)
        if actual != digest:
            raise BundleError(f"bundle {path}: blob cas/{hex_} ({ids}) hashes to {actual}; the bundle was modified")
    # Everything verified: now write. A failure here leaves only complete, verified entries.
    written = 0
    try:
        local.write(manifest.digest, manifest.raw)
        for i, (hex_, (digest, _size)) in enumerate(sorted(needed.items())):
            local.write(digest, blobs[hex_])
            written += len(blobs[hex_])
            if progress:
                progress(i + 1, len(needed), written)
    except StoreError as exc:
        raise StoreError(f"unpacking {path} into {local.root}: {exc}") from exc
    _log.debug("unpacked %s (%d blobs) from %s into %s", manifest.digest, len(needed), path, local.root)
    return manifest


