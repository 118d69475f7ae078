"""THE manifest-reference resolver: a path, ``sha256:<hex>``, ``channel:NAME``, a release artifact in
an OCI registry (``oci://HOST/REPO@sha256:<hex>``), a `Manifest` or a `Digest`.

``cubinstore.open`` and every CLI command that takes a manifest resolve it here, so that a
reference means the same thing wherever it is typed. (``Manifest.load`` sits below the store
and the trust layer, so it keeps its own narrower form: a path or a digest.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError
from cubinstore.manifest import Manifest

if TYPE_CHECKING:
    from cubinstore.store import Store
    from cubinstore.trust.records import TrustPolicy

__all__ = ["CHANNEL_PREFIX", "DIGEST_PREFIX", "OCI_PREFIXES", "build_trees", "is_path", "load_manifest", "with_build_trees"]

DIGEST_PREFIX = "sha256:"
CHANNEL_PREFIX = "channel:"
# A registry reference (cubinstore.store.oci.reference.SCHEMES, spelled here so that resolving a
# path never imports the store).
OCI_PREFIXES = ("oci://", "oci+http://", "oci+https://", "oci-layout:")

ManifestRef = str | os.PathLike[str] | Manifest | Digest


def is_path(ref: object) -> bool:
    """Whether ``ref`` names a manifest file (not a digest, a channel or a `Manifest`)."""
    if isinstance(ref, str):
        return not ref.startswith((DIGEST_PREFIX, CHANNEL_PREFIX, *OCI_PREFIXES))
    return isinstance(ref, os.PathLike)


def load_manifest(ref: ManifestRef, store: Store | None = None, *,
                  policy: TrustPolicy | str | Path | None = None) -> Manifest:
    """The manifest ``ref`` names.

    - a `Manifest`: itself;
    - a `Digest` or ``sha256:<hex>``: the blob fetched (verified) through ``store``;
    - ``channel:NAME``: the newest release of that channel signed by a key ``policy``
      (default ``CUBINSTORE_TRUST_POLICY``) allows, fetched through ``store``;
    - ``oci://HOST[:PORT]/REPO@sha256:<hex>``: the release artifact of that digest (its config is
      the manifest), every step verified; ``store`` then reaches that registry for the kernels
      (``_release.oci.open_artifact``). ``:TAG`` instead of the digest resolves the tag and logs
      the digest it named (a tag can move: pin the digest, or use a signed channel);
    - a path: the file, which must be a regular file (a FIFO or a device is refused at once,
      never read into a hang).

    ``store`` defaults to ``cubinstore.store.default_store()``, built only when a digest or a
    channel needs it.
    """
    if isinstance(ref, Manifest):
        return ref
    if isinstance(ref, Digest) or (isinstance(ref, str) and ref.startswith(DIGEST_PREFIX)):
        return Manifest.from_digest(ref, store if store is not None else _default_store())
    if isinstance(ref, str) and ref.startswith(CHANNEL_PREFIX):
        # A signed release; imported here so that a path or a digest never loads the trust code.
        from cubinstore.trust.channel import resolve_channel

        store = store if store is not None else _default_store()
        return Manifest.from_digest(resolve_channel(ref, store, policy), store)
    if isinstance(ref, str) and ref.startswith(OCI_PREFIXES):
        from cubinstore._release.oci import open_artifact

        return open_artifact(ref, store if store is not None else _default_store())
    if isinstance(ref, (str, os.PathLike)):
        return Manifest.from_path(os.fspath(ref))  # non-blocking open, regular files only
    raise BadArgumentError(f"manifest: expected a path, a Manifest or 'sha256:<hex>', got {show(ref)}")


def build_trees(ref: str) -> list[Path]:
    """The build trees a manifest path lies in: a ``bazel-bin`` above it, or ``bazel-out/<config>/bin``
    (the same tree reached by its real path). A digest or a channel names none."""
    if ref.startswith((DIGEST_PREFIX, CHANNEL_PREFIX, *OCI_PREFIXES)):
        return []
    path = Path(os.path.abspath(ref))
    return [parent for parent in path.parents
            if parent.name == "bazel-bin" or (parent.name == "bin" and parent.parent.parent.name == "bazel-out")]


def with_build_trees(store: Store, ref: str) -> Store:
    """``store`` with the build tree of the manifest path ``ref`` searched after its local layers
    (memory, local store, disk cache) and before any remote. Whatever a build tree holds is
    verified like any layer's bytes (size, then sha256)."""
    from cubinstore.store import (
        DirectorySource,
        DiskCacheLayer,
        LocalLayer,
        MemoryLayer,
        Store,
    )

    trees = [DirectorySource(tree) for tree in build_trees(ref) if tree.is_dir()]
    if not trees:
        return store
    layers = list(store.layers)
    at = next((i for i, layer in enumerate(layers) if not isinstance(layer, (MemoryLayer, LocalLayer, DiskCacheLayer))),
              len(layers))
    return Store([*layers[:at], *trees, *layers[at:]], strict=store.strict, backfill=store.backfill)


def _default_store() -> Store:
    from cubinstore.store import (
        default_store,  # the store package is heavier than a path needs
    )

    return default_store()
