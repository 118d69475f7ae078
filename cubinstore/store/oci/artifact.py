"""A release as an OCI artifact: the image manifest cubinstore writes, and the checks on one it reads.

One OCI image manifest (``application/vnd.oci.image.manifest.v1+json``) per release, with
``artifactType`` ``RELEASE_ARTIFACT``; its config is the cubinstore manifest itself
(``MANIFEST_MEDIA_TYPE``); each blob of the closure is a layer whose digest is the blob's own
(the digest the manifest and Bazel's CAS name it by), annotated with the kernel ids it serves.
Built from the manifest alone and sorted, so a release always has one artifact digest.

A signed channel's pointer is an artifact too (``CHANNEL_ARTIFACT``): its config is the
signature blob, its one layer the release record it signs; a tag ``channel-NAME`` names it.

What a registry serves is hostile: ``parse_artifact`` checks the document's size, schema,
media types, artifact type and descriptors, and names the registry, repository and digest in
every refusal.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import IntegrityError

__all__ = [
    "BLOB_MEDIA_TYPES",
    "CHANNEL_ARTIFACT",
    "CHANNEL_TAG_PREFIX",
    "IMAGE_MANIFEST",
    "KERNELS_ANNOTATION",
    "MANIFEST_MEDIA_TYPE",
    "MAX_ARTIFACT_BYTES",
    "RECORD_MEDIA_TYPE",
    "RELEASE_ARTIFACT",
    "SIGNATURE_MEDIA_TYPE",
    "Artifact",
    "Descriptor",
    "build_artifact",
    "channel_artifact",
    "channel_tag",
    "parse_artifact",
    "release_layer",
]

IMAGE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
RELEASE_ARTIFACT = "application/vnd.cubinstore.release.v1"
CHANNEL_ARTIFACT = "application/vnd.cubinstore.channel.v1"
MANIFEST_MEDIA_TYPE = "application/vnd.cubinstore.manifest.v1+json"
CUBIN_MEDIA_TYPE = "application/vnd.cubinstore.cubin.v1"
JIT_SOURCES_MEDIA_TYPE = "application/vnd.cubinstore.jit-sources.v1+json"
SIGNATURE_MEDIA_TYPE = "application/vnd.cubinstore.signature.v1+json"
RECORD_MEDIA_TYPE = "application/vnd.cubinstore.release-record.v1+json"
BLOB_MEDIA_TYPES = frozenset({CUBIN_MEDIA_TYPE, JIT_SOURCES_MEDIA_TYPE, RECORD_MEDIA_TYPE})
KERNELS_ANNOTATION = "dev.cubinstore.kernels"
CHANNEL_ANNOTATION = "dev.cubinstore.channel"
CHANNEL_TAG_PREFIX = "channel-"
#: Most bytes of an artifact manifest read from a registry (the distribution spec asks registries
#: to take manifests of 4 MiB; a release of 20,000 kernels is about 3 MiB of descriptors).
MAX_ARTIFACT_BYTES = 4 * 1024 * 1024
_MAX_ANNOTATION = 4096


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: Digest
    size: int
    annotations: Mapping[str, str]

    def to_json(self) -> dict:
        doc: dict = {"mediaType": self.media_type, "digest": str(self.digest), "size": self.size}
        if self.annotations:
            doc["annotations"] = dict(self.annotations)
        return doc


@dataclass(frozen=True)
class Artifact:
    """A checked artifact manifest: its digest, raw bytes, type, config and layers."""

    digest: Digest
    raw: bytes
    artifact_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]


def _annotation(text: str) -> str:
    return text if len(text) <= _MAX_ANNOTATION else text[: _MAX_ANNOTATION - 3] + "..."


def build_artifact(config: Descriptor, layers: Iterable[Descriptor], artifact_type: str,
                   annotations: Mapping[str, str] | None = None) -> bytes:
    """The artifact manifest's bytes: layers sorted by digest, keys sorted, indented (people read
    it with ``skopeo inspect --raw``), so the same inputs give the same digest."""
    doc: dict = {
        "schemaVersion": 2,
        "mediaType": IMAGE_MANIFEST,
        "artifactType": artifact_type,
        "config": config.to_json(),
        "layers": [d.to_json() for d in sorted(layers, key=lambda d: d.digest.hex)],
    }
    if annotations:
        doc["annotations"] = {k: _annotation(v) for k, v in annotations.items()}
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def release_layer(digest: Digest, size: int, kernel_ids: Iterable[str], jit_sources: bool) -> Descriptor:
    ids = ", ".join(kernel_ids)
    return Descriptor(JIT_SOURCES_MEDIA_TYPE if jit_sources else CUBIN_MEDIA_TYPE, digest, size,
                      {KERNELS_ANNOTATION: _annotation(ids)} if ids else {})


def parse_artifact(raw: bytes, digest: Digest, where: str, *, artifact_type: str, config_type: str) -> Artifact:
    """Check ``raw`` (already verified to hash to ``digest``) is an artifact of ``artifact_type``
    whose config has ``config_type``; ``where`` (``oci://HOST/REPO``) is named in every refusal."""
    at = f"artifact {where}@{digest}"
    if len(raw) > MAX_ARTIFACT_BYTES:
        raise IntegrityError(f"{at}: {len(raw)} bytes, over the {MAX_ARTIFACT_BYTES}-byte limit")
    doc = loads_strict(raw, at, IntegrityError)  # no deep nesting, duplicate keys or NaN from a registry
    if not isinstance(doc, dict):
        raise IntegrityError(f"{at}: expected a JSON object")
    if doc.get("schemaVersion") != 2 or doc.get("mediaType") != IMAGE_MANIFEST:
        raise IntegrityError(f"{at}: expected an OCI image manifest (schemaVersion 2, mediaType {IMAGE_MANIFEST}), "
                             f"got schemaVersion {show(doc.get('schemaVersion'))}, mediaType {show(doc.get('mediaType'))}")
    found_type = doc.get("artifactType")
    if found_type != artifact_type:
        raise IntegrityError(f"{at}: artifactType {show(found_type)}, expected {artifact_type!r}: not a "
                             f"cubinstore {'release' if artifact_type == RELEASE_ARTIFACT else 'channel'}")
    config = _descriptor(doc.get("config"), f"{at}: config")
    if config.media_type != config_type:
        raise IntegrityError(f"{at}: config has mediaType {show(config.media_type)}, expected {config_type!r}")
    layers_doc = doc.get("layers")
    if not isinstance(layers_doc, list):
        raise IntegrityError(f"{at}: 'layers' must be a list")
    layers = tuple(_descriptor(d, f"{at}: layers[{i}]") for i, d in enumerate(layers_doc))
    for i, layer in enumerate(layers):
        if layer.media_type not in BLOB_MEDIA_TYPES:
            raise IntegrityError(f"{at}: layers[{i}] ({layer.digest}) has mediaType {show(layer.media_type)}, "
                                 f"expected one of {', '.join(sorted(BLOB_MEDIA_TYPES))}")
    return Artifact(digest, bytes(raw), found_type, config, layers)


def _descriptor(doc: object, at: str) -> Descriptor:
    if not isinstance(doc, dict):
        raise IntegrityError(f"{at}: expected a descriptor object")
    media_type, size, annotations = doc.get("mediaType"), doc.get("size"), doc.get("annotations") or {}
    try:
        digest = Digest.parse(doc.get("digest"))
    except ValueError as exc:
        raise IntegrityError(f"{at}: {exc}") from None
    if not isinstance(media_type, str) or not media_type:
        raise IntegrityError(f"{at}: 'mediaType' must be a string")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise IntegrityError(f"{at}: 'size' must be a non-negative integer, got {show(size)}")
    if not isinstance(annotations, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in annotations.items()):
        raise IntegrityError(f"{at}: 'annotations' must map strings to strings")
    return Descriptor(media_type, digest, size, annotations)


def channel_tag(channel: str) -> str:
    """The tag that points at a channel's newest signature: ``channel-NAME`` (a valid channel name
    is a valid tag once prefixed)."""
    return f"{CHANNEL_TAG_PREFIX}{channel}"


def channel_artifact(channel: str, signature: Digest, signature_size: int, record: Digest, record_size: int) -> bytes:
    """A channel pointer as an artifact: config the signature, one layer the record it signs."""
    config = Descriptor(SIGNATURE_MEDIA_TYPE, signature, signature_size, {})
    layer = Descriptor(RECORD_MEDIA_TYPE, record, record_size, {})
    return build_artifact(config, [layer], CHANNEL_ARTIFACT, {CHANNEL_ANNOTATION: channel})
