"""Channel documents (signature, record) are read no further than ``MAX_SMALL_BLOB`` bytes from
every layer, the local ones included: a Bazel disk cache or a build tree holding a huge blob
under the digest a channel names is refused without reading it. Bytes read are counted by the
kernel (``/proc/self/io``), not by wrapping the store."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
from helpers.blobs import disk_cache_with

from cubinstore import Digest, MissingBlobError, Store, TrustError
from cubinstore.store import DirectorySource, LocalLayer
from cubinstore.trust.channel import resolve_channel, write_state
from cubinstore.trust.records import MAX_SMALL_BLOB, ChannelState, TrustPolicy, key_id
from cubinstore.trust.sign import generate_key, sign_release

pytestmark = [
    pytest.mark.usefixtures("clean_env"),
    pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read with Linux's /proc/self/io"),
]

HUGE = 16 * 1024 * 1024


def bytes_read() -> int:
    """Bytes this process has read (``rchar``: every read(2), cached or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def huge_blob() -> tuple[Digest, bytes]:
    data = os.urandom(65536) * (HUGE // 65536)
    return Digest.of(data), data


def new_key(directory: Path) -> tuple[Path, TrustPolicy, str]:
    """(private key path, a policy trusting it for channel prod, its key id)."""
    pem, public = generate_key()
    key = directory / "ci.pem"
    key.write_bytes(pem)
    key.chmod(0o600)
    policy = directory / "policy.json"
    policy.write_text(json.dumps({"schema": "cubinstore/trust/v1", "channels": {"prod": {"keys": [public]}},
                                  "revoked": []}))
    return key, TrustPolicy.load(policy), key_id(base64.b64decode(public.split(":", 1)[1]))


def host_accepted(root: Path, kid: str, signature: Digest) -> LocalLayer:
    """A host whose last accepted release of prod is ``signature`` (its blob not in its store)."""
    local = LocalLayer(root)
    write_state(local, ChannelState("prod", {}).with_release(kid, 1, signature))
    return local


def test_a_huge_signature_in_a_disk_cache_is_refused_without_reading_it(tmp_path: Path) -> None:
    _key, policy, kid = new_key(tmp_path)
    digest, data = huge_blob()
    cache = disk_cache_with(tmp_path / "disk-cache", [(digest, data)])
    host = host_accepted(tmp_path / "host", kid, digest)
    before = bytes_read()
    with pytest.raises(TrustError) as info:
        resolve_channel("prod", Store([host, cache]), policy)
    assert bytes_read() - before < HUGE // 16
    expected = (f"signature named by the release {host.root} accepted last: {digest} not available as a document "
                f"of at most {MAX_SMALL_BLOB} bytes: ")
    assert str(info.value).startswith(expected), str(info.value)
    assert re.search(rf"disk cache {re.escape(str(cache.root))}: more than {MAX_SMALL_BLOB} bytes", str(info.value))


def test_a_build_tree_never_hashes_a_huge_file_for_a_channel_and_still_serves_a_small_one(tmp_path: Path) -> None:
    key, policy, kid = new_key(tmp_path)
    tree = tmp_path / "bazel-bin"
    tree.mkdir()
    digest, data = huge_blob()
    (tree / "huge.sources.json").write_bytes(data)  # a name the build tree reads
    host = host_accepted(tmp_path / "host", kid, digest)
    before = bytes_read()
    with pytest.raises(MissingBlobError) as info:
        resolve_channel("prod", Store([host, DirectorySource(tree)]), policy)
    assert bytes_read() - before < HUGE // 16
    assert str(info.value).startswith(f"signature named by the release {host.root} accepted last: {digest} not "
                                      f"available as a document of at most {MAX_SMALL_BLOB} bytes: "), str(info.value)

    # Documents of any size up to the limit are still found there.
    ci = LocalLayer(tmp_path / "ci")
    record, signature = sign_release(ci, Digest.of(b"release 1"), key, "prod", 1, 3600)
    (tree / "record.sources.json").write_bytes(record.raw)
    (tree / "signature.sources.json").write_bytes(signature.raw)
    other = host_accepted(tmp_path / "other-host", kid, signature.digest)
    assert resolve_channel("prod", Store([other, DirectorySource(tree)]), policy) == Digest.of(b"release 1")
