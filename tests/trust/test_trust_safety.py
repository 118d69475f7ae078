"""Signed channels against an attacker: a remote serving huge channel documents, two processes
accepting two releases of one version at once, a stolen key's version 2^63-1, links inside
``v1/channels``, duplicate JSON keys, a private key others can read. Real HTTP servers on
loopback, real processes, real keys."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cubinstore import Digest, RollbackError, Store, TrustError
from cubinstore.trust.channel import resolve_channel
from cubinstore.trust.records import MAX_SMALL_BLOB, SignatureBlob, TrustPolicy, key_id
from cubinstore.trust.sign import generate_key, sign_release
from cubinstore.store import HttpLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]
HUGE = 32 * 1024 * 1024  # what a hostile remote offers as a channel document
TOP = 2**63 - 1


# -- a real HTTP server that serves channels, and misbehaves on purpose ----------------------------

class ChannelServer:
    """A threaded GET server on 127.0.0.1: ``files`` (path -> bytes) are served whole; ``huge``
    (path -> declare) streams HUGE bytes in 64 KiB writes, with or without a Content-Length,
    counting in ``sent`` the bytes the client let it write; a GET of a path in ``gated`` waits
    until ``gate`` (a barrier) lets it through."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.huge: dict[str, tuple[bytes, bool]] = {}
        self.gated: set[str] = set()
        self.gate = threading.Barrier(2, timeout=60)
        self.sent = 0
        self.lock = threading.Lock()
        self.done = threading.Semaphore(0)  # one release per finished huge response
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                try:
                    outer._get(self)
                except (OSError, threading.BrokenBarrierError):
                    pass  # the client hung up (the point of the huge tests), or the gate broke

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        if h.path in self.gated:
            self.gate.wait()
        if h.path in self.huge:
            chunk, declare = self.huge[h.path]
            try:
                h.send_response(200)
                if declare:
                    h.send_header("Content-Length", str(HUGE))
                h.send_header("Connection", "close")
                h.end_headers()
                view = memoryview(chunk)
                for _ in range(HUGE // len(chunk)):
                    h.wfile.write(view)
                    with self.lock:
                        self.sent += len(chunk)
            finally:
                h.close_connection = True
                self.done.release()
            return
        body = self.files.get(h.path)
        h.send_response(404 if body is None else 200)
        h.send_header("Content-Length", str(len(body or b"")))
        h.end_headers()
        h.wfile.write(body or b"")

    def publish(self, prefix: str, signature: SignatureBlob, signer_home: LocalLayer) -> None:
        """What `cubinstore publish channel:prod` puts on a remote: record, signature, pointer."""
        for digest in (signature.record, signature.digest):
            self.files[f"{prefix}/cas/{digest.hex}"] = Store([signer_home]).get(digest)
        self.files[f"{prefix}/channels/prod"] = f"{signature.digest}\n".encode()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[ChannelServer]:
    s = ChannelServer()
    yield s
    s.stop()


def new_key(directory: Path, name: str) -> tuple[Path, str, str]:
    """(private key path, mode 0600; public key line; key id)."""
    pem, public = generate_key()
    path = directory / f"{name}.pem"
    path.write_bytes(pem)
    path.chmod(0o600)
    return path, public, key_id(base64.b64decode(public.split(":", 1)[1]))


def policy_doc(channels: dict[str, dict], revoked: list[str] = ()) -> str:
    return json.dumps({"schema": "cubinstore/trust/v1", "channels": channels, "revoked": list(revoked)})


def write_policy(path: Path, keys: list[str], revoked: list[str] = (), **extra: object) -> Path:
    path.write_text(policy_doc({"prod": {"keys": keys, **extra}}, revoked))
    return path


def host(tmp_path: Path, url: str, name: str = "host") -> Store:
    return Store([LocalLayer(tmp_path / name), HttpLayer(url, retries=0)])


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


# -- 1. channel documents are read no further than 4,096 bytes, and stored only once accepted ------

@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "close-delimited"])
@pytest.mark.parametrize("document", ["pointer", "signature", "record"])
def test_a_huge_channel_document_is_refused_after_4096_bytes_and_never_stored(
        tmp_path: Path, server: ChannelServer, document: str, declare: bool) -> None:
    _key, public, kid = new_key(tmp_path, "ci")
    policy = TrustPolicy.load(write_policy(tmp_path / "policy.json", [public]))
    chunk = os.urandom(65536)
    huge = Digest.of(chunk * (HUGE // len(chunk)))  # a real blob: its bytes hash to the digest asked for
    if document == "pointer":
        server.huge["/channels/prod"] = (chunk, declare)
        expected = rf"^channel pointer {server.url}/channels/prod: more than {MAX_SMALL_BLOB} bytes, not a pointer"
    elif document == "signature":
        server.files["/channels/prod"] = f"{huge}\n".encode()
        server.huge[f"/cas/{huge.hex}"] = (chunk, declare)
        expected = (rf"^signature named by {server.url}/channels/prod: {huge} not available as a document of at "
                    rf"most {MAX_SMALL_BLOB} bytes: .*remote {server.url}: GET .*download")
    else:  # a well-formed signature (it need not verify: the record is fetched first) naming a huge record
        doc = {"algorithm": "ed25519", "key": kid, "record": str(huge), "schema": "cubinstore/signature/v1",
               "signature": base64.b64encode(bytes(64)).decode()}
        sig = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        server.files[f"/cas/{Digest.of(sig).hex}"] = sig
        server.files["/channels/prod"] = f"{Digest.of(sig)}\n".encode()
        server.huge[f"/cas/{huge.hex}"] = (chunk, declare)
        expected = rf"^release record of {server.url}/channels/prod: {huge} not available as a document of at most"
    with pytest.raises(TrustError) as info:
        resolve_channel("prod", host(tmp_path, server.url), policy)
    assert server.done.acquire(timeout=60)  # the server's response has ended (the client hung up or had it all)
    # One socket's buffers at most, not the 32 MiB offered; and nothing of it kept.
    assert server.sent < HUGE // 4, server.sent
    assert store_bytes(tmp_path / "host") < 4 * MAX_SMALL_BLOB
    assert re.match(expected, str(info.value)), str(info.value)


# -- 2. accepting a version is one compare-and-set: two processes, one version, two releases --------

CHILD = """
import json, sys
from cubinstore import CubinstoreError, Store
from cubinstore.trust.channel import resolve_channel
from cubinstore.store import HttpLayer, LocalLayer
home, url, policy = sys.argv[1:]
try:
    print(json.dumps({"ok": str(resolve_channel("prod", Store([LocalLayer(home), HttpLayer(url, retries=0)]), policy))}))
except CubinstoreError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_two_processes_offered_two_releases_of_one_version_accept_exactly_one(tmp_path: Path,
                                                                              server: ChannelServer) -> None:
    key, public, _ = new_key(tmp_path, "ci")
    policy = write_policy(tmp_path / "policy.json", [public])
    signatures = {}
    for prefix in ("/a", "/b"):  # one key, two different version 7 (a stolen copy signs the second)
        signer = LocalLayer(tmp_path / f"ci{prefix}")
        _record, signatures[prefix] = sign_release(signer, Digest.of(prefix.encode()), key, "prod", 7, 3600)
        server.publish(prefix, signatures[prefix], signer)
        # Neither process gets its record before both have asked for theirs: both have then
        # read the channel state, so each decides with the other's release not yet written.
        server.gated.add(f"{prefix}/cas/{signatures[prefix].record.hex}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "host"), server.url + prefix, str(policy)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for prefix in ("/a", "/b")]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    ok = [r for r in results if "ok" in r]
    refused = [r for r in results if "error" in r]
    assert len(ok) == 1 and len(refused) == 1, results
    assert refused[0]["error"] == "RollbackError", refused
    assert "refusing a forked channel" in refused[0]["message"]
    for signature in signatures.values():  # the fork error names both releases
        assert str(signature.digest) in refused[0]["message"]
    # The state names the winner, and the loser stays refused.
    server.gated.clear()
    winner = "/a" if ok[0]["ok"] == str(Digest.of(b"/a")) else "/b"
    loser = "/b" if winner == "/a" else "/a"
    state = json.loads((tmp_path / "host" / "v1" / "channels" / "prod.json").read_text())
    assert [e["signature"] for e in state["keys"].values()] == [str(signatures[winner].digest)]
    with pytest.raises(RollbackError, match="refusing a forked channel"):
        resolve_channel("prod", host(tmp_path, server.url + loser), TrustPolicy.load(policy))


# -- 3. a thief's version cannot lock a channel after revocation ------------------------------------

def _thief_accepted(tmp_path: Path, server: ChannelServer) -> tuple[Path, str, str, str, Path]:
    """Key A signs version 1, a thief with key B signs version 2^63-1; the host accepts both in turn."""
    key_a, public_a, _ = new_key(tmp_path, "a")
    key_b, public_b, id_b = new_key(tmp_path, "b")
    both = TrustPolicy.load(write_policy(tmp_path / "both.json", [public_a, public_b]))
    ci = LocalLayer(tmp_path / "ci")
    _r, sig = sign_release(ci, Digest.of(b"release 1"), key_a, "prod", 1, 3600)
    server.publish("", sig, ci)
    assert resolve_channel("prod", host(tmp_path, server.url), both) == Digest.of(b"release 1")
    thief = LocalLayer(tmp_path / "thief")
    _r, sig = sign_release(thief, Digest.of(b"evil"), key_b, "prod", TOP, 3600)
    server.publish("", sig, thief)
    assert resolve_channel("prod", host(tmp_path, server.url), both) == Digest.of(b"evil")
    return key_a, public_a, public_b, id_b, tmp_path / "ci"


def test_a_revoked_thief_version_no_longer_holds_the_floor(tmp_path: Path, server: ChannelServer) -> None:
    key_a, public_a, public_b, id_b, ci = _thief_accepted(tmp_path, server)
    revoked = TrustPolicy.load(write_policy(tmp_path / "revoked.json", [public_a, public_b], [id_b]))
    # The revocation alone gives the channel back: the signer's next release is accepted.
    with pytest.raises(TrustError, match=rf"is signed by key {id_b}, which .*revoked\.json revokes"):
        resolve_channel("prod", host(tmp_path, server.url), revoked)
    _r, sig = sign_release(LocalLayer(ci), Digest.of(b"release 3"), key_a, "prod", 3, 3600)
    server.publish("", sig, LocalLayer(ci))
    assert resolve_channel("prod", host(tmp_path, server.url), revoked) == Digest.of(b"release 3")
    # Rollback protection still holds under the trusted key: version 1 again is refused.
    _r, old = sign_release(LocalLayer(tmp_path / "ci-old"), Digest.of(b"release 1"), key_a, "prod", 2, 3600)
    server.publish("", old, LocalLayer(tmp_path / "ci-old"))
    with pytest.raises(RollbackError, match=r"offers version 2, but this host already accepted version 3"):
        resolve_channel("prod", host(tmp_path, server.url), revoked)


def test_a_policy_max_version_refuses_higher_records_and_lifts_a_floor_above_it(tmp_path: Path,
                                                                                 server: ChannelServer) -> None:
    key_a, public_a, public_b, _id_b, ci = _thief_accepted(tmp_path, server)
    capped = TrustPolicy.load(write_policy(tmp_path / "capped.json", [public_a, public_b], max_version=100))
    with pytest.raises(TrustError, match=r"version 9223372036854775807 is above max_version 100 that .*capped\.json "
                                         r"allows for channel 'prod'"):
        resolve_channel("prod", host(tmp_path, server.url), capped)
    _r, sig = sign_release(LocalLayer(ci), Digest.of(b"release 3"), key_a, "prod", 3, 3600)
    server.publish("", sig, LocalLayer(ci))
    assert resolve_channel("prod", host(tmp_path, server.url), capped) == Digest.of(b"release 3")
    _r, sig = sign_release(LocalLayer(ci), Digest.of(b"release 101"), key_a, "prod", 101, 3600)
    server.publish("", sig, LocalLayer(ci))
    with pytest.raises(TrustError, match=r"\(channel prod, version 101\): version 101 is above max_version 100"):
        resolve_channel("prod", host(tmp_path, server.url), capped)
    path = tmp_path / "bad.json"
    path.write_text(policy_doc({"prod": {"keys": [public_a], "max_version": 0}}))
    with pytest.raises(TrustError, match=r"channels\.prod\.max_version: version: expected an integer 1\.\."):
        TrustPolicy.load(path)


# -- 4. v1/channels and its files are never followed through a link --------------------------------

@pytest.mark.parametrize("link", ["v1/channels", "v1/channels/prod.json", "v1"])
def test_a_linked_channel_state_is_an_error_never_no_floor(tmp_path: Path, server: ChannelServer, link: str) -> None:
    key, public, _ = new_key(tmp_path, "ci")
    policy = TrustPolicy.load(write_policy(tmp_path / "policy.json", [public]))
    ci = LocalLayer(tmp_path / "ci")
    _r, first = sign_release(ci, Digest.of(b"release 1"), key, "prod", 1, 3600)
    _r, second = sign_release(ci, Digest.of(b"release 2"), key, "prod", 2, 3600)
    server.publish("", second, ci)
    assert resolve_channel("prod", host(tmp_path, server.url), policy) == Digest.of(b"release 2")
    # The real state moves elsewhere and a link takes its place; the remote replays version 1.
    root = tmp_path / "host"
    moved = tmp_path / "elsewhere"
    (root / link).rename(moved)
    (root / link).symlink_to(moved)
    server.publish("", first, ci)
    with pytest.raises(TrustError, match=rf"^channel state (directory )?{re.escape(str(root / link))} is "
                                         r"(a symlink|not a regular file)"):
        resolve_channel("prod", host(tmp_path, server.url), policy)


# -- 5. duplicate JSON keys are refused by every trust parser ---------------------------------------

def test_a_policy_that_names_revoked_twice_is_refused(tmp_path: Path) -> None:
    _key, public, kid = new_key(tmp_path, "ci")
    path = tmp_path / "policy.json"
    # The revocation first, an empty list after: "the last wins" would drop the revocation.
    path.write_text('{"schema":"cubinstore/trust/v1","channels":{"prod":{"keys":["%s"]}},"revoked":["%s"],"revoked":[]}'
                    % (public, kid))
    with pytest.raises(TrustError, match=rf"^trust policy {path}: duplicate key 'revoked'"):
        TrustPolicy.load(path)


def test_a_signature_blob_or_channel_state_with_a_duplicate_key_is_refused(tmp_path: Path,
                                                                           server: ChannelServer) -> None:
    key, public, kid = new_key(tmp_path, "ci")
    policy = TrustPolicy.load(write_policy(tmp_path / "policy.json", [public]))
    ci = LocalLayer(tmp_path / "ci")
    _r, sig = sign_release(ci, Digest.of(b"release 1"), key, "prod", 1, 3600)
    doubled = sig.raw.replace(b'"key":', b'"key":"%s","key":' % (b"0" * 64), 1)
    with pytest.raises(TrustError, match=r"^signature test: duplicate key 'key'"):
        SignatureBlob.from_bytes(doubled, source="test")
    # Served by a remote, it is refused the same way.
    server.files[f"/cas/{Digest.of(doubled).hex}"] = doubled
    server.files["/channels/prod"] = f"{Digest.of(doubled)}\n".encode()
    with pytest.raises(TrustError, match=r"duplicate key 'key'"):
        resolve_channel("prod", host(tmp_path, server.url), policy)
    # A host's state with one signer twice: which floor would hold?
    state = tmp_path / "host" / "v1" / "channels" / "prod.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    entry = '"%s":{"signature":"%s","version":%d}'
    state.write_text('{"channel":"prod","keys":{%s,%s},"schema":"cubinstore/channel-state/v2"}'
                     % (entry % (kid, sig.digest, 9), entry % (kid, sig.digest, 1)))
    server.publish("", sig, ci)
    with pytest.raises(TrustError, match=rf"^channel state {state}: duplicate key '{kid}'"):
        resolve_channel("prod", host(tmp_path, server.url), policy)


# -- 6. sign refuses a private key others can read --------------------------------------------------

@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=oct)
def test_sign_refuses_a_key_file_group_or_others_can_read(tmp_path: Path, make_release, cli, cli_env,
                                                          mode: int) -> None:
    key, _public, kid = new_key(tmp_path, "ci")
    key.chmod(mode)
    release = make_release(n=1)
    home = tmp_path / "ci-home"
    out = cli(["sign", str(release.path), "--key", str(key), "--channel", "prod", "--version", "1"],
              dict(cli_env, CUBINSTORE_HOME=str(home)))
    assert out.returncode == 1
    assert out.stderr == (f"cubinstore: error: signing key {key}: mode {mode:04o} lets group or others access it, "
                          f"expected 0600 (owner only); run `chmod 600 {key}` (and replace the key if others read it)\n")
    assert not home.exists()  # refused before anything was written
    with pytest.raises(TrustError, match=rf"^signing key {key}: mode {mode:04o} .*`chmod 600 {key}`"):
        sign_release(LocalLayer(tmp_path / "lib-home"), Digest.of(b"m"), key, "prod", 1, 3600)
    key.chmod(0o600)
    _record, signature = sign_release(LocalLayer(tmp_path / "lib-home"), Digest.of(b"m"), key, "prod", 1, 3600)
    assert signature.key == kid


def test_a_version_1_channel_state_keeps_its_floor_under_its_signer(tmp_path: Path, server: ChannelServer) -> None:
    key, public, kid = new_key(tmp_path, "ci")
    policy_path = write_policy(tmp_path / "policy.json", [public])
    ci = LocalLayer(tmp_path / "ci")
    _r, first = sign_release(ci, Digest.of(b"release 1"), key, "prod", 1, 3600)
    _r, second = sign_release(ci, Digest.of(b"release 2"), key, "prod", 2, 3600)
    # A host that accepted version 2 before states named their signer.
    home = LocalLayer(tmp_path / "host")
    for digest in (second.record, second.digest):
        home.write(digest, Store([ci]).get(digest))
    home.write_file(("channels",), "prod.json", json.dumps(
        {"channel": "prod", "schema": "cubinstore/channel-state/v1", "signature": str(second.digest), "version": 2},
        sort_keys=True, separators=(",", ":")).encode() + b"\n")
    server.publish("", first, ci)
    with pytest.raises(RollbackError, match=r"offers version 1, but this host already accepted version 2"):
        resolve_channel("prod", host(tmp_path, server.url), TrustPolicy.load(policy_path))
    # Its signer is known (from the signature blob), so revoking it lifts that floor too.
    next_key, next_public, _ = new_key(tmp_path, "next")
    revoked = TrustPolicy.load(write_policy(tmp_path / "revoked.json", [public, next_public], [kid]))
    _r, fresh = sign_release(LocalLayer(tmp_path / "ci-next"), Digest.of(b"fresh 1"), next_key, "prod", 1, 3600)
    server.publish("", fresh, LocalLayer(tmp_path / "ci-next"))
    assert resolve_channel("prod", host(tmp_path, server.url), revoked) == Digest.of(b"fresh 1")
    state = json.loads((tmp_path / "host" / "v1" / "channels" / "prod.json").read_text())
    assert state["schema"] == "cubinstore/channel-state/v2" and set(state["keys"]) == {kid, fresh.key}
