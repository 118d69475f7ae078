"""Registries on loopback for the OCI tests: Debian's docker-registry started through
tools/local_services.py (the classes `local_services.py registry` uses), a fresh repository per
test, request counts from the access log, and `skopeo`.

A missing docker-registry or skopeo skips, or fails where CUBINSTORE_REQUIRE_BAZEL_TESTS=1 (CI).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import NoReturn

import pytest

from helpers.net import local_services

__all__ = ["REQUIRE_ENV", "RegistryServer", "unavailable", "write_auth_file"]

REQUIRE_ENV = "CUBINSTORE_REQUIRE_BAZEL_TESTS"


def unavailable(reason: str) -> NoReturn:
    """Skips the test, or fails it where the real components are required (CI)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def find_skopeo() -> Path:
    found = local_services.find_skopeo()
    if found is None:
        unavailable("skopeo not installed (tools/bootstrap.sh installs Debian's skopeo)")
    return found


class RegistryServer:
    """A started ``local_services.Registry`` and what the tests ask of it."""

    def __init__(self, workdir: Path, **options: object) -> None:
        binary = local_services.find_registry()
        if binary is None:
            unavailable("docker-registry not installed (tools/bootstrap.sh installs Debian's docker-registry)")
        self.server = local_services.Registry(workdir, binary, **options)  # type: ignore[arg-type]
        self.server.start()

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def ca(self) -> Path | None:
        return self.server.ca

    def repo(self, name: str = "") -> str:
        """A fresh repository URL (``oci://`` on loopback: plain HTTP, or ``oci+https://`` for TLS)."""
        scheme = "oci+https" if self.server.tls else "oci"
        return f"{scheme}://{self.host}/test/{name or uuid.uuid4().hex[:12]}"

    def blob_file(self, hex_digest: str) -> Path:
        return self.server.blob(hex_digest)

    def requests(self, method: str, path_part: str = "") -> int:
        """How many ``method`` requests with ``path_part`` in their path the registry has answered.
        A line is written after its response: a marker request's line is awaited first, so
        every earlier request is counted."""
        marker = f"/v2/cubinstore-marker/{uuid.uuid4().hex}/tags/list"
        context = ssl.create_default_context(cafile=str(self.ca)) if self.ca else None
        try:
            urllib.request.urlopen(f"{self.server.url}{marker}", timeout=10, context=context).close()
        except urllib.error.HTTPError:
            pass  # a 401 or 404, logged like any request
        deadline = time.monotonic() + 10
        while self.server.requests("GET", marker) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.server.requests(method, path_part)

    def stop(self) -> None:
        self.server.stop()


def write_auth_file(path: Path, registry: str, user: str, password: str) -> Path:
    """A containers-auth.json (what `skopeo login --authfile` writes) holding one login."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {registry: {"auth": token}}}))
    path.chmod(0o600)
    return path


# -- a Bearer token service for the registry's `auth: token` (the flow Docker Hub and most cloud registries use) --

class TokenServer:
    """A token realm on loopback: checks Basic credentials, answers a JWT (ES256, its certificate in
    the header's x5c) granting the scope asked for. ``rootcertbundle`` is what the registry trusts;
    ``requests`` records (path, Authorization header) of each request."""

    def __init__(self, workdir: Path, user: str, password: str, service: str = "cubinstore-test",
                 issuer: str = "cubinstore-test-issuer") -> None:
        import datetime
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cubinstore test token signer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.der = cert.public_bytes(serialization.Encoding.DER)
        workdir.mkdir(parents=True, exist_ok=True)
        self.rootcertbundle = workdir / "token-signer.pem"
        self.rootcertbundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.user, self.password, self.service, self.issuer = user, password, service, issuer
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._answer(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def registry_options(self) -> dict[str, str]:
        return {"realm": self.realm, "service": self.service, "issuer": self.issuer,
                "rootcertbundle": str(self.rootcertbundle)}

    def _answer(self, h) -> None:  # noqa: ANN001 - a BaseHTTPRequestHandler
        from urllib.parse import parse_qs, urlsplit

        auth = h.headers.get("Authorization", "")
        self.requests.append((h.path, auth))
        expected = "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        if auth != expected:
            body, status = b'{"details":"bad credentials"}', 401
        else:
            query = parse_qs(urlsplit(h.path).query)
            access = []
            for scope in query.get("scope", []):
                kind, name, actions = scope.split(":")
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
            body, status = json.dumps({"token": self._jwt(access), "expires_in": 300}).encode(), 200
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _jwt(self, access: list[dict]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(self.der).decode()]}
        claims = {"iss": self.issuer, "sub": self.user, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
