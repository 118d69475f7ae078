"""``oci-layout:DIR``: an OCI image layout directory (what ``skopeo copy ... oci:DIR`` writes) as a
read-only source: blobs at ``DIR/blobs/sha256/<hex>``, tags in ``DIR/index.json``.

The layout is data like any remote's: files are read no further than their expected size, never
through a link, and ``Store`` verifies every byte; ``index.json`` is read at most 4 MiB.
"""

from __future__ import annotations

from pathlib import Path

from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, IntegrityError
from cubinstore.store.layer import Layer, limit_for
from cubinstore.store.local.files import NotRegularFile, read_regular
from cubinstore.store.oci.artifact import MAX_ARTIFACT_BYTES
from cubinstore.store.oci.reference import LAYOUT_SCHEME

__all__ = ["LAYOUT_SCHEME", "OciLayout", "parse_layout_ref"]

_log = get_logger(__name__)


def parse_layout_ref(text: str) -> tuple[Path, Digest | None, str | None]:
    """``oci-layout:DIR[@sha256:HEX]`` or ``oci-layout:DIR:TAG``: (directory, digest, tag)."""
    if not text.startswith(LAYOUT_SCHEME) or "\0" in text:
        raise BadArgumentError(f"invalid layout reference {show(text)}: expected oci-layout:DIR[@sha256:HEX|:TAG]")
    rest = text[len(LAYOUT_SCHEME):]
    digest = tag = None
    if "@" in rest:
        rest, _, pinned = rest.rpartition("@")
        digest = Digest.parse(pinned)
    elif ":" in rest.rsplit("/", 1)[-1]:
        rest, _, tag = rest.rpartition(":")
    if not rest:
        raise BadArgumentError(f"invalid layout reference {show(text)}: no directory")
    return Path(rest).expanduser(), digest, tag


class OciLayout(Layer):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.url = f"{LAYOUT_SCHEME}{self.root}"

    @property
    def name(self) -> str:
        return f"OCI layout {self.root}"

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        return self._read(digest, limit_for(size))

    def read_capped(self, digest: Digest, limit: int) -> bytes | None:
        return self._read(digest, limit)

    def _read(self, digest: Digest, limit: int) -> bytes | None:
        path = self.root / "blobs" / "sha256" / digest.hex
        try:
            return read_regular(path, limit)
        except NotRegularFile as exc:
            _log.warning("ignoring %s: %s", path, exc)
            return None

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        _log.warning("corrupt blob %s in OCI layout %s (left in place): %s", digest, self.root, reason)

    def get_manifest(self, reference: Digest | str, **_: object) -> tuple[Digest, bytes] | None:
        """(digest, bytes) of the manifest ``reference``: a digest, or a tag of ``index.json``."""
        if not isinstance(reference, Digest):
            found = self._tagged(reference)
            if found is None:
                return None
            reference = found
        raw = self._read(reference, MAX_ARTIFACT_BYTES)
        if raw is None:
            return None
        if len(raw) > MAX_ARTIFACT_BYTES or Digest.of(raw) != reference:
            raise IntegrityError(f"manifest {self.url}@{reference}: the file does not hash to it (or is over "
                                 f"{MAX_ARTIFACT_BYTES} bytes); refused")
        return reference, raw

    def _tagged(self, tag: str) -> Digest | None:
        raw = read_regular(self.root / "index.json", MAX_ARTIFACT_BYTES)
        if raw is None:
            return None
        where = f"{self.root / 'index.json'}: not an OCI image index"
        doc = loads_strict(raw, where, IntegrityError)  # no deep nesting, duplicate keys or NaN
        try:
            for entry in doc.get("manifests") or []:
                if (entry.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag:
                    return Digest.parse(entry.get("digest"))
        except (ValueError, AttributeError, TypeError) as exc:
            raise IntegrityError(f"{where} ({exc})") from None
        return None
