"""THE map from a remote URL to its store layer: ``http(s)://`` an ``HttpLayer`` (Bazel's HTTP cache
protocol), ``oci://`` (``oci+http://``, ``oci+https://``) an ``OciLayer`` (a registry repository),
``oci-layout:DIR`` an ``OciLayout`` (the directory ``skopeo copy ... oci:DIR`` writes).

``Store.from_env``, ``--remote`` and ``publish --from`` all build remotes here, so a URL means
the same wherever it is typed. Each backend is imported only when a URL of its kind appears.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cubinstore.store.oci.reference import LAYOUT_SCHEME, is_oci_url

if TYPE_CHECKING:
    from cubinstore.store.layer import Layer

__all__ = ["remote_layer"]


def remote_layer(url: str) -> Layer:
    """The layer that reads blobs from ``url``; ``BadArgumentError`` names a malformed one."""
    if is_oci_url(url):
        from cubinstore.store.oci.remote import OciLayer

        return OciLayer(url)
    if url.startswith(LAYOUT_SCHEME):
        from cubinstore.store.oci.layout import OciLayout, parse_layout_ref

        return OciLayout(parse_layout_ref(url)[0])
    from cubinstore.store.http import HttpLayer

    return HttpLayer(url)
