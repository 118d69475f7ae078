"""Publish a release to an HTTP CAS: upload a manifest's closure, read every blob back, then the
manifest, then (for ``channel:NAME``) the release record, its signature and the channel pointer.
To an OCI registry (``--to oci://HOST/REPO[:TAG]``) the same order holds, as one artifact
(``_release.oci``).

The order is the safety: a published manifest never references a missing blob, and a published
pointer never names a missing signature or record. Each step reads back what it wrote, because a
server may accept bytes it did not keep or mangled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cubinstore._core import knobs
from cubinstore._core.digest import Digest, verify
from cubinstore._release.prefetch import blob_names, run_each
from cubinstore._release.refs import CHANNEL_PREFIX, build_trees, load_manifest
from cubinstore.errors import BadArgumentError, CubinstoreError
from cubinstore.manifest import Manifest
from cubinstore.store import DirectorySource, DiskCacheLayer, LocalLayer, Store

if TYPE_CHECKING:
    from cubinstore.store.http import HttpLayer
    from cubinstore.store.layer import Layer

__all__ = ["Published", "publish", "publish_sources"]

Progress = Callable[[int, int, int], None]


@dataclass
class Published:
    """What a publish did: ``problems`` (one line each, in order) is empty when it all went up."""

    manifest: Manifest
    url: str
    channel: str | None = None
    pointer: Digest | None = None
    problems: list[str] = field(default_factory=list)
    #: To a registry: the artifact's digest and tag, blobs uploaded and blobs it already had.
    artifact: Digest | None = None
    tag: str | None = None
    uploaded: int | None = None
    present: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def publish_sources(ref: str, dirs: Sequence[str | Path], local: LocalLayer) -> list[Layer]:
    """Where the blobs of ``ref`` are found: the local store, ``CUBINSTORE_DISK_CACHE``, the
    directories ``dirs`` (a build tree or a Bazel disk cache each), the build tree the manifest
    path lies in, and ``./bazel-bin``; a ``dirs`` entry that is a remote URL (``http://``,
    ``oci://``) is read after them all."""
    from cubinstore.store.remotes import remote_layer

    remotes = [d for d in dirs if isinstance(d, str) and "://" in d]
    dirs = [d for d in dirs if d not in remotes]
    sources: list[Layer] = [local]
    disk_cache = knobs.disk_cache()
    if disk_cache is not None:
        sources.append(DiskCacheLayer(disk_cache))
    paths = [Path(d) for d in dirs]
    # A manifest under bazel-bin/ names its build tree; found by content, not by label.
    paths.extend(build_trees(ref))
    if Path("bazel-bin").is_dir():
        paths.append(Path("bazel-bin"))
    unique: dict[str, Path] = {}  # one layer per directory however it was named (bazel-bin, its absolute path)
    for d in paths:
        unique.setdefault(os.path.abspath(d), d)
    for directory in unique.values():
        if not directory.is_dir():
            raise BadArgumentError(f"--from {directory}: not a directory")
        sources.append(DiskCacheLayer(directory) if (directory / "cas").is_dir() else DirectorySource(directory))
    sources.extend(remote_layer(url) for url in remotes)
    return sources


def publish(ref: str, to: str, dirs: Sequence[str | Path] = (), *, local: LocalLayer | None = None,
            jobs: int | None = None, progress: Progress | None = None) -> Published:
    """Publish the release ``ref`` (a manifest path, ``sha256:``, or ``channel:NAME``: the release
    signed here last) to the HTTP CAS ``to``, or as an artifact to the registry repository ``to``
    (``oci://HOST[:PORT]/REPO[:TAG]``), from the sources `publish_sources` names.

    Raises for a bad URL or directory, or a manifest that cannot be read; a blob that fails to go
    up, or to read back, is one line of ``problems`` (and then the manifest is not uploaded).
    """
    from cubinstore.store.http import HttpLayer
    from cubinstore.store.oci.reference import is_oci_url

    remote = None if is_oci_url(to) else HttpLayer(to)
    local = local if local is not None else LocalLayer(knobs.home())
    sources = Store(publish_sources(ref, dirs, local), backfill=False)
    jobs = knobs.fetch_jobs() if jobs is None else jobs
    channel = None
    if ref.startswith(CHANNEL_PREFIX):
        *channel, manifest_digest = _channel_release(ref, sources, local)
        manifest = Manifest.from_digest(manifest_digest, sources)
    else:
        manifest = load_manifest(ref, sources)
    if remote is None:
        from cubinstore._release.oci import push_release

        result = Published(manifest, to)
        registry = push_release(result, manifest, sources, to, jobs=jobs, progress=progress)
        if channel is not None and result.ok:
            from cubinstore._release.oci import publish_channel

            name, pointer, record = channel
            result.channel, result.pointer = name, pointer
            failure = publish_channel(registry, sources, name, pointer, record)
            if failure:
                result.problems.append(failure)
        return result
    result = Published(manifest, remote.url)
    blobs = list(manifest.blobs)

    def upload(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        remote.put(digest, sources.get(digest, size, name=blob_names(manifest, digest)))
        return size

    # `jobs` uploads at once, each over a kept-alive connection.
    results = run_each(blobs, upload, jobs=jobs, progress=progress)
    failures = [str(r) for r in results if isinstance(r, CubinstoreError)]
    uploaded = [blob for blob, r in zip(blobs, results) if not isinstance(r, CubinstoreError)]

    # The server may have accepted bytes it did not keep or mangled: read every blob back.
    def check(blob: tuple[Digest, int]) -> int:
        failure = _check_remote(remote, blob[0], blob[1], blob_names(manifest, blob[0]))
        if failure:
            raise CubinstoreError(failure)
        return blob[1]

    failures += [str(r) for r in run_each(uploaded, check, jobs=jobs) if isinstance(r, CubinstoreError)]
    if failures:
        result.problems = [*failures, f"publish {manifest.digest} to {remote.url}: {len(failures)} problems; "
                                      "manifest not uploaded"]
        return result
    # The manifest goes last so a published manifest never references a missing blob.
    remote.put(manifest.digest, manifest.raw)
    failure = _check_remote(remote, manifest.digest, len(manifest.raw), "manifest")
    if failure:
        result.problems.append(failure)
        return result
    if channel is not None:
        name, pointer, record = channel
        result.channel, result.pointer = name, pointer
        failure = _publish_channel(remote, sources, name, pointer, record)
        if failure:
            result.problems.append(failure)
    return result


def _channel_release(ref: str, sources: Store, local: LocalLayer) -> tuple[str, Digest, Digest, Digest]:
    """(channel, signature digest, record digest, manifest digest) of the release signed here last."""
    from cubinstore.trust.channel import local_pointer
    from cubinstore.trust.records import ReleaseRecord, SignatureBlob, channel_name

    name = channel_name(ref[len(CHANNEL_PREFIX):])
    pointer = local_pointer(local, name)
    if pointer is None:
        raise BadArgumentError(f"channel:{name}: nothing signed here; run `cubinstore sign MANIFEST --channel {name} ...` first")
    signature = SignatureBlob.from_bytes(sources.get(pointer, name=f"signature of channel {name}"), source=str(pointer))
    record = ReleaseRecord.from_bytes(sources.get(signature.record, name=f"record of channel {name}"), source=str(signature.record))
    return name, pointer, record.digest, record.manifest


def _publish_channel(remote: HttpLayer, sources: Store, name: str, pointer: Digest, record: Digest) -> str | None:
    """Upload the record and signature, then point ``channels/NAME`` at the signature; the problem, if any."""
    # Record and signature before the pointer, so a published pointer never names a missing blob.
    for digest, what in ((record, "release record"), (pointer, "signature")):
        data = sources.get(digest, name=f"{what} of channel {name}")
        remote.put(digest, data)
        failure = _check_remote(remote, digest, len(data), f"{what} of channel {name}")
        if failure:
            return failure
    remote.put_named(f"channels/{name}", f"{pointer}\n".encode())
    back = remote.get_named(f"channels/{name}", 4096)
    if back is None or back.strip() != str(pointer).encode():
        return f"channel pointer {remote.url}/channels/{name} reads back as {back!r}, expected {pointer}"
    return None


def _check_remote(remote: HttpLayer, digest: Digest, size: int, name: str) -> str | None:
    try:
        data = remote.read(digest, size)
        if data is None:
            return f"{digest} ({name}) is missing from {remote.url} after upload"
        verify(data, digest, size, where=remote.blob_url(digest), name=name)
    except CubinstoreError as exc:
        return f"{digest} ({name}) failed re-verification after upload: {exc}"
    return None
