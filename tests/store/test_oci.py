"""An OCI registry repository as a store layer, against real registries on loopback: the URL
grammar, blobs verified like any remote's, TLS with basic auth, the Bearer token flow, a
pull-through mirror, redirects, Retry-After, and credentials that never leave the registry."""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.blobs import random_blob
from helpers.net import local_services
from helpers.registry import write_auth_file

from cubinstore import Digest
from cubinstore.errors import BadArgumentError, IntegrityError, MissingBlobError, RemoteUnavailableError
from cubinstore.internals import load_manifest
from cubinstore.store import LocalLayer, Store
from cubinstore.store.oci.artifact import MANIFEST_MEDIA_TYPE, RELEASE_ARTIFACT, parse_artifact
from cubinstore.store.oci.auth import find_credentials, parse_challenge, realm_allowed
from cubinstore.store.oci.reference import RegistryRef
from cubinstore.store.oci.remote import OciLayer
from cubinstore.store.remotes import remote_layer

pytestmark = pytest.mark.usefixtures("clean_env")


# -- the reference grammar ----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "https", "host", "port", "repo", "tag"), [
    ("oci://registry.example.com/team/kernels", True, "registry.example.com", None, "team/kernels", None),
    ("oci://127.0.0.1:5000/k:v1", False, "127.0.0.1", 5000, "k", "v1"),
    ("oci://localhost/a/b-c/d__e", False, "localhost", None, "a/b-c/d__e", None),
    ("oci+https://127.0.0.1:5443/k", True, "127.0.0.1", 5443, "k", None),
    ("oci+http://10.0.0.5:5000/k", False, "10.0.0.5", 5000, "k", None),
    ("oci://[::1]:5000/k:latest", False, "::1", 5000, "k", "latest"),
])
def test_reference_grammar(text: str, https: bool, host: str, port: int | None, repo: str, tag: str | None) -> None:
    ref = RegistryRef.parse(text)
    assert (ref.https, ref.host, ref.port, ref.repository, ref.tag) == (https, host, port, repo, tag)
    assert RegistryRef.parse(str(ref)) == ref  # what is printed parses back the same


@pytest.mark.parametrize(("text", "message"), [
    ("oci://host/Upper", "invalid repository 'Upper'"),
    ("oci://host/../etc", "invalid repository '../etc'"),
    ("oci://host/a//b", "invalid repository 'a//b'"),
    ("oci://host/", "invalid repository ''"),
    ("oci://host/k:-bad", "invalid tag '-bad'"),
    ("oci://host:0/k", "invalid port '0'"),
    ("oci://host:99999/k", "invalid port '99999'"),
    ("oci://host:\u00b2/k", "invalid port '\u00b2'"),  # '²'.isdigit(), but int() refuses it
    ("oci://host:" + "9" * 5000 + "/k", "invalid port '99999"),  # past int()'s 4300 digits
    ("oci://ho_st/k", "invalid host 'ho_st'"),
    ("oci://user:secret@host/k", "invalid registry reference 'oci://***@host/k': no credentials in the URL"),
    ("oci://host/k?x=1", "invalid registry reference 'oci://host/k?x=1': no spaces"),
    ("oci://host/k@sha256:abc", "invalid registry reference 'oci://host/k@sha256:abc': invalid digest length: 3"),
], ids=lambda v: v if len(v) < 60 else v[:40] + "...")
def test_malformed_references_are_refused_before_any_io(text: str, message: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        RegistryRef.parse(text)
    assert str(info.value).startswith(message)
    assert "secret" not in str(info.value)


def test_plain_http_only_on_loopback_unless_asked() -> None:
    assert RegistryRef.parse("oci://registry.example.com/k").http_base == "https://registry.example.com"
    assert RegistryRef.parse("oci://127.0.0.1:5000/k").http_base == "http://127.0.0.1:5000"
    assert RegistryRef.parse("oci+http://build-host:5000/k").http_base == "http://build-host:5000"


def test_a_remote_names_a_repository_not_a_tag() -> None:
    with pytest.raises(BadArgumentError, match=r"^registry remote oci://127.0.0.1:5000/k:v1: a remote names a repository"):
        remote_layer("oci://127.0.0.1:5000/k:v1")
    assert isinstance(remote_layer("oci://127.0.0.1:5000/k"), OciLayer)


# -- blobs through the Store --------------------------------------------------------------------------

def pushed(repo: str, *blobs: tuple[Digest, bytes]) -> OciLayer:
    pusher = OciLayer(RegistryRef.parse(repo), push=True)
    for digest, data in blobs:
        pusher.put(digest, data)
    return pusher


def test_a_blob_comes_from_the_registry_verified_and_is_kept(registry, clean_env: Path) -> None:
    digest, data = random_blob(5000, seed=1)
    repo = registry.repo()
    pushed(repo, (digest, data))
    store = Store([LocalLayer(clean_env), remote_layer(repo)])
    assert store.get(digest, len(data)) == data
    assert LocalLayer(clean_env).path_for(digest).read_bytes() == data


def test_a_blob_the_registry_lost_is_a_clean_miss_naming_the_repository(registry, clean_env: Path) -> None:
    digest, data = random_blob(100, seed=2)
    repo = registry.repo()
    store = Store([LocalLayer(clean_env), remote_layer(repo)])
    with pytest.raises(MissingBlobError) as info:
        store.get(digest, len(data))
    assert str(info.value).startswith(f"{digest} (100 bytes) not available: ")
    assert f"registry {repo}: miss" in str(info.value)


def test_a_blob_changed_in_registry_storage_is_refused_and_nothing_is_stored(registry, clean_env: Path) -> None:
    digest, data = random_blob(4096, seed=3)
    repo = registry.repo()
    pushed(repo, (digest, data))
    path = registry.blob_file(digest.hex)
    flipped = bytearray(data)
    flipped[77] ^= 0x10
    path.write_bytes(bytes(flipped))
    local = LocalLayer(clean_env)
    with pytest.raises(IntegrityError) as info:
        Store([local, remote_layer(repo)]).get(digest, len(data), name="axpy/sm_90a")
    assert str(info.value).startswith(f"{digest} (axpy/sm_90a) (4096 bytes) not available: ")
    assert f"registry {repo}: digest mismatch for {digest}" in str(info.value)
    assert not local.path_for(digest).exists()


def test_a_pull_through_mirror_serves_what_the_origin_has(registry, proxy_registry, clean_env: Path) -> None:
    digest, data = random_blob(2048, seed=5)
    repo = registry.repo()
    pushed(repo, (digest, data))
    mirror = repo.replace(registry.host, proxy_registry.host)
    store = Store([LocalLayer(clean_env), remote_layer(mirror), remote_layer(repo)])
    assert store.get(digest, len(data)) == data
    path = "/v2/" + repo.split("/", 3)[3] + f"/blobs/{digest}"
    assert proxy_registry.requests("GET", path) == 1
    assert registry.requests("GET", path) >= 1  # the proxy fetched it from the origin


# -- TLS, basic auth, credentials files -----------------------------------------------------------------

def test_tls_with_basic_auth_from_registry_auth_file(secure_registry, clean_env: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(secure_registry.ca))
    digest, data = random_blob(1000, seed=6)
    repo = secure_registry.repo()
    auth = write_auth_file(tmp_path / "auth.json", secure_registry.host, secure_registry.user, secure_registry.password)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
    pushed(repo, (digest, data))
    assert Store([LocalLayer(clean_env), remote_layer(repo)]).get(digest, len(data)) == data


def test_no_credentials_says_where_they_are_read_from(secure_registry, clean_env: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(secure_registry.ca))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.docker/config.json
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    digest, _ = random_blob(10, seed=7)
    repo = secure_registry.repo()
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(repo).read(digest, 10)
    assert str(info.value).startswith(f"blob {digest} of {repo}: {secure_registry.host} asks for a password (Basic); "
                                      f"no credentials for {secure_registry.host} in REGISTRY_AUTH_FILE")


def test_wrong_password_is_refused_and_never_printed(secure_registry, clean_env: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(secure_registry.ca))
    auth = write_auth_file(tmp_path / "auth.json", secure_registry.host, secure_registry.user, "not-the-password-xyz")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
    digest, _ = random_blob(10, seed=8)
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(secure_registry.repo()).read(digest, 10)
    assert "HTTP 401 again after authenticating" in str(info.value)
    assert f"refused the credentials for {secure_registry.host} from {auth}" in str(info.value)
    assert "not-the-password-xyz" not in str(info.value)
    assert "not-the-password-xyz" not in repr(find_credentials(secure_registry.host, "test/x", [auth]))


def test_an_untrusted_certificate_is_refused(secure_registry, clean_env: Path) -> None:
    digest, _ = random_blob(10, seed=9)
    with pytest.raises(RemoteUnavailableError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        OciLayer(secure_registry.repo(), retries=0).read(digest, 10)


def test_credentials_files_in_their_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docker = tmp_path / "home" / ".docker"
    docker.mkdir(parents=True)
    write_auth_file(docker / "config.json", "r.example:5000", "docker-user", "a")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    assert find_credentials("r.example:5000", "team/k").username == "docker-user"
    runtime = tmp_path / "run"
    (runtime / "containers").mkdir(parents=True)
    write_auth_file(runtime / "containers" / "auth.json", "r.example:5000", "podman-user", "b")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert find_credentials("r.example:5000", "team/k").username == "podman-user"
    write_auth_file(tmp_path / "explicit.json", "r.example:5000/team", "namespace-user", "c")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "explicit.json"))
    assert find_credentials("r.example:5000", "team/k").username == "namespace-user"
    assert find_credentials("r.example:5000", "other/k").username == "podman-user"  # namespace does not match
    assert find_credentials("elsewhere:5000", "team/k") is None
    (tmp_path / "explicit.json").write_text('{"auths": {"r.example:5000": {"auth": "secret-not-base64!"}}}')
    with pytest.raises(BadArgumentError) as info:
        find_credentials("r.example:5000", "team/k")
    assert "secret" not in str(info.value)


# -- the Bearer token flow ------------------------------------------------------------------------------

def test_bearer_token_flow_push_and_pull(token_registry, clean_env: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    write_auth_file(home / ".docker" / "config.json", token_registry.host, token_registry.user, token_registry.password)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    digest, data = random_blob(1500, seed=10)
    repo = token_registry.repo()
    pushed(repo, (digest, data))
    assert Store([LocalLayer(clean_env), remote_layer(repo)]).get(digest, len(data)) == data
    scopes = [path for path, _ in token_registry.tokens.requests]
    name = repo.split("/", 3)[3]
    assert any(f"scope=repository%3A{name.replace('/', '%2F')}%3Apull%2Cpush" in p for p in scopes)
    assert any(p.endswith(f"scope=repository%3A{name.replace('/', '%2F')}%3Apull&service=cubinstore-test")
               for p in scopes)


@pytest.mark.parametrize(("realm", "registry", "why"), [
    # A shared parent domain is no proof of one owner: each of these passed the last-two-labels rule.
    ("https://evil.co.uk/token", "oci://registry.example.co.uk/k",
     "host evil.co.uk is not the registry's host registry.example.co.uk"),
    ("https://attacker.azurecr.io/oauth2/token", "oci://victim.azurecr.io/k",
     "host attacker.azurecr.io is not the registry's host victim.azurecr.io"),
    ("https://bucket.s3.amazonaws.com/token", "oci://123456789012.dkr.ecr.us-east-1.amazonaws.com/k",
     "host bucket.s3.amazonaws.com is not the registry's host 123456789012.dkr.ecr.us-east-1.amazonaws.com"),
    ("https://auth.example.com/token", "oci://registry.example.com/k",
     "host auth.example.com is not the registry's host registry.example.com"),
    ("https://evil.docker.io/token", "oci://registry-1.docker.io/k",
     "host evil.docker.io is not the registry's host registry-1.docker.io nor auth.docker.io"),
    ("https://registry.example.com@evil.example/token", "oci://registry.example.com/k",
     "host evil.example is not the registry's host registry.example.com"),
    ("https://127.0.0.2/token", "oci://127.0.0.1/k", "host 127.0.0.2 is not the registry's host 127.0.0.1"),
    ("http://auth.docker.io/token", "oci://registry-1.docker.io/k",
     "plain HTTP; credentials only go over HTTPS (or to a plain-HTTP loopback registry's own host)"),
    ("http://127.0.0.1:9/token", "oci+https://127.0.0.1:5000/k",
     "plain HTTP; credentials only go over HTTPS (or to a plain-HTTP loopback registry's own host)"),
    ("ftp://registry.example.com/token", "oci://registry.example.com/k", "not an http(s) URL"),
], ids=lambda v: v[:50])
def test_a_realm_off_the_registrys_host_is_refused(realm: str, registry: str, why: str) -> None:
    assert realm_allowed(realm, RegistryRef.parse(registry)) == why


@pytest.mark.parametrize(("realm", "registry"), [
    ("https://registry.example.com/token", "oci://registry.example.com/k"),
    ("https://registry.example.com:5001/token", "oci://registry.example.com/k"),  # the host, any port
    ("https://auth.docker.io/token", "oci://registry-1.docker.io/library/k"),
    ("https://auth.docker.io/token", "oci://docker.io/library/k"),
    ("https://auth.docker.io/token", "oci://index.docker.io/library/k"),
    ("https://gitlab.com/jwt/auth", "oci://registry.gitlab.com/group/k"),
    ("http://127.0.0.1:9/token", "oci://127.0.0.1:5000/k"),  # a plain-HTTP loopback registry's own host
])
def test_a_realm_on_the_registrys_host_or_a_known_pair_is_used(realm: str, registry: str) -> None:
    assert realm_allowed(realm, RegistryRef.parse(registry)) is None


def test_a_challenge_is_parsed_to_its_parameters() -> None:
    challenge = parse_challenge('Bearer realm="https://a.example/t",service="s",scope="repository:x:pull"', "here")
    assert challenge.params == {"realm": "https://a.example/t", "service": "s", "scope": "repository:x:pull"}


# -- a registry that misbehaves on purpose (redirects, challenges, Retry-After) ---------------------------

class Scripted:
    """A registry front on loopback: each request is answered by ``answer(handler)``; every request's
    (host it came to, path, Authorization) is recorded."""

    def __init__(self, answer, host: str = "127.0.0.1", tls: tuple[Path, Path] | None = None) -> None:  # noqa: ANN001
        self.seen: list[tuple[str, str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.seen.append((host, self.path, self.headers.get("Authorization", "")))
                status, headers, body = answer(self)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:  # (certificate, key)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.httpd.server_address[1]}"
        self.host = f"{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[list[Scripted]]:
    servers: list[Scripted] = []
    yield servers
    for s in servers:
        s.stop()


def test_a_blob_redirect_is_followed_without_the_authorization_header(scripted, clean_env: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    digest, data = random_blob(700, seed=11)
    storage = Scripted(lambda h: (200, {}, data), host="127.0.0.2")
    scripted.append(storage)

    def front(h):  # noqa: ANN001, ANN202
        if h.headers.get("Authorization") != "Basic Y2k6cHc=":  # ci:pw
            return 401, {"WWW-Authenticate": 'Basic realm="r"'}, b""
        return 307, {"Location": f"{storage.url}/objects/{digest.hex}?X-Signature=abc"}, b""

    registry = Scripted(front)
    scripted.append(registry)
    auth = write_auth_file(tmp_path / "auth.json", registry.host, "ci", "pw")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
    store = Store([LocalLayer(clean_env), remote_layer(f"oci://{registry.host}/team/k")])
    assert store.get(digest, len(data)) == data
    assert storage.seen == [("127.0.0.2", f"/objects/{digest.hex}?X-Signature=abc", "")]


def test_a_redirect_loop_is_an_error_naming_the_blob(scripted, clean_env: Path) -> None:
    digest, _ = random_blob(10, seed=12)
    servers: list[Scripted] = []
    a = Scripted(lambda h: (302, {"Location": f"{servers[1].url}/b"}, b""))
    b = Scripted(lambda h: (302, {"Location": f"{servers[0].url}/a"}, b""))
    servers += [a, b]
    scripted.extend(servers)
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(f"oci://{a.host}/team/k").read(digest, 10)
    assert str(info.value).startswith(f"blob {digest} of oci://{a.host}/team/k: redirect loop: ")


def test_retry_after_is_honoured_within_the_deadline(scripted, clean_env: Path) -> None:
    digest, data = random_blob(64, seed=13)
    answers = iter([(429, {"Retry-After": "1"}, b'{"errors":[{"code":"TOOMANYREQUESTS","message":"slow down"}]}')])
    server = Scripted(lambda h: next(answers, (200, {}, data)))
    scripted.append(server)
    assert OciLayer(f"oci://{server.host}/team/k").read(digest, 64) == data
    assert len(server.seen) == 2
    late = Scripted(lambda h: (503, {"Retry-After": "3600"}, b""))
    scripted.append(late)
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(f"oci://{late.host}/team/k", deadline=5).read(digest, 64)
    assert "HTTP 503, asked to retry after 3600s, past the total deadline of 5s" in str(info.value)
    assert len(late.seen) == 1


def test_a_challenge_naming_an_unexpected_realm_host_is_refused(scripted, clean_env: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    server = Scripted(lambda h: (401, {"WWW-Authenticate": 'Bearer realm="https://tokens.evil.example/t",service="x"'},
                                 b""))
    scripted.append(server)
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(write_auth_file(tmp_path / "a.json", server.host, "ci", "pw")))
    digest, _ = random_blob(10, seed=14)
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(f"oci://{server.host}/team/k").read(digest, 10)
    assert str(info.value) == (
        f"blob {digest} of oci://{server.host}/team/k: {server.host} for oci://{server.host}/team/k: token realm "
        "'https://tokens.evil.example/t' refused: host tokens.evil.example is not the registry's host 127.0.0.1; "
        "credentials are never sent there")


def test_an_oversized_content_length_is_refused_unread(scripted, clean_env: Path) -> None:
    digest, _ = random_blob(100, seed=15)
    server = Scripted(lambda h: (200, {}, b"x" * 5000))
    scripted.append(server)
    local = LocalLayer(clean_env)
    with pytest.raises(IntegrityError) as info:
        Store([local, remote_layer(f"oci://{server.host}/team/k")]).get(digest, 100)
    assert "server declares 5000 bytes, expected 100; not downloaded" in str(info.value)
    assert f"/v2/team/k/blobs/{digest}" in str(info.value)
    assert not local.path_for(digest).exists()


def test_a_mirror_serving_wrong_bytes_is_skipped_for_the_origin(registry, scripted, clean_env: Path) -> None:
    digest, data = random_blob(3000, seed=4)
    origin = registry.repo()
    pushed(origin, (digest, data))
    bad = bytearray(data)
    bad[0] ^= 1
    mirror = Scripted(lambda h: (200, {}, bytes(bad)))
    scripted.append(mirror)
    local = LocalLayer(clean_env)
    store = Store([local, remote_layer(f"oci://{mirror.host}/{origin.split('/', 3)[3]}"), remote_layer(origin)])
    assert store.get(digest, len(data)) == data
    assert store.stats.verification_failures == 1
    assert local.path_for(digest).read_bytes() == data


def test_error_bodies_of_the_registry_are_quoted(scripted) -> None:
    body = json.dumps({"errors": [{"code": "DENIED", "message": "requested access to the resource is denied"}]})
    server = Scripted(lambda h: (403, {}, body.encode()))
    scripted.append(server)
    digest, _ = random_blob(10, seed=16)
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(f"oci://{server.host}/team/k").read(digest, 10)
    assert str(info.value).endswith("HTTP 403 'DENIED': 'requested access to the resource is denied'")


# -- hostile registries: credentials kept home, and what they send refused as a typed error --------------

def test_a_401_from_a_redirect_target_gets_no_credentials_nor_a_token_request(scripted, clean_env: Path,
                                                                              tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry redirects a blob GET to a host of its choosing, which challenges with a realm on
    the registry's own host name: the stored password would go to that realm. Nothing is sent."""
    digest, _ = random_blob(50, seed=20)
    target: list[Scripted] = []

    def storage_answer(h):  # noqa: ANN001, ANN202
        if h.path.startswith("/token"):
            return 200, {"Content-Type": "application/json"}, b'{"token": "t0k"}'
        return 401, {"WWW-Authenticate": f'Bearer realm="{target[0].url}/token",service="s"'}, b""

    storage = Scripted(storage_answer)
    target.append(storage)
    registry = Scripted(lambda h: (307, {"Location": f"{storage.url}/objects/{digest.hex}"}, b""))
    scripted.extend([storage, registry])
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(write_auth_file(tmp_path / "a.json", registry.host, "ci", "pw")))
    repo = f"oci://{registry.host}/team/k"
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(repo).read(digest, 50)
    assert storage.seen == [("127.0.0.1", f"/objects/{digest.hex}", "")]  # no token request, no password
    assert [auth for _, _, auth in registry.seen] == [""]
    assert str(info.value) == (
        f"blob {digest} of {repo}: GET {registry.url}/v2/team/k/blobs/{digest} was redirected to "
        f"'{storage.url}/objects/{digest.hex}', which answered HTTP 401; not answered: credentials go only to "
        f"{registry.url}")


@pytest.fixture
def loopback_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A CA trusted through SSL_CERT_FILE and (certificate, key) it signed for 127.0.0.1."""
    ca, cert, key = local_services.make_test_ca(tmp_path / "ca")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    return cert, key


def test_a_registry_over_tls_cannot_redirect_to_plain_http_on_loopback(scripted, loopback_ca, clean_env: Path) -> None:
    """A registry that is not plain HTTP on loopback itself must not steer us to local services."""
    digest, data = random_blob(40, seed=21)
    local_service = Scripted(lambda h: (200, {}, data))
    registry = Scripted(lambda h: (302, {"Location": f"{local_service.url}/admin/{digest.hex}"}, b""), tls=loopback_ca)
    scripted.extend([local_service, registry])
    repo = f"oci+https://{registry.host}/team/k"
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(repo, retries=0).read(digest, 40)
    assert str(info.value) == (
        f"blob {digest} of {repo}: redirect to plain HTTP '{local_service.url}/admin/{digest.hex}' refused (HTTPS "
        f"only, unless the registry itself is plain HTTP on loopback; it is {registry.url})")
    assert local_service.seen == []
    assert len(registry.seen) == 1


DEEP = b"[" * 100_000  # past the JSON parser's recursion limit: RecursionError from json.loads


def test_a_deeply_nested_error_body_is_a_layer_failure_and_the_origin_serves(registry, scripted,
                                                                              clean_env: Path) -> None:
    digest, data = random_blob(300, seed=22)
    origin = registry.repo()
    pushed(origin, (digest, data))
    bad = Scripted(lambda h: (403, {"Content-Type": "application/json"}, DEEP))
    scripted.append(bad)
    mirror = f"oci://{bad.host}/{origin.split('/', 3)[3]}"
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(mirror).read(digest, 300)
    assert str(info.value) == f"blob {digest} of {mirror}: GET {bad.url}/v2/{origin.split('/', 3)[3]}/blobs/{digest}: HTTP 403"
    assert Store([LocalLayer(clean_env), remote_layer(mirror), remote_layer(origin)]).get(digest, 300) == data


def test_a_deeply_nested_token_reply_is_a_typed_error_and_the_origin_serves(registry, scripted,
                                                                             clean_env: Path) -> None:
    digest, data = random_blob(300, seed=23)
    origin = registry.repo()
    pushed(origin, (digest, data))
    deep = b"[" * 60_000  # the token reply is read at most 64 KiB

    def answer(h):  # noqa: ANN001, ANN202
        if h.path.startswith("/token"):
            return 200, {"Content-Type": "application/json"}, deep
        return 401, {"WWW-Authenticate": f'Bearer realm="http://{h.server.server_address[0]}:'
                                         f'{h.server.server_address[1]}/token"'}, b""

    bad = Scripted(answer)
    scripted.append(bad)
    mirror = f"oci://{bad.host}/{origin.split('/', 3)[3]}"
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(mirror).read(digest, 300)
    assert str(info.value) == (f"blob {digest} of {mirror}: {bad.host}: token realm {bad.url}/token answered: "
                               "JSON nested too deeply")
    assert Store([LocalLayer(clean_env), remote_layer(mirror), remote_layer(origin)]).get(digest, 300) == data


@pytest.mark.parametrize("by", ["digest", "tag"])
def test_a_deeply_nested_artifact_manifest_is_an_integrity_error(scripted, clean_env: Path, by: str) -> None:
    digest = Digest.of(DEEP)
    server = Scripted(lambda h: (200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, DEEP))
    scripted.append(server)
    repo = f"oci://{server.host}/team/k"
    with pytest.raises(IntegrityError) as info:
        load_manifest(f"{repo}@{digest}" if by == "digest" else f"{repo}:v1", Store([LocalLayer(clean_env)]))
    assert str(info.value) == f"artifact {repo}@{digest}: JSON nested too deeply"
    with pytest.raises(IntegrityError, match=r"^artifact oci://h/r@sha256:[0-9a-f]{64}: JSON nested too deeply$"):
        parse_artifact(DEEP, digest, "oci://h/r", artifact_type=RELEASE_ARTIFACT, config_type=MANIFEST_MEDIA_TYPE)


def test_a_deeply_nested_layout_index_is_an_integrity_error(tmp_path: Path, clean_env: Path) -> None:
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_bytes(DEEP)
    with pytest.raises(IntegrityError) as info:
        load_manifest(f"oci-layout:{layout}:v1", Store([LocalLayer(clean_env)]))
    assert str(info.value) == f"{layout / 'index.json'}: not an OCI image index: JSON nested too deeply"


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "1" * 65], ids=["superscript-two", "5000-digits", "65-chars"])
def test_a_malformed_retry_after_is_ignored_for_the_usual_backoff(scripted, clean_env: Path, value: str) -> None:
    digest, data = random_blob(64, seed=24)
    answers = iter([(503, {"Retry-After": value}, b"")])
    server = Scripted(lambda h: next(answers, (200, {}, data)))
    scripted.append(server)
    assert OciLayer(f"oci://{server.host}/team/k", backoff=0.01, deadline=5).read(digest, 64) == data
    assert len(server.seen) == 2


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "-1", "0x10"],
                         ids=["superscript-two", "5000-digits", "negative", "hex"])
def test_a_malformed_content_length_on_head_is_a_typed_error_naming_the_blob(scripted, clean_env: Path,
                                                                            value: str) -> None:
    digest, _ = random_blob(64, seed=25)
    server = Scripted(lambda h: (200, {"Content-Length": value}, b""))
    scripted.append(server)
    repo = f"oci://{server.host}/team/k"
    with pytest.raises(RemoteUnavailableError) as info:
        OciLayer(repo, push=True).has(digest, 64)
    assert str(info.value).startswith(f"blob {digest} of {repo}: HEAD {server.url}/v2/team/k/blobs/{digest} "
                                      f"declares Content-Length {value[:10]!r}"[:-1])
    assert str(info.value).endswith(": expected 1 to 20 ASCII digits")


def test_a_head_with_a_plain_content_length_is_the_blob_size(scripted, clean_env: Path) -> None:
    digest, _ = random_blob(64, seed=26)
    server = Scripted(lambda h: (200, {"Content-Length": "64"}, b""))
    scripted.append(server)
    layer = OciLayer(f"oci://{server.host}/team/k", push=True)
    assert layer.has(digest, 64)
    assert not layer.has(digest, 65)


def test_a_fifo_credentials_file_is_skipped_at_once_for_the_next(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    fifo = tmp_path / "auth.json"
    os.mkfifo(fifo)
    after = write_auth_file(tmp_path / "config.json", "r.example:5000", "next-user", "pw")
    found: list[object] = []
    with caplog.at_level(logging.WARNING, logger="cubinstore"):
        worker = threading.Thread(target=lambda: found.append(find_credentials("r.example:5000", "team/k",
                                                                               [fifo, after])), daemon=True)
        worker.start()
        worker.join(10)
    if worker.is_alive():  # a blocking open() of the FIFO: let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("reading a FIFO credentials file blocked")
    assert [c.username for c in found] == ["next-user"]  # type: ignore[attr-defined]
    assert f"cannot read registry credentials file {fifo}: it is a FIFO; expected a regular file; skipping it" in [
        r.getMessage() for r in caplog.records]


def test_a_deeply_nested_credentials_file_is_a_typed_error(tmp_path: Path) -> None:
    deep = tmp_path / "auth.json"
    deep.write_bytes(DEEP)
    with pytest.raises(BadArgumentError) as info:
        find_credentials("r.example:5000", "team/k", [deep])
    assert str(info.value) == f"registry credentials file {deep}: JSON nested too deeply"
