"""HTTP store speaking the Bazel HTTP cache protocol: ``GET``/``PUT <base>/cas/<hex>``.

Works with nginx (WebDAV), bazel-remote and any static file server. Every request
has a connect timeout, a read timeout and a share of one total deadline; transient
failures (5xx, 408, 429, timeouts, resets, truncated bodies) are retried with jittered
exponential backoff; a body is never read past the expected size.
"""

from __future__ import annotations

import base64
import http.client
import logging
import random
import socket
import time
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from cubinstore import _env
from cubinstore._digest import Digest, show
from cubinstore._layer import Layer, limit_for
from cubinstore.errors import BadArgumentError, IntegrityError, RemoteUnavailableError

__all__ = ["HttpStore"]

_log = logging.getLogger(__name__)

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_PUT_OK = frozenset({200, 201, 204})
_CHUNK = 1 << 16


class _Transient(Exception):
    """A failure worth retrying; the message says what happened."""


class HttpStore(Layer):
    """A remote CAS at ``url`` (``http://`` or ``https://``; a path prefix is allowed)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        retries: int | None = None,
        deadline: float | None = None,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
    ) -> None:
        if not isinstance(url, str):
            raise BadArgumentError(f"invalid remote URL {show(url)}: expected a string")
        parts = urlsplit(url.strip())
        try:
            port = parts.port
        except ValueError:
            raise BadArgumentError(f"invalid remote URL {show(url)}: bad port") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadArgumentError(f"invalid remote URL {show(url)}: expected http://HOST[:PORT][/PREFIX] or https://...")
        if parts.query or parts.fragment or any(c in url for c in "\r\n\0 "):
            raise BadArgumentError(f"invalid remote URL {show(url)}: no query, fragment, spaces or control characters allowed")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Connection": "close", "User-Agent": "cubinstore"}
        if parts.username is not None:
            token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(token).decode("ascii")
        netloc = f"[{self._host}]" if ":" in self._host else self._host
        # Credentials never appear in self.url, hence never in logs or error messages.
        self.url = f"{parts.scheme}://{netloc}{f':{port}' if port else ''}{self._prefix}"
        self.connect_timeout = _env.http_connect_timeout() if connect_timeout is None else connect_timeout
        self.read_timeout = _env.http_timeout() if read_timeout is None else read_timeout
        self.retries = _env.http_retries() if retries is None else retries
        self.deadline = _env.http_deadline() if deadline is None else deadline
        self.backoff = backoff
        self.max_backoff = max_backoff

    @property
    def name(self) -> str:
        return f"remote {self.url}"

    def blob_url(self, digest: Digest) -> str:
        return f"{self.url}/cas/{digest.hex}"

    # -- Layer ----------------------------------------------------------------------------------

    def read(self, digest: Digest, size: int | None) -> bytes | None:
        """GET the blob: its bytes (unverified, at most size + 1), or None on 404."""
        path = f"{self._prefix}/cas/{digest.hex}"
        status, data = self._with_retries("GET", path, None, size)
        if status == 404:
            _log.debug("miss %s at %s", digest, self.url)
            return None
        return data

    def discard(self, digest: Digest, size: int | None, reason: str) -> None:
        _log.warning("remote %s served bad bytes for %s: %s", self.url, digest, reason)

    def put(self, digest: Digest, data: bytes) -> None:
        """PUT the blob (the caller has verified it). Raises ``RemoteUnavailableError`` on failure."""
        self._with_retries("PUT", f"{self._prefix}/cas/{digest.hex}", bytes(data), None)
        _log.debug("uploaded %s (%d bytes) to %s", digest, len(data), self.url)

    # -- HTTP machinery -------------------------------------------------------------------------

    def _with_retries(self, method: str, path: str, body: bytes | None, size: int | None) -> tuple[int, bytes | None]:
        url = f"{self.url}{path[len(self._prefix):]}"
        start = time.monotonic()
        deadline = start + self.deadline
        last = ""
        attempts = 0
        for attempt in range(self.retries + 1):
            if time.monotonic() >= deadline:
                if not last.startswith("total deadline"):
                    last = f"total deadline of {self.deadline:g}s passed; last error: {last}"
                break
            attempts += 1
            try:
                status, data = self._attempt(method, path, body, size, deadline, url)
            except _Transient as exc:
                last = str(exc)
                _log.debug("%s %s attempt %d failed: %s", method, url, attempts, last)
            else:
                if method == "GET" and status in (200, 404):
                    return status, data
                if method == "PUT" and status in _PUT_OK:
                    return status, None
                if status not in _RETRY_STATUS:
                    hint = "; does the server accept PUT (WebDAV)?" if method == "PUT" and status in (403, 405) else ""
                    raise RemoteUnavailableError(f"{method} {url}: HTTP {status}, not retried{hint}")
                last = f"HTTP {status}"
                _log.debug("%s %s attempt %d: HTTP %d", method, url, attempts, status)
            if attempt < self.retries:
                pause = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        raise RemoteUnavailableError(
            f"{method} {url} failed after {attempts} attempt{'s' * (attempts != 1)} "
            f"in {time.monotonic() - start:.1f}s: {last}; check the server, or set CUBINSTORE_OFFLINE=1 "
            "to use only the local store"
        )

    def _attempt(
        self, method: str, path: str, body: bytes | None, size: int | None, deadline: float, url: str
    ) -> tuple[int, bytes | None]:
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Transient(f"total deadline of {self.deadline:g}s passed")
            return left

        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=min(self.connect_timeout, remaining()))
        try:
            try:
                conn.connect()
            except (OSError, http.client.HTTPException) as exc:
                raise _Transient(f"cannot connect: {_describe(exc)}") from exc
            # Keep our own reference: http.client drops conn.sock once a `Connection: close`
            # response takes the socket over, and we still set read timeouts on it.
            sock = conn.sock
            if not isinstance(sock, socket.socket):
                raise _Transient("connection has no socket after connect")
            try:
                sock.settimeout(min(self.read_timeout, remaining()))
                headers = dict(self._headers)
                if body is not None:
                    headers["Content-Type"] = "application/octet-stream"
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                if method != "GET" or resp.status != 200:
                    resp.read(4096)  # a short error page; never an unbounded read
                    return resp.status, None
                return 200, self._read_body(sock, resp, size, url, remaining)
            except (OSError, http.client.HTTPException) as exc:
                raise _Transient(_describe(exc)) from exc
        finally:
            conn.close()

    def _read_body(self, sock: socket.socket, resp: http.client.HTTPResponse, size: int | None,
                   url: str, remaining: Callable[[], float]) -> bytes:
        limit = limit_for(size)
        declared = resp.getheader("Content-Length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise _Transient(f"bad Content-Length {show(declared)}") from None
            if (size is not None and length != size) or length > limit:
                raise IntegrityError(
                    f"GET {url}: server declares {length} bytes, expected "
                    f"{size if size is not None else f'at most {limit}'}; not downloaded"
                )
        chunks: list[bytes] = []
        total = 0
        # The response closes the socket itself once a declared length has been read.
        while total <= limit and not resp.isclosed():
            sock.settimeout(min(self.read_timeout, remaining()))
            try:
                chunk = resp.read(min(_CHUNK, limit + 1 - total))
            except http.client.IncompleteRead as exc:
                got = total + len(exc.partial)
                raise _Transient(f"truncated body: got {got} of {got + (exc.expected or 0)} bytes") from exc
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise IntegrityError(f"GET {url}: body longer than the expected {limit} bytes; download stopped")
        if size is not None and total < size:
            raise _Transient(f"truncated body: got {total} of {size} bytes")
        return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "server closed the connection without a response"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
