"""Signed channels over a registry: `publish channel:NAME --to oci://...` tags `channel-NAME`, and
`channel:NAME` with an `oci://` remote keeps every guarantee of the HTTP path: a registry serving
another channel's tag, an old tag or a forged pointer is refused as a bad HTTP pointer is."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

import cubinstore
from cubinstore import Digest, ExpiredReleaseError, RollbackError, TrustError
from cubinstore.store import LocalLayer, Store
from cubinstore.store.oci.artifact import channel_artifact, channel_tag
from cubinstore.store.oci.remote import OciLayer
from cubinstore.trust.channel import resolve_channel
from cubinstore.trust.records import SignatureBlob, TrustPolicy, key_id
from cubinstore.trust.sign import generate_key

pytestmark = pytest.mark.usefixtures("clean_env")


def new_key(directory: Path, name: str) -> tuple[Path, str, str]:
    pem, public = generate_key()
    path = directory / f"{name}.pem"
    path.write_bytes(pem)
    path.chmod(0o600)
    return path, public, key_id(base64.b64decode(public.split(":", 1)[1]))


def write_policy(path: Path, channels: dict[str, list[str]]) -> TrustPolicy:
    path.write_text(json.dumps({"schema": "cubinstore/trust/v1", "channels": {c: {"keys": k} for c, k in channels.items()},
                                "revoked": []}))
    return TrustPolicy.load(path)


class Site:
    """A CI host that signs and publishes to a registry repository production reads."""

    def __init__(self, tmp: Path, registry, make_release, cli, cli_env) -> None:
        self.tmp, self.make_release, self.cli = tmp, make_release, cli
        self.repo = registry.repo()
        self.ci_env = dict(cli_env, CUBINSTORE_HOME=str(tmp / "ci-home"))
        self.keys = tmp / "keys"
        self.keys.mkdir()
        self.registry = OciLayer(self.repo + ":x", push=True)

    def release(self, version: int, key: Path, channel: str = "prod", expires_in: str = "7d"):
        release = self.make_release(n=2)
        local = LocalLayer(self.tmp / "ci-home")
        for hex_, data in release.blobs.items():
            local.write(Digest(hex_), data)
        out = self.cli(["sign", str(release.path), "--key", str(key), "--channel", channel, "--version", str(version),
                        "--expires-in", expires_in], self.ci_env)
        assert out.returncode == 0, out.stderr
        out = self.cli(["publish", f"channel:{channel}", "--to", self.repo], self.ci_env)
        assert out.returncode == 0, out.stderr
        assert f"and channel {channel} (sha256:" in out.stdout
        return release

    def tag(self, channel: str = "prod") -> bytes:
        found = self.registry.get_manifest(channel_tag(channel))
        assert found is not None
        return found[1]

    def set_tag(self, raw: bytes, channel: str = "prod") -> None:
        self.registry.put_manifest(channel_tag(channel), raw)

    def production(self, name: str = "prod-host") -> Store:
        return Store([LocalLayer(self.tmp / name), OciLayer(self.repo)])


@pytest.fixture
def site(tmp_path: Path, registry, make_release, cli, cli_env) -> Site:
    return Site(tmp_path, registry, make_release, cli, cli_env)


def test_a_signed_release_opens_by_channel_name_from_a_registry(site: Site, monkeypatch: pytest.MonkeyPatch,
                                                                cli, cli_env) -> None:
    key, public, kid = new_key(site.keys, "ci")
    policy_path = site.tmp / "policy.json"
    write_policy(policy_path, {"prod": [public]})
    release = site.release(1, key)
    monkeypatch.setenv("CUBINSTORE_TRUST_POLICY", str(policy_path))
    monkeypatch.setenv("CUBINSTORE_REMOTE", site.repo)
    monkeypatch.setenv("CUBINSTORE_HOME", str(site.tmp / "prod-host"))
    assert str(cubinstore.open("channel:prod").manifest.digest) == release.digest
    env = dict(cli_env, CUBINSTORE_HOME=str(site.tmp / "cli-host"), CUBINSTORE_REMOTE=site.repo)
    out = cli(["prefetch", "channel:prod", "--policy", str(policy_path)], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"prefetched {release.digest}: 2 blobs, 2 downloaded")
    doc = json.loads(site.tag())
    signature = SignatureBlob.from_bytes(site.production().get(Digest.parse(doc["config"]["digest"])), source="t")
    assert signature.key == kid


def test_an_old_tag_is_refused_as_a_rollback(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = write_policy(site.tmp / "policy.json", {"prod": [public]})
    site.release(1, key)
    old = site.tag()
    newer = site.release(2, key)
    assert str(resolve_channel("prod", site.production(), policy)) == newer.digest
    site.set_tag(old)  # the registry (or a mirror) replays version 1
    with pytest.raises(RollbackError, match=rf"^channel:prod: {site.repo}:channel-prod offers version 1, but this "
                                            r"host already accepted version 2"):
        resolve_channel("prod", site.production(), policy)


def test_another_channels_tag_and_forged_pointers_are_refused(site: Site) -> None:
    key, public, kid = new_key(site.keys, "ci")
    policy = write_policy(site.tmp / "policy.json", {"prod": [public], "canary": [public]})
    site.release(1, key, channel="canary")
    site.set_tag(site.tag("canary"))  # canary's pointer served under prod's tag
    with pytest.raises(TrustError, match=r"is for channel 'canary', not 'prod'"):
        resolve_channel("prod", site.production("a"), policy)
    # A forged signature, well formed, behind a well-formed pointer.
    site.release(5, key)
    doc = json.loads(site.tag())
    store = site.production("b")
    signature = SignatureBlob.from_bytes(store.get(Digest.parse(doc["config"]["digest"])), source="t")
    forged = json.loads(signature.raw)
    forged["signature"] = base64.b64encode(bytes(64)).decode()
    raw = json.dumps(forged, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    site.registry.put(Digest.of(raw), raw)
    record = Digest.parse(doc["layers"][0]["digest"])
    site.set_tag(channel_artifact("prod", Digest.of(raw), len(raw), record, doc["layers"][0]["size"]))
    with pytest.raises(TrustError, match=rf"\(channel prod, version 5\): the signature by key {kid} does not verify"):
        resolve_channel("prod", store, policy)
    # A tag that is not a channel artifact at all.
    site.set_tag(site.tag("canary").replace(b"application/vnd.cubinstore.channel.v1", b"application/vnd.example.other.v1"))
    with pytest.raises(TrustError, match=rf"^channel pointer {site.repo}:channel-prod is malformed: artifact "):
        resolve_channel("prod", site.production("c"), policy)


def test_an_expired_record_from_a_registry_is_refused(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = write_policy(site.tmp / "policy.json", {"prod": [public]})
    site.release(1, key, expires_in="1h")
    with pytest.raises(ExpiredReleaseError, match=rf"^channel:prod version 1 from {site.repo}:channel-prod expired"):
        resolve_channel("prod", site.production(), policy, now=time.time() + 7200)
