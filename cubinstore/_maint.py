"""Maintenance of a local store: pins, garbage collection, verification."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cubinstore._digest import Digest
from cubinstore._files import NotRegularFile, atomic_write, read_regular, verify
from cubinstore._local import Entry, LocalStore
from cubinstore.errors import CubinstoreError, IntegrityError, StoreError
from cubinstore.manifest import MAX_BLOB_SIZE, MAX_MANIFEST_BYTES, Manifest

__all__ = ["GcResult", "VerifyReport", "gc", "pin", "pinned", "unpin", "verify_store"]

_log = logging.getLogger(__name__)

_PIN_RE = re.compile(r"([0-9a-f]{64})\.json", re.ASCII)


# -- pins -----------------------------------------------------------------------------------------

def pin(local: LocalStore, manifest: Manifest) -> Path:
    """Protect ``manifest`` and its closure from ``gc``. The pin file is the manifest itself,
    so its closure is known even if the manifest's CAS entry is lost."""
    path = local.pins_dir / f"{manifest.digest.hex}.json"
    atomic_write(path, manifest.raw)
    local.write(manifest.digest, manifest.raw)
    return path


def unpin(local: LocalStore, digest: Digest) -> bool:
    try:
        (local.pins_dir / f"{digest.hex}.json").unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StoreError(f"cannot remove pin {digest} in {local.pins_dir}: {exc.strerror or exc}") from exc
    return True


def pinned(local: LocalStore) -> list[Manifest]:
    """Every pinned manifest. A damaged pin raises ``StoreError``: GC must not guess a closure."""
    manifests: list[Manifest] = []
    try:
        names = sorted(os.listdir(local.pins_dir))
    except FileNotFoundError:
        return manifests
    except OSError as exc:
        raise StoreError(f"cannot list pins in {local.pins_dir}: {exc.strerror or exc}") from exc
    for name in names:
        path = local.pins_dir / name
        match = _PIN_RE.fullmatch(name)
        if match is None:
            _log.warning("ignoring stray file %s in the pins directory", path)
            continue
        try:
            raw = read_regular(path, MAX_MANIFEST_BYTES)
            if raw is None:  # unpinned concurrently
                continue
            digest = Digest(match.group(1))
            verify(raw, digest, None, where=str(path))
            manifests.append(Manifest.from_bytes(raw, source=str(path)))
        except (CubinstoreError, NotRegularFile) as exc:
            raise StoreError(
                f"pin {path} is damaged ({exc}); run `cubinstore unpin sha256:{match.group(1)}` "
                "and pin the manifest again"
            ) from exc
    return manifests


# -- gc -------------------------------------------------------------------------------------------

@dataclass
class GcResult:
    total_before: int = 0
    total_after: int = 0
    pinned_bytes: int = 0
    evicted: list[Entry] = field(default_factory=list)
    quarantine_removed: int = 0
    temps_removed: int = 0


def gc(local: LocalStore, max_bytes: int) -> GcResult:
    """Evict least recently used entries (mtime, bumped on every read) until the CAS uses at most
    ``max_bytes``; entries referenced by pinned manifests (and the manifests) are never evicted."""
    protected: set[Digest] = set()
    for manifest in pinned(local):
        protected.add(manifest.digest)
        protected.update(digest for digest, _ in manifest.blobs)
    result = GcResult(temps_removed=len(local.clean_temps()))
    try:
        quarantined = list(os.scandir(local.quarantine_dir))
    except FileNotFoundError:
        quarantined = []
    for item in quarantined:
        try:
            os.unlink(item.path)
            result.quarantine_removed += 1
        except OSError as exc:
            _log.warning("cannot remove quarantined file %s: %s", item.path, exc)
    entries, _ = local.scan()
    total = sum(e.size for e in entries)
    result.total_before = total
    result.pinned_bytes = sum(e.size for e in entries if e.digest in protected)
    for entry in sorted((e for e in entries if e.digest not in protected), key=lambda e: (e.mtime, e.digest.hex)):
        if total <= max_bytes:
            break
        if local.remove(entry.digest):
            result.evicted.append(entry)
            _log.debug("evicted %s (%d bytes)", entry.digest, entry.size)
        total -= entry.size
    result.total_after = total
    return result


# -- verify ---------------------------------------------------------------------------------------

@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    corrupt: list[tuple[Digest, str, Path | None]] = field(default_factory=list)  # digest, reason, quarantined to
    missing: list[Digest] = field(default_factory=list)
    strays: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.corrupt or self.missing)


def verify_store(local: LocalStore, blobs: Sequence[tuple[Digest, int | None]] | None = None) -> VerifyReport:
    """Re-hash every entry (or just ``blobs``), quarantining corrupt ones."""
    report = VerifyReport()
    if blobs is None:
        local.clean_temps()
        entries, report.strays = local.scan()
        targets: list[tuple[Digest, int | None]] = [(e.digest, None) for e in entries]
    else:
        targets = list(blobs)
    for digest, size in targets:
        report.checked += 1
        path = local.path_for(digest)
        try:
            data = read_regular(path, size if size is not None else MAX_BLOB_SIZE)
            if data is None:
                report.missing.append(digest)
                continue
            verify(data, digest, size, where=str(path))
        except (IntegrityError, NotRegularFile) as exc:
            moved = local.quarantine(path)
            report.corrupt.append((digest, str(exc), moved))
            _log.info("corrupt %s: %s; quarantined to %s", digest, exc, moved)  # the caller reports it
            continue
        report.ok += 1
    return report
