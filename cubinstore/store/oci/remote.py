"""``OciLayer``: a repository of an OCI registry as a store layer (``oci://HOST[:PORT]/REPO``).

Blobs are ``GET /v2/REPO/blobs/sha256:<hex>``, read no further than their expected size and
verified by ``Store`` like every remote's bytes; a mirror that serves wrong bytes is skipped
as a corrupt HTTP remote is. Manifests (the artifact that names a release, a channel's
pointer) are read by reference, at most ``MAX_ARTIFACT_BYTES``, and checked against the digest
asked for before anything else looks at them.
"""

from __future__ import annotations

from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError, IntegrityError
from cubinstore.store.layer import Layer
from cubinstore.store.oci.artifact import IMAGE_MANIFEST, MAX_ARTIFACT_BYTES
from cubinstore.store.oci.client import RegistryClient
from cubinstore.store.oci.reference import RegistryRef

__all__ = ["OciLayer"]

_log = get_logger(__name__)


class OciLayer(Layer):
    """One repository of a registry. ``push`` asks tokens for push as well as pull (``publish``)."""

    remote = True

    def __init__(self, url: str | RegistryRef, *, push: bool = False, **http: object) -> None:
        ref = url if isinstance(url, RegistryRef) else RegistryRef.parse(url, what="registry remote")
        if (ref.tag or ref.digest) and not push:
            raise BadArgumentError(f"registry remote {ref}: a remote names a repository, not a tag or digest "
                                   f"(use {ref.base}; open a release with {ref.base}@sha256:<artifact digest>)")
        self.ref = RegistryRef(ref.https, ref.host, ref.port, ref.repository)
        self.client = RegistryClient(self.ref, push=push, **http)
        self.url = self.ref.base

    @property
    def name(self) -> str:
        return f"registry {self.url}"

    def blob_url(self, digest: Digest) -> str:
        return f"{self.url}@{digest}"

    # -- Layer ----------------------------------------------------------------------------------

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        return self.client.get_blob(digest, size)

    def read_capped(self, digest: Digest, limit: int) -> bytes | None:
        """At most ``limit`` + 1 bytes of a small document (a signature, a record); a longer one
        raises ``IntegrityError`` unread."""
        return self.client.get_blob(digest, None, limit=limit)

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        _log.warning("registry %s served bad bytes for %s: %s", self.url, digest, reason)

    # -- publishing ------------------------------------------------------------------------------

    def has(self, digest: Digest, size: int) -> bool:
        """Whether the registry has the blob at the size expected (a HEAD; a wrong size counts as absent)."""
        found = self.client.head_blob(digest)
        if found is not None and found not in (size, -1):
            _log.warning("registry %s declares %d bytes for %s, expected %d: uploading it again",
                         self.url, found, digest, size)
            return False
        return found is not None

    def put(self, digest: Digest, data: bytes) -> None:
        self.client.put_blob(digest, data)

    # -- manifests -------------------------------------------------------------------------------

    def get_manifest(self, reference: Digest | str, *, accept: str = IMAGE_MANIFEST,
                     limit: int = MAX_ARTIFACT_BYTES) -> tuple[Digest, bytes] | None:
        """(digest, bytes) of the manifest ``reference`` (a digest: the bytes must hash to it; a
        tag: whatever the registry serves, its digest computed here), None when absent."""
        what = f"manifest {self.url}{'@' if isinstance(reference, Digest) else ':'}{reference}"
        try:
            found = self.client.get_manifest(str(reference), accept, limit, what)
        except IntegrityError as exc:
            raise IntegrityError(f"{what}: {exc}") from None
        if found is None:
            return None
        raw, _media_type = found
        if len(raw) > limit:
            raise IntegrityError(f"{what}: more than {limit} bytes; not read further")
        digest = Digest.of(raw)
        if isinstance(reference, Digest) and digest != reference:
            raise IntegrityError(f"{what}: the registry served bytes that hash to {digest}; refused")
        return digest, raw

    def put_manifest(self, reference: Digest | str, data: bytes, *, media_type: str = IMAGE_MANIFEST) -> None:
        self.client.put_manifest(str(reference), data, media_type, f"manifest {self.url}:{reference}")

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"<{self.name}>"


