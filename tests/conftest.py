"""Shared fixtures: a real nginx WebDAV CAS on loopback, a deliberately faulty HTTP server,
test manifests made of random bytes, an isolated environment, and GPU test skipping."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.net import find_nginx, local_services
from helpers.registry import RegistryServer, TokenServer

from cubinstore.internals import render_param  # the id grammar, defined once
from cubinstore.manifest import kernel_id

REPO = Path(__file__).resolve().parent.parent


# -- GPU tests ------------------------------------------------------------------------------------

def _gpu_missing_reason() -> str | None:
    # nvidia-smi in a subprocess: deciding to skip must not initialise CUDA in the test process.
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA GPU: nvidia-smi not found"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no NVIDIA GPU: nvidia-smi -L failed ({exc})"
    if out.returncode != 0 or "GPU " not in out.stdout:
        return f"no NVIDIA GPU: nvidia-smi -L exited {out.returncode}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _gpu_missing_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


# -- environment ----------------------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No CUBINSTORE_* variable from the outside; CUBINSTORE_HOME is a fresh directory (returned)."""
    for name in list(os.environ):
        if name.startswith("CUBINSTORE_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    monkeypatch.setenv("CUBINSTORE_HOME", str(home))
    return home


@pytest.fixture
def cli_env(clean_env: Path) -> dict[str, str]:
    """Environment for a `python -m cubinstore` subprocess using the checkout's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubinstore", *args],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=env.get("CUBINSTORE_TEST_CWD"),
    )


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli(args, env)``: run ``python -m cubinstore`` in a subprocess."""
    return run_cli


# -- test manifests -------------------------------------------------------------------------------

@dataclass
class Release:
    """A manifest written to disk plus the bytes of every blob it names."""

    path: Path
    doc: dict
    blobs: dict[str, bytes] = field(default_factory=dict)  # hex -> bytes

    @property
    def raw(self) -> bytes:
        return self.path.read_bytes()

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.raw).hexdigest()


def fake_cubin(rng: random.Random, size: int) -> bytes:
    # ELF magic then random bytes: the store never parses CUBINs, only hashes them.
    return (b"\x7fELF\x02\x01\x01" + rng.randbytes(max(0, size - 7)))[:size]


def kernel_doc(family: str, params: dict, arch: str, data: bytes, entry: str = "k") -> dict:
    parts = [render_param(k, v) for k, v in params.items()]
    return {
        "id": kernel_id(family, params, arch),
        "family": family,
        "params": params,
        "arch": arch,
        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "entries": {entry: ["i32", "f32", "ptr", "ptr"]},
        "target": f"//kernels/{family}:{entry}_{'_'.join(parts)}_{arch}",
    }


def canonical(doc: dict) -> bytes:
    doc = dict(doc, kernels=sorted(doc["kernels"], key=lambda k: k["id"]))
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


@pytest.fixture
def make_release(tmp_path: Path) -> Callable[..., Release]:
    """``make_release(n=4, size=4096, seed=0)``: n axpy kernels of random bytes, manifest on disk."""
    counter = iter(range(1_000_000))

    def make(n: int = 4, size: int = 4096, seed: int | None = None, archs: tuple[str, ...] = ("sm_90a", "sm_80")) -> Release:
        rng = random.Random(seed if seed is not None else uuid.uuid4().int)
        kernels, blobs = [], {}
        combos = [(d, v, a) for d in ("f32", "f64", "bf16", "f16") for v in (1, 2, 4, 8) for a in archs]
        for dtype, vec, arch in combos[:n]:
            data = fake_cubin(rng, size + rng.randrange(64))
            doc = kernel_doc("axpy", {"dtype": dtype, "vec": vec}, arch, data, entry=f"axpy_{dtype}")
            kernels.append(doc)
            blobs[doc["digest"].split(":")[1]] = data
        doc = {"schema": "cubinstore/manifest/v1", "kernels": kernels}
        path = tmp_path / f"release{next(counter)}" / "manifest.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(canonical(doc))
        return Release(path, doc, blobs)

    return make


@pytest.fixture
def tools() -> SimpleNamespace:
    """Plain helpers for tests: kernel_doc, canonical, fake_cubin."""
    return SimpleNamespace(kernel_doc=kernel_doc, canonical=canonical, fake_cubin=fake_cubin)


# -- a real nginx WebDAV server -------------------------------------------------------------------

class Nginx:
    """nginx on a free loopback port; ``/`` accepts PUT (WebDAV); ``/slow/`` sends at 1 MB/s.
    The server of tools/cache_local.sh (``local_services.NginxCache``), with the slow location."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: local_services.NginxCache | None = None
        self.www = workdir / "data"  # what the server's root will be
        self.log = workdir / "access.log"

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    def start(self) -> None:
        nginx = find_nginx()
        if nginx is None:
            pytest.skip("nginx not installed (needed for the real HTTP cache tests)")
        self.server = local_services.NginxCache(self.workdir, nginx, slow_location=True)
        self.www, self.log = self.server.data, self.server.access_log
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def base(self, slow: bool = False) -> str:
        """A fresh, empty CAS URL (unique path prefix) on this server."""
        return f"http://127.0.0.1:{self.port}{'/slow' if slow else ''}/{uuid.uuid4().hex}"

    def requests(self, method: str, path_part: str) -> int:
        """How many requests ``method`` had a URI containing ``path_part``.

        nginx logs a request when it finishes it, which can be just after the client has read the
        response: first a marker request is sent and its log line awaited. One worker handles
        requests in order, so every earlier request's line is written by then.
        """
        marker = f"/__log_marker__/{uuid.uuid4().hex}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}{marker}", timeout=10).close()
        except urllib.error.HTTPError:
            pass  # a 404, logged like any request
        deadline = time.monotonic() + 10
        while marker not in self.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        count = 0
        for line in self.log.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == method and path_part in fields[1] and "/__log_marker__/" not in fields[1]:
                count += 1
        return count

    def file(self, url: str, hex_: str) -> Path:
        prefix = url.split(str(self.port), 1)[1]
        return self.www / prefix.strip("/") / "cas" / hex_


@pytest.fixture(scope="session")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    server = Nginx(tmp_path_factory.mktemp("nginx"))
    server.start()
    yield server
    server.stop()


# -- a real HTTP server that misbehaves on purpose ------------------------------------------------

Action = tuple  # ("ok",) ("status", code) ("sleep", s[, action]) ("body", bytes) ("declare", n, bytes) ("endless",) ("reset",)
#                ("hold", arrived, release[, action]): GET or PUT (body read), see FaultyServer._hold


class FaultyServer:
    """A threaded http.server on loopback. ``script(path, [actions])`` says what each successive
    request to ``path`` gets (the last action repeats); PUT stores the body (``corrupt_puts``
    flips a byte first), a ``("status", code)`` PUT stores nothing (a 201 or 204 is a server that
    drops uploads). With no script, GET serves what was stored, or 404."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Action]] = {}
        self.stored: dict[str, bytes] = {}
        self.counts: Counter[tuple[str, str]] = Counter()
        self.corrupt_puts = False
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer._handle(self, "GET")

            def do_PUT(self) -> None:
                outer._handle(self, "PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def script(self, path: str, actions: list[Action]) -> None:
        with self.lock:
            self.scripts[path] = list(actions)

    def count(self, method: str, path: str) -> int:
        return self.counts[(method, path)]

    def _next(self, path: str) -> Action | None:
        with self.lock:
            actions = self.scripts.get(path)
            if not actions:
                return None
            return actions.pop(0) if len(actions) > 1 else actions[0]

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        with self.lock:
            self.counts[(method, h.path)] += 1
        try:
            if method == "PUT":
                length = int(h.headers.get("Content-Length", "0"))
                body = h.rfile.read(length)
                if self.corrupt_puts and body:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                action = self._hold(self._next(h.path))
                if action and action[0] == "status":
                    self._send(h, action[1], b"")
                    return
                with self.lock:
                    self.stored[h.path] = body
                self._send(h, 201, b"")
                return
            action = self._hold(self._next(h.path))
            if action and action[0] == "sleep":  # ("sleep", seconds[, then_action])
                time.sleep(action[1])
                action = action[2] if len(action) > 2 else None
            self._respond(h, action)
        except OSError:
            pass  # the client gave up (timeout tests): nothing to report

    @staticmethod
    def _hold(action: Action | None) -> Action | None:
        """``("hold", arrived, release[, then])`` (two ``threading.Event``): set ``arrived``, keep the
        request open until ``release`` is set (at most 60 s), then do ``then`` (default: as if
        unscripted). For kill tests: the client is killed while its request is known to be held."""
        if not action or action[0] != "hold":
            return action
        action[1].set()
        action[2].wait(60)
        return action[3] if len(action) > 3 else None

    def _respond(self, h: BaseHTTPRequestHandler, action: Action | None) -> None:
        kind = action[0] if action else "ok"
        if kind == "ok":
            with self.lock:
                body = self.stored.get(h.path)
            self._send(h, 200, body) if body is not None else self._send(h, 404, b"not found")
        elif kind == "status":
            self._send(h, action[1], b"error page")
        elif kind == "body":
            self._send(h, 200, action[1])
        elif kind == "declare":  # declare a length, then send whatever bytes and close
            h.send_response(200)
            h.send_header("Content-Length", str(action[1]))
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(action[2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
        elif kind == "endless":  # no Content-Length, never stops on its own
            h.wfile.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            chunk = b"\0" * 65536
            for _ in range(100_000):
                h.wfile.write(chunk)
            h.close_connection = True
        elif kind == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            h.close_connection = True
            h.connection.close()
        else:
            raise ValueError(kind)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)
        h.close_connection = True

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def faulty() -> Iterator[FaultyServer]:
    server = FaultyServer()
    yield server
    server.stop()


# -- real OCI registries (Debian's docker-registry) -------------------------------------------------

@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A plain registry on loopback (HTTP, no auth); ``registry.repo()`` is a fresh repository."""
    server = RegistryServer(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def secure_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A registry over TLS (a CA made at start: ``.ca``) behind htpasswd basic auth (``.user``, ``.password``)."""
    password = uuid.uuid4().hex
    server = RegistryServer(tmp_path_factory.mktemp("registry-tls"), tls=True, user="ci", password=password)
    server.user, server.password = "ci", password  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="session")
def proxy_registry(registry: RegistryServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A pull-through cache of ``registry`` (a mirror: the same repositories, read only)."""
    server = RegistryServer(tmp_path_factory.mktemp("registry-proxy"), proxy_of=registry.server.url)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A registry behind the Bearer token flow: ``.tokens`` is its realm (a ``TokenServer`` taking
    ``.user``/``.password``), on another port of loopback."""
    password = uuid.uuid4().hex
    workdir = tmp_path_factory.mktemp("registry-token")
    tokens = TokenServer(workdir / "realm", "ci", password)
    server = RegistryServer(workdir / "registry", token=tokens.registry_options)
    server.tokens, server.user, server.password = tokens, "ci", password  # type: ignore[attr-defined]
    yield server
    server.stop()
    tokens.stop()
