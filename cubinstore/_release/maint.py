"""Maintenance of a local store: pins, garbage collection, verification."""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from cubinstore._core.abi import MAX_BLOB_SIZE, MAX_MANIFEST_BYTES
from cubinstore._core.digest import Digest, verify
from cubinstore.store.local.files import NotRegularFile
from cubinstore.store.local.cas import Entry, LocalLayer
from cubinstore._core.log import get_logger
from cubinstore.errors import CubinstoreError, IntegrityError, StoreError
from cubinstore.manifest import Manifest

__all__ = ["GcResult", "VerifyReport", "gc", "pin", "pinned", "pins_lock", "unpin", "verify_store"]

_log = get_logger(__name__)

_PIN_RE = re.compile(r"([0-9a-f]{64})\.json", re.ASCII)


# -- pins -----------------------------------------------------------------------------------------
# Pins and gc are serialised by one lock (v1/pins.lock): gc re-reads the pins and evicts while
# holding it, so a pin that returned is honoured by every eviction that follows.

def pins_lock(local: LocalLayer) -> AbstractContextManager[None]:
    """The lock ``pin``, ``unpin``, ``unpack --pin`` and ``gc``'s eviction hold."""
    return local.file_lock((), "pins.lock", what="pins (gc or pin running)")


def pin(local: LocalLayer, manifest: Manifest, *, locked: bool = False) -> Path:
    """Protect ``manifest`` and its closure from ``gc``. The pin file is the manifest itself,
    so its closure is known even if the manifest's CAS entry is lost. ``locked``: the caller
    already holds ``pins_lock``."""
    with nullcontext() if locked else pins_lock(local):
        local.write_file(("pins",), f"{manifest.digest.hex}.json", manifest.raw)
        local.write(manifest.digest, manifest.raw)
    return local.pins_dir / f"{manifest.digest.hex}.json"


def unpin(local: LocalLayer, digest: Digest) -> bool:
    with pins_lock(local):
        return local.remove_file(("pins",), f"{digest.hex}.json")


def pinned(local: LocalLayer) -> list[Manifest]:
    """Every pinned manifest. A damaged pin raises ``StoreError``: GC must not guess a closure."""
    manifests: list[Manifest] = []
    for name, _st in local.list_dir(("pins",)):
        path = local.pins_dir / name
        match = _PIN_RE.fullmatch(name)
        if match is None:
            _log.warning("ignoring stray file %s in the pins directory", path)
            continue
        try:
            raw = local.read_file(("pins",), name, MAX_MANIFEST_BYTES)
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
    locks_removed: int = 0


def gc(local: LocalLayer, max_bytes: int) -> GcResult:
    """Evict least recently used entries (mtime, bumped on every read) until the CAS uses at most
    ``max_bytes``; entries referenced by pinned manifests (and the manifests) are never evicted,
    and entries the warm set names are evicted after all others.

    The scan runs unlocked (it may be slow); the pins are read, and entries evicted, under
    ``pins_lock``. Lock files of absent entries that no process holds are removed last.
    """
    result = GcResult(temps_removed=len(local.clean_temps()))
    for name, _st in local.list_dir(("quarantine",)):
        try:
            if local.remove_file(("quarantine",), name):
                result.quarantine_removed += 1
        except StoreError as exc:
            _log.warning("cannot remove quarantined file %s: %s", local.quarantine_dir / name, exc)
    entries, _ = local.scan()
    total = sum(e.size for e in entries)
    result.total_before = total
    with pins_lock(local):
        protected: set[Digest] = set()
        for manifest in pinned(local):
            protected.add(manifest.digest)
            protected.update(digest for digest, _ in manifest.blobs)
        result.pinned_bytes = sum(e.size for e in entries if e.digest in protected)
        # The warm set's CUBINs (run-time compiles a release lacks) go last: they cost a compile to get back.
        from cubinstore._release.warmset import warm_digests

        warm = warm_digests(local)
        victims = []
        for entry in sorted((e for e in entries if e.digest not in protected),
                            key=lambda e: (e.digest in warm, e.mtime, e.digest.hex)):
            if total <= max_bytes:
                break
            victims.append(entry)
            total -= entry.size
        removed = local.remove_many([e.digest for e in victims])  # one walk per shard, not per entry
        result.evicted = [e for e in victims if e.digest in removed]
        _log.debug("evicted %d entries (%d bytes)", len(result.evicted), sum(e.size for e in result.evicted))
    result.total_after = total
    result.locks_removed = local.clean_locks()
    return result


# -- verify ---------------------------------------------------------------------------------------

@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    corrupt: list[tuple[Digest, str, Path | None]] = field(default_factory=list)  # digest, reason, quarantined to
    missing: list[Digest] = field(default_factory=list)
    strays: list[Path] = field(default_factory=list)
    # Of the ok entries, their records (LocalLayer.check_record): matching, written now, replaced
    # (stale), or none kept (such entries load with sha256).
    records: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("ok", "recorded", "re-recorded", "none"), 0))

    @property
    def failed(self) -> bool:
        return bool(self.corrupt or self.missing)


def verify_store(local: LocalLayer, blobs: Sequence[tuple[Digest, int | None]] | None = None) -> VerifyReport:
    """Re-hash every entry (or just ``blobs``), quarantining corrupt ones; write the record of a
    sound entry that lacks one or whose record is stale."""
    report = VerifyReport()
    if blobs is None:
        local.clean_temps()
        entries, report.strays = local.scan()
        targets: list[tuple[Digest, int | None]] = [(e.digest, None) for e in entries]
    else:
        targets = list(blobs)
    with local.session():  # each shard directory opened once for the whole walk
        _verify_each(local, targets, report)
    return report


def _verify_each(local: LocalLayer, targets: list[tuple[Digest, int | None]], report: VerifyReport) -> None:
    for digest, size in targets:
        report.checked += 1
        path = local.path_for(digest)
        try:
            got = local.read_entry_and_record(digest, size if size is not None else MAX_BLOB_SIZE)
            if got is None:
                report.missing.append(digest)
                continue
            data, st, record = got
            verify(data, digest, size, where=str(path))
        except (IntegrityError, NotRegularFile) as exc:
            moved = local.quarantine(digest)
            report.corrupt.append((digest, str(exc), moved))
            _log.info("corrupt %s: %s; quarantined to %s", digest, exc, moved)  # the caller reports it
            continue
        report.ok += 1
        report.records[local.check_record(digest, data, st, record)] += 1
