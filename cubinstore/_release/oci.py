"""Releases as OCI artifacts: publish one to a registry, open one by its artifact digest.

``publish_oci`` pushes a manifest's closure as blobs (a HEAD each, only the missing ones
uploaded, so a push that was interrupted uploads only what is still missing when run again),
then the manifest as the artifact's config, reads every blob back and verifies it, and only
then pushes the artifact manifest (``store.oci.artifact``): a published artifact never names a
missing or mangled blob. ``open_artifact`` resolves ``oci://HOST/REPO@sha256:<artifact>`` to
the cubinstore manifest, each step verified by digest, and makes the store able to reach the
registry for the kernels' blobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cubinstore._core import knobs
from cubinstore._core.digest import Digest, verify
from cubinstore._core.log import get_logger
from cubinstore._release.prefetch import blob_names, run_each
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    IntegrityError,
    ManifestError,
    MissingBlobError,
    RemoteUnavailableError,
)
from cubinstore.manifest import Manifest
from cubinstore.store import Store
from cubinstore.store.oci.artifact import (
    MANIFEST_MEDIA_TYPE,
    MAX_ARTIFACT_BYTES,
    RELEASE_ARTIFACT,
    Artifact,
    Descriptor,
    build_artifact,
    parse_artifact,
    release_layer,
)
from cubinstore.store.oci.layout import OciLayout, parse_layout_ref
from cubinstore.store.oci.reference import LAYOUT_SCHEME, RegistryRef
from cubinstore.store.oci.remote import OciLayer

if TYPE_CHECKING:
    from cubinstore._release.publish import Published

__all__ = ["open_artifact", "publish_channel", "push_release", "reach", "release_artifact"]

_log = get_logger(__name__)

Progress = Callable[[int, int, int], None]


def release_artifact(manifest: Manifest) -> bytes:
    """The artifact manifest of ``manifest``'s release: a function of the manifest alone."""
    bundles = {t.bundle for t in manifest.jit_templates.values()}
    layers = [release_layer(digest, size, manifest.ids_of(digest), digest in bundles) for digest, size in manifest.blobs]
    config = Descriptor(MANIFEST_MEDIA_TYPE, manifest.digest, len(manifest.raw), {})
    return build_artifact(config, layers, RELEASE_ARTIFACT)


def push_release(result: Published, manifest: Manifest, sources: Store, to: str, *, jobs: int,
                 progress: Progress | None = None, extra: Sequence[tuple[Digest, bytes, str]] = ()) -> OciLayer:
    """Push ``manifest``'s release to ``to`` (``oci://HOST/REPO[:TAG]``), filling ``result``.

    ``extra`` blobs (digest, bytes, what) go up with the closure (a channel's record and
    signature). A blob that fails to go up or to read back is one line of ``result.problems``,
    and then no artifact manifest is pushed."""
    target = RegistryRef.parse(to, what="--to")
    if target.digest is not None:
        raise BadArgumentError(f"--to {target}: name a repository (and a tag), not a digest: the artifact's "
                               "digest is what publish prints")
    registry = OciLayer(target, push=True)
    result.url = target.base
    blobs: list[tuple[Digest, int]] = [*manifest.blobs, (manifest.digest, len(manifest.raw))]
    known = {manifest.digest: manifest.raw, **{d: data for d, data, _ in extra}}
    blobs += [(d, len(data)) for d, data, _ in extra if (d, len(data)) not in blobs]
    names = {d: what for d, _, what in extra} | {manifest.digest: f"manifest {manifest.digest}"}

    def name(digest: Digest) -> str:
        return names.get(digest) or blob_names(manifest, digest)

    # HEAD first: only what the registry lacks goes up (a re-run resumes an interrupted push).
    present = run_each(blobs, lambda b: int(registry.has(b[0], b[1])), jobs=jobs)
    failures = [f"{b[0]} ({name(b[0])}): {r}" for b, r in zip(blobs, present) if isinstance(r, CubinstoreError)]
    missing = [b for b, r in zip(blobs, present) if r == 0]
    result.present = sum(1 for r in present if r == 1)

    def upload(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        data = known.get(digest)
        data = data if data is not None else sources.get(digest, size, name=name(digest))
        registry.put(digest, data)
        return size

    uploads = run_each(missing, upload, jobs=jobs, progress=progress)
    failures += [str(r) for r in uploads if isinstance(r, CubinstoreError)]
    result.uploaded = sum(1 for r in uploads if not isinstance(r, CubinstoreError))
    failed = {b for b, r in zip(missing, uploads) if isinstance(r, CubinstoreError)}
    failed.update(b for b, r in zip(blobs, present) if isinstance(r, CubinstoreError))

    # The registry may have accepted bytes it did not keep or mangled: every blob is read back.
    def check(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        try:
            data = registry.read(digest, size)
            if data is None:
                raise MissingBlobError(f"{digest} ({name(digest)}) is missing from {registry.url} after upload")
            verify(data, digest, size, where=registry.blob_url(digest), name=name(digest))
        except MissingBlobError:
            raise
        except CubinstoreError as exc:
            raise IntegrityError(f"{digest} ({name(digest)}) failed re-verification at {registry.url}: {exc}") from None
        return size

    checked = [b for b in blobs if b not in failed]  # one line per blob: a failed upload is not read back
    failures += [str(r) for r in run_each(checked, check, jobs=jobs) if isinstance(r, CubinstoreError)]
    if failures:
        result.problems = [*failures, f"publish {manifest.digest} to {registry.url}: {len(failures)} problems; "
                                      "artifact manifest not pushed"]
        return registry
    raw = release_artifact(manifest)
    digest = Digest.of(raw)
    registry.put_manifest(target.tag or digest, raw)
    back = registry.get_manifest(digest)
    if back is None or back[1] != raw:
        result.problems.append(f"artifact {registry.url}@{digest} does not read back as pushed")
        return registry
    result.artifact = digest
    result.tag = target.tag
    return registry


# -- opening ------------------------------------------------------------------------------------------

Source = OciLayer | OciLayout


def reach(store: Store, source: Source) -> Source:
    """The layer of ``store`` that reads ``source`` (a registry repository, an OCI layout), added as
    its last layer when it has none: the kernels of a release opened from a registry are fetched
    from it (after every layer the store already had, mirrors included). Every byte it serves is
    verified as any remote's is, so widening the store changes where bytes may come from, never
    what is accepted. With ``CUBINSTORE_OFFLINE`` no registry is added."""
    for layer in store.layers:
        if isinstance(layer, (OciLayer, OciLayout)) and layer.url == source.url:
            return layer
    if isinstance(source, OciLayout) or not knobs.offline():
        store.layers = (*store.layers, source)
    return source


def _artifact_bytes(store: Store, source: Source, digest: Digest, where: str) -> bytes:
    """The artifact manifest ``digest``: this host's verified copy, else from each registry layer of
    ``store`` with the same repository (mirrors, in order), then ``source`` itself."""
    local = store.local
    if local is not None:
        try:
            raw = local.read_entry(digest, MAX_ARTIFACT_BYTES)
        except CubinstoreError:
            raw = None
        if raw is not None and len(raw) <= MAX_ARTIFACT_BYTES and Digest.of(raw) == digest:
            return raw
    if knobs.offline() and isinstance(source, OciLayer):
        raise MissingBlobError(f"artifact {where} is not in the local store and CUBINSTORE_OFFLINE is set")
    candidates: list[Source] = []
    if isinstance(source, OciLayer):
        candidates = [layer for layer in store.layers if isinstance(layer, OciLayer)
                      and layer.ref.repository == source.ref.repository]
    if all(layer.url != source.url for layer in candidates):
        candidates.append(source)
    outcomes: list[str] = []
    kinds: set[type[CubinstoreError]] = set()
    for layer in candidates:
        try:
            found = layer.get_manifest(digest)
        except CubinstoreError as exc:
            outcomes.append(f"{layer.name}: {exc}")
            kinds.add(type(exc))
            continue
        if found is None:
            outcomes.append(f"{layer.name}: miss")
            continue
        return found[1]
    message = f"artifact {where} not available: {'; '.join(outcomes)}"
    if any(issubclass(k, IntegrityError) for k in kinds):
        raise IntegrityError(message)
    if any(issubclass(k, RemoteUnavailableError) for k in kinds):
        raise RemoteUnavailableError(message)
    raise MissingBlobError(message)


def open_artifact(ref: str, store: Store) -> Manifest:
    """The cubinstore manifest of the release artifact ``ref`` (``oci://HOST/REPO@sha256:<hex>``,
    ``oci-layout:DIR@sha256:<hex>``, or ``:TAG`` instead of the digest, whose resolution is logged
    as a warning: a tag can move), everything verified: the artifact's bytes by its digest, its
    type, the config (the manifest) by digest, size and schema, and that its layers list every
    blob of the closure. ``store`` can reach the source afterwards (``reach``)."""
    if ref.startswith(LAYOUT_SCHEME):
        root, digest, tag = parse_layout_ref(ref)
        source: Source = OciLayout(root)
    else:
        target = RegistryRef.parse(ref, what="release reference")
        digest, tag = target.digest, target.tag
        source = OciLayer(target.base)
    if digest is None and tag is None:
        raise BadArgumentError(f"release reference {ref}: name the artifact: {source.url}@sha256:<artifact "
                               "digest> (what publish printed), or a channel")
    source = reach(store, source)
    if digest is not None:
        raw = _artifact_bytes(store, source, digest, f"{source.url}@{digest}")
    else:
        found = source.get_manifest(str(tag))
        if found is None:
            raise MissingBlobError(f"release reference {ref}: no tag {tag!r} in {source.url}")
        digest, raw = found
        _log.warning("%s resolved to %s@%s; a tag can move: pin the digest, or publish a signed channel",
                     ref, source.url, digest)
    artifact = parse_artifact(raw, digest, source.url, artifact_type=RELEASE_ARTIFACT, config_type=MANIFEST_MEDIA_TYPE)
    at = f"{source.url}@{digest}"
    manifest = _config_manifest(store, artifact, at)
    _check_layers(artifact, manifest, at)
    local = store.local
    if local is not None:
        try:  # so that the same reference opens offline; verified bytes only
            local.write(digest, artifact.raw)
            local.write(manifest.digest, manifest.raw)
        except CubinstoreError as exc:
            _log.warning("cannot keep artifact %s in %s: %s", at, local.root, exc)
    return manifest


def _config_manifest(store: Store, artifact: Artifact, at: str) -> Manifest:
    config = artifact.config
    source = f"config {config.digest} of artifact {at}"
    # Not kept in any layer until it parses as a manifest: Store.get would keep any bytes that hash right.
    raw = Store(store.layers, backfill=False).get(config.digest, config.size or None, name=source)
    try:
        return Manifest.from_bytes(raw, source=source)
    except ManifestError as exc:
        raise IntegrityError(f"{source} is not a cubinstore manifest: {exc}") from None


def _check_layers(artifact: Artifact, manifest: Manifest, at: str) -> None:
    """Every blob of the closure must be a layer (what ``skopeo copy`` carries), at its size."""
    layers = {(d.digest, d.size) for d in artifact.layers}
    lacking = [(d, s) for d, s in manifest.blobs if (d, s) not in layers]
    if lacking:
        digest, size = lacking[0]
        raise IntegrityError(f"artifact {at} lacks {len(lacking)} blob(s) of its manifest {manifest.digest}, "
                             f"first {digest} ({size} bytes, {blob_names(manifest, digest)})")


def publish_channel(registry: OciLayer, sources: Store, name: str, pointer: Digest, record: Digest) -> str | None:
    """Push channel ``name``'s record and signature as blobs (each read back), then point the tag
    ``channel-NAME`` at an artifact naming them; the problem, if any. Readers trust none of it
    but the signature (``trust.channel``)."""
    from cubinstore.store.oci.artifact import channel_artifact, channel_tag

    sizes: dict[Digest, int] = {}
    for digest, what in ((record, "release record"), (pointer, "signature")):
        label = f"{what} of channel {name}"
        try:
            data = sources.get(digest, name=label)
            if not registry.has(digest, len(data)):
                registry.put(digest, data)
            back = registry.read(digest, len(data))
            if back is None:
                return f"{digest} ({label}) is missing from {registry.url} after upload"
            verify(back, digest, len(data), where=registry.blob_url(digest), name=label)
        except CubinstoreError as exc:
            return f"{digest} ({label}) failed to publish to {registry.url}: {exc}"
        sizes[digest] = len(data)
    raw = channel_artifact(name, pointer, sizes[pointer], record, sizes[record])
    tag = channel_tag(name)
    try:
        registry.put_manifest(tag, raw)
        back = registry.get_manifest(tag)
    except CubinstoreError as exc:
        return f"channel pointer {registry.url}:{tag}: {exc}"
    if back is None or back[1] != raw:
        return f"channel pointer {registry.url}:{tag} does not read back as pushed"
    return None
