"""Signed release channels: signing, publishing, resolving `channel:NAME`, rollback and freeze
protection, key rotation and revocation, against a real nginx cache."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cubinstore
from cubinstore import Digest, ExpiredReleaseError, Manifest, RollbackError, Store, TrustError
from cubinstore.trust.channel import resolve_channel
from cubinstore.trust.records import SignatureBlob, TrustPolicy, key_id
from cubinstore.trust.sign import generate_key, sign_release
from cubinstore.store import HttpLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]


def new_key(directory: Path, name: str) -> tuple[Path, str, str]:
    """(private key path, public key line, key id)."""
    pem, public = generate_key()
    path = directory / f"{name}.pem"
    path.write_bytes(pem)
    path.chmod(0o600)  # as `cubinstore keygen` writes it: `sign` refuses a key others can read
    return path, public, key_id(base64.b64decode(public.split(":", 1)[1]))


def write_policy(path: Path, channels: dict[str, list[str]], revoked: list[str] = ()) -> Path:
    doc = {"schema": "cubinstore/trust/v1", "channels": {c: {"keys": k} for c, k in channels.items()},
           "revoked": list(revoked)}
    path.write_text(json.dumps(doc))
    return path


class Site:
    """A CI host (signs and publishes into its own home) and an nginx cache production reads."""

    def __init__(self, tmp_path: Path, nginx, make_release, cli, cli_env) -> None:
        self.tmp, self.nginx, self.make_release, self.cli = tmp_path, nginx, make_release, cli
        self.url = nginx.base()
        self.ci_env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "ci-home"))
        self.keys = tmp_path / "keys"
        self.keys.mkdir()

    def release(self, version: int, key: Path, channel: str = "prod", expires_in: str = "7d"):
        release = self.make_release(n=2)
        local = LocalLayer(self.tmp / "ci-home")
        for hex_, data in release.blobs.items():
            local.write(Digest(hex_), data)
        out = self.cli(["sign", str(release.path), "--key", str(key), "--channel", channel, "--version", str(version),
                        "--expires-in", expires_in], self.ci_env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"signed channel {channel} version {version}: manifest {release.digest}")
        out = self.cli(["publish", f"channel:{channel}", "--to", self.url], self.ci_env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"published channel {channel} (sha256:")
        return release

    def pointer(self, channel: str = "prod") -> bytes:
        return HttpLayer(self.url).get_named(f"channels/{channel}", 4096) or b""

    def set_pointer(self, data: bytes, channel: str = "prod") -> None:
        HttpLayer(self.url).put_named(f"channels/{channel}", data)

    def production(self, name: str = "prod-host") -> Store:
        return Store([LocalLayer(self.tmp / name), HttpLayer(self.url)])


@pytest.fixture
def site(tmp_path: Path, nginx, make_release, cli, cli_env) -> Site:
    return Site(tmp_path, nginx, make_release, cli, cli_env)


def test_a_signed_release_opens_by_channel_name_on_another_host(site: Site, monkeypatch: pytest.MonkeyPatch,
                                                               cli, cli_env) -> None:
    key, public, kid = new_key(site.keys, "ci")
    policy = write_policy(site.tmp / "policy.json", {"prod": [public]})
    release = site.release(1, key)
    monkeypatch.setenv("CUBINSTORE_TRUST_POLICY", str(policy))
    monkeypatch.setenv("CUBINSTORE_REMOTE", site.url)
    monkeypatch.setenv("CUBINSTORE_HOME", str(site.tmp / "prod-host"))
    lib = cubinstore.open("channel:prod")
    assert str(lib.manifest.digest) == release.digest
    # The CLI resolves the same way and fills the local store.
    env = dict(cli_env, CUBINSTORE_HOME=str(site.tmp / "cli-host"), CUBINSTORE_REMOTE=site.url)
    out = cli(["prefetch", "channel:prod", "--policy", str(policy)], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"prefetched {release.digest}: 2 blobs, 2 downloaded")
    # The record names the signer, and the pointer is the signature blob's digest.
    signature = SignatureBlob.from_bytes(site.production().get(Digest.parse(site.pointer().decode().strip())),
                                         source="test")
    assert signature.key == kid


def test_an_old_validly_signed_record_is_refused_as_a_rollback(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = TrustPolicy.load(write_policy(site.tmp / "policy.json", {"prod": [public]}))
    site.release(1, key)
    old_pointer = site.pointer()
    newer = site.release(2, key)
    store = site.production()
    assert str(resolve_channel("channel:prod", store, policy)) == newer.digest
    site.set_pointer(old_pointer)  # a malicious or stale mirror replays version 1
    with pytest.raises(RollbackError, match=r"^channel:prod: http://.*/channels/prod offers version 1, but this host "
                                            r"already accepted version 2 \(sha256:\w+\); refusing a rollback"):
        resolve_channel("channel:prod", site.production(), policy)


def test_an_expired_record_is_refused_as_stale(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = TrustPolicy.load(write_policy(site.tmp / "policy.json", {"prod": [public]}))
    release = site.release(1, key, expires_in="1h")
    assert str(resolve_channel("prod", site.production(), policy)) == release.digest
    later = time.time() + 2 * 3600  # the signer stopped refreshing the channel: a freeze
    with pytest.raises(ExpiredReleaseError, match=r"^channel:prod version 1 from http://.* expired at \d{4}-\d\d-\d\dT"):
        resolve_channel("prod", site.production(), policy, now=later)
    with pytest.raises(ExpiredReleaseError):  # a fresh host refuses it too
        resolve_channel("prod", site.production("fresh-host"), policy, now=later)


def test_a_remembered_release_serves_offline_until_it_expires(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = TrustPolicy.load(write_policy(site.tmp / "policy.json", {"prod": [public]}))
    release = site.release(3, key, expires_in="1h")
    assert str(resolve_channel("prod", site.production(), policy)) == release.digest
    offline = Store([LocalLayer(site.tmp / "prod-host")])
    assert str(resolve_channel("prod", offline, policy)) == release.digest
    with pytest.raises(ExpiredReleaseError, match=r"^channel:prod version 3 from the release .* accepted last expired"):
        resolve_channel("prod", offline, policy, now=time.time() + 7200)


def test_key_rotation_accepts_either_key_and_a_revoked_key_is_refused(site: Site) -> None:
    old_key, old_public, old_id = new_key(site.keys, "old")
    new_key_path, new_public, _ = new_key(site.keys, "new")
    both = TrustPolicy.load(write_policy(site.tmp / "both.json", {"prod": [old_public, new_public]}))
    first = site.release(1, old_key)
    assert str(resolve_channel("prod", site.production("a"), both)) == first.digest
    second = site.release(2, new_key_path)
    assert str(resolve_channel("prod", site.production("a"), both)) == second.digest
    third = site.release(3, old_key)  # the old key was stolen and signs a release
    revoked = TrustPolicy.load(write_policy(site.tmp / "revoked.json", {"prod": [old_public, new_public]}, [old_id]))
    with pytest.raises(TrustError, match=rf"^release record sha256:\w+ \(channel prod, version 3\) is signed by key "
                                         rf"{old_id}, which .*revoked\.json revokes"):
        resolve_channel("prod", site.production("b"), revoked)
    assert third.digest != second.digest
    fourth = site.release(4, new_key_path)
    assert str(resolve_channel("prod", site.production("b"), revoked)) == fourth.digest


def test_unknown_keys_other_channels_and_altered_signatures_are_refused(site: Site) -> None:
    key, public, kid = new_key(site.keys, "ci")
    stranger, stranger_public, stranger_id = new_key(site.keys, "stranger")
    policy = TrustPolicy.load(write_policy(site.tmp / "policy.json", {"prod": [public], "canary": [stranger_public]}))
    site.release(1, stranger)
    with pytest.raises(TrustError, match=rf"is signed by key {stranger_id}, which .* does not allow for channel 'prod'"):
        resolve_channel("prod", site.production("a"), policy)
    site.release(1, stranger, channel="canary")
    site.set_pointer(site.pointer("canary"))  # canary's record served as prod's
    with pytest.raises(TrustError, match=r"is for channel 'canary', not 'prod'"):
        resolve_channel("prod", site.production("b"), policy)
    site.release(5, key)
    store = site.production("c")
    signature = SignatureBlob.from_bytes(store.get(Digest.parse(site.pointer().decode().strip())), source="test")
    doc = json.loads(signature.raw)
    doc["signature"] = base64.b64encode(bytes(64)).decode()  # a forged signature, well formed
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    HttpLayer(site.url).put(Digest.of(raw), raw)
    site.set_pointer(f"{Digest.of(raw)}\n".encode())
    with pytest.raises(TrustError, match=rf"\(channel prod, version 5\): the signature by key {kid} does not verify"):
        resolve_channel("prod", store, policy)


def test_a_different_release_under_an_accepted_version_is_refused_as_a_fork(site: Site) -> None:
    key, public, _ = new_key(site.keys, "ci")
    policy = TrustPolicy.load(write_policy(site.tmp / "policy.json", {"prod": [public]}))
    site.release(7, key)
    assert resolve_channel("prod", site.production(), policy)
    # The same key signs a second, different version 7 (on another CI home, as a stolen key would).
    other_home = LocalLayer(site.tmp / "other-ci")
    manifest = Manifest.from_path(site.make_release(n=1).path)
    _record, signature = sign_release(other_home, manifest.digest, key, "prod", 7, 3600)
    remote = HttpLayer(site.url)
    for digest in (signature.record, signature.digest):
        remote.put(digest, Store([other_home]).get(digest))
    site.set_pointer(f"{signature.digest}\n".encode())
    with pytest.raises(RollbackError, match=r"^channel:prod: .* offers a different release as version 7"):
        resolve_channel("prod", site.production(), policy)


def test_a_channel_without_a_trust_policy_is_refused(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBINSTORE_TRUST_POLICY", raising=False)
    with pytest.raises(TrustError, match=r"^channel:prod needs a trust policy: set CUBINSTORE_TRUST_POLICY"):
        cubinstore.open("channel:prod", site.production())


@pytest.mark.parametrize("doc, message", [
    ({"schema": "cubinstore/trust/v0", "channels": {}, "revoked": []}, "schema: expected 'cubinstore/trust/v1'"),
    ({"schema": "cubinstore/trust/v1", "channels": {"prod": {"keys": ["rsa:AAAA"]}}, "revoked": []},
     "channels.prod.keys[0]: expected 'ed25519:<base64"),
    ({"schema": "cubinstore/trust/v1", "channels": {"Prod!": {"keys": []}}, "revoked": []}, "invalid channel name"),
    ({"schema": "cubinstore/trust/v1", "channels": {}, "revoked": ["abc"]}, "revoked: expected a list of 64-hex"),
    ({"schema": "cubinstore/trust/v1", "channels": {}}, "expected keys channels, revoked, schema; missing revoked"),
])
def test_a_malformed_trust_policy_is_a_typed_error_naming_the_field(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TrustError, match=rf"^trust policy {path}: ") as info:
        TrustPolicy.load(path)
    assert message in str(info.value)


def test_sign_refuses_a_version_not_above_the_last_one_signed(site: Site, cli) -> None:
    key, _public, _ = new_key(site.keys, "ci")
    site.release(2, key)
    release = site.make_release(n=1)
    out = cli(["sign", str(release.path), "--key", str(key), "--channel", "prod", "--version", "2"], site.ci_env)
    assert out.returncode == 1
    assert "cubinstore: error: channel prod: version 2 is not above version 2" in out.stderr


def test_import_cubinstore_does_not_import_cryptography() -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import cubinstore"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "cubinstore" in imported
    assert not {m for m in imported if m.split(".")[0] == "cryptography" or m.startswith("cubinstore.trust")}, sorted(imported)
