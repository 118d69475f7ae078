"""HTTP store speaking the Bazel HTTP cache protocol: ``GET``/``PUT <base>/cas/<hex>``.

Works with nginx (WebDAV), bazel-remote and any static file server. Every request
has a connect timeout, a read timeout and a share of one total deadline; transient
failures (5xx, 408, 429, timeouts, resets, truncated bodies) are retried with jittered
exponential backoff; a body is never read past the expected size.
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from cubinstore._core import knobs as _env
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.store.action_result import MAX_ACTION_RESULT_BYTES
from cubinstore.store.layer import Layer, limit_for
from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError, IntegrityError, RemoteUnavailableError

__all__ = ["RETRY_STATUS", "HttpLayer", "NoResponse", "Transient", "redact"]

_log = get_logger(__name__)

_MAX_ERROR_BODY = 4096  # bytes of a non-200 answer read, for its message
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_PUT_OK = frozenset({200, 201, 204})
_CHUNK = 1 << 16
_MAX_IDLE = 64  # idle keep-alive connections kept per remote (a prefetch runs up to CUBINSTORE_FETCH_JOBS at once)


class Transient(Exception):
    """A failure worth retrying; the message says what happened."""


class NoResponse(Transient):
    """No HTTP response at all (timeout, refused, reset, deadline): what trips the circuit breaker."""


_USERINFO_RE = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^?#]*@", re.ASCII)


def redact(url: object) -> str:
    """``show(url)`` with any ``user:password@`` (and any query) replaced by ``***``.

    Works on malformed URLs too, which is where it matters: an error about a bad port must
    not print the password before it. Everything up to the last ``@`` before a query is
    treated as userinfo, so a password holding ``/`` or ``@`` is hidden whole.
    """
    if not isinstance(url, str):
        return show(url)
    text = _USERINFO_RE.sub(lambda m: f"{m.group(1) or ''}***@", url, count=1)
    if "?" in text:
        text = text.split("?", 1)[0] + "?***"
    return show(text)


class HttpLayer(Layer):
    """A remote CAS at ``url`` (``http://`` or ``https://``; a path prefix is allowed)."""

    remote = True

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
        breaker_reset: float = 60.0,
    ) -> None:
        if not isinstance(url, str):
            raise BadArgumentError(f"invalid remote URL {redact(url)}: expected a string")
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError:
            raise BadArgumentError(f"invalid remote URL {redact(url)}: bad port or host") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadArgumentError(f"invalid remote URL {redact(url)}: expected http://HOST[:PORT][/PREFIX] or https://...")
        if parts.query or parts.fragment or any(c in url for c in "\r\n\0 "):
            raise BadArgumentError(f"invalid remote URL {redact(url)}: no query, fragment, spaces or control characters allowed")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port
        self._prefix = parts.path.rstrip("/")
        # HTTP/1.1 keep-alive: one TCP (and TLS) handshake per connection, not per blob.
        self._headers = {"User-Agent": "cubinstore"}
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
        # Circuit breaker: after a request got no response at all (black hole, refused, timed
        # out), requests fail at once for ``breaker_reset`` seconds, so the next remote serves
        # instead of every blob waiting out its own deadline here.
        self.breaker_reset = breaker_reset
        self._down_until = 0.0
        self._down_reason = ""
        self._idle: list[http.client.HTTPConnection] = []
        self._idle_lock = threading.Lock()
        self._idle_pid = os.getpid()

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

    def get_named(self, name: str, limit: int) -> bytes | None:
        """GET ``<url>/<name>`` (a channel pointer: mutable, so the caller verifies what it names)
        as at most ``limit`` bytes; None on 404. ``name`` must be a validated relative path."""
        status, data = self._with_retries("GET", f"{self._prefix}/{name}", None, None, limit=limit)
        return None if status == 404 else data

    def put_named(self, name: str, data: bytes) -> None:
        """PUT ``data`` at ``<url>/<name>`` (a channel pointer)."""
        self._with_retries("PUT", f"{self._prefix}/{name}", bytes(data), None)

    # -- action cache (the Bazel HTTP cache protocol's /ac/) -------------------------------------

    def get_action_result(self, action_hex: str) -> bytes | None:
        """GET ``<url>/ac/<action_hex>``: the entry's bytes, unparsed and unverified (at most
        ``MAX_ACTION_RESULT_BYTES``; a longer one raises ``IntegrityError`` unread), or None on
        404. ``action_result.decode_action_result`` parses them."""
        status, data = self._with_retries("GET", self._ac_path(action_hex), None, None, limit=MAX_ACTION_RESULT_BYTES)
        return None if status == 404 else data

    def put_action_result(self, action_hex: str, data: bytes) -> None:
        """PUT an encoded ``ActionResult`` at ``<url>/ac/<action_hex>`` (trusted writers only:
        anyone who can write here decides what a key maps to)."""
        path = self._ac_path(action_hex)
        if len(data) > MAX_ACTION_RESULT_BYTES:
            raise BadArgumentError(f"action result for {action_hex} is {len(data)} bytes, over the "
                                   f"{MAX_ACTION_RESULT_BYTES}-byte limit its readers enforce")
        self._with_retries("PUT", path, bytes(data), None)
        _log.debug("stored action result %s (%d bytes) at %s", action_hex, len(data), self.url)

    def _ac_path(self, action_hex: str) -> str:
        try:
            return f"{self._prefix}/ac/{Digest(action_hex).hex}"  # validated before it is part of a path
        except BadArgumentError as exc:
            raise BadArgumentError(f"invalid action digest for {self.url}/ac/: {exc}") from None

    # -- HTTP machinery -------------------------------------------------------------------------

    def _with_retries(self, method: str, path: str, body: bytes | None, size: int | None,
                      limit: int | None = None) -> tuple[int, bytes | None]:
        url = f"{self.url}{path[len(self._prefix):]}"
        start = time.monotonic()
        if start < self._down_until:
            raise RemoteUnavailableError(
                f"{method} {url} skipped: {self.url} {self._down_reason}; trying it again in "
                f"{self._down_until - start:.0f}s"
            )
        deadline = start + self.deadline
        last = ""
        attempts = 0
        answered = False
        for attempt in range(self.retries + 1):
            if time.monotonic() >= deadline:
                if not last.startswith("total deadline"):
                    last = f"total deadline of {self.deadline:g}s passed; last error: {last}"
                break
            attempts += 1
            try:
                status, data = self._attempt(method, path, body, size, deadline, url, limit)
            except NoResponse as exc:
                last = str(exc)
                _log.debug("%s %s attempt %d failed: %s", method, url, attempts, last)
            except Transient as exc:
                answered = True
                last = str(exc)
                _log.debug("%s %s attempt %d failed: %s", method, url, attempts, last)
            else:
                answered = True
                if method == "GET" and status in (200, 404):
                    return status, data
                if method == "PUT" and status in _PUT_OK:
                    return status, None
                if status not in RETRY_STATUS:
                    hint = "; does the server accept PUT (WebDAV)?" if method == "PUT" and status in (403, 405) else ""
                    raise RemoteUnavailableError(f"{method} {url}: HTTP {status}, not retried{hint}")
                last = f"HTTP {status}"
                _log.debug("%s %s attempt %d: HTTP %d", method, url, attempts, status)
            if attempt < self.retries:
                pause = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        if not answered:
            self._down_until = time.monotonic() + self.breaker_reset
            self._down_reason = f"gave no response to {attempts} attempt{'s' * (attempts != 1)} ({last})"
            _log.info("remote %s is not answering (%s); skipping it for %gs", self.url, last, self.breaker_reset)
        raise RemoteUnavailableError(
            f"{method} {url} failed after {attempts} attempt{'s' * (attempts != 1)} "
            f"in {time.monotonic() - start:.1f}s: {last}; check the server, or set CUBINSTORE_OFFLINE=1 "
            "to use only the local store"
        )

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle keep-alive connection (True) or a new, unconnected one (False)."""
        with self._idle_lock:
            if self._idle_pid != os.getpid():  # forked: the parent's sockets are not ours to use
                self._idle, self._idle_pid = [], os.getpid()
            conn = self._idle.pop() if self._idle else None
        return (conn, True) if conn is not None else (self._new_connection(timeout), False)

    def _new_connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _keep(self, conn: http.client.HTTPConnection) -> None:
        with self._idle_lock:
            if self._idle_pid == os.getpid() and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle keep-alive connections (they also close when the process exits)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _attempt(
        self, method: str, path: str, body: bytes | None, size: int | None, deadline: float, url: str,
        limit: int | None = None,
    ) -> tuple[int, bytes | None]:
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoResponse(f"total deadline of {self.deadline:g}s passed")
            return left

        conn, reused = self._connection(min(self.connect_timeout, remaining()))
        try:
            return self._exchange(conn, method, path, body, size, url, limit, remaining)
        except NoResponse:
            if not reused:
                raise
        # The server may close an idle connection at any time (nginx's keepalive_timeout): a
        # reused one that gave no response is retried once on a new one, not counted as a failure.
        conn = self._new_connection(min(self.connect_timeout, remaining()))
        return self._exchange(conn, method, path, body, size, url, limit, remaining)

    def _exchange(
        self, conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, size: int | None,
        url: str, limit: int | None, remaining: Callable[[], float],
    ) -> tuple[int, bytes | None]:
        """One request on ``conn``: the status, and the verified-size body of a GET that answered 200."""
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        status, _, data = self._request(conn, method, path, headers, body, size, url, limit, remaining)
        return status, (data if method == "GET" and status == 200 else None)

    def _request(
        self, conn: http.client.HTTPConnection, method: str, target: str, headers: dict[str, str],
        body: bytes | None, size: int | None, url: str, limit: int | None, remaining: Callable[[], float],
        *, pooled: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request on ``conn`` (this store's headers, then ``headers``): the status, the response's
        headers (names in lower case, a repeated name's first value) and its body: a GET's 200 read
        within ``size``/``limit``, anything else at most 4 KiB (a short error page; none for HEAD).
        The connection is kept for the next request only when ``pooled`` and after a clean, whole response."""
        # Every receive (status line, headers, body) waits at most the time left, so a server
        # that sends one byte a second cannot stretch the deadline; see _DeadlineReader.
        conn.response_class = functools.partial(_DeadlineResponse, remaining=remaining, read_timeout=self.read_timeout)
        got_response = False
        keep = False
        resp: http.client.HTTPResponse | None = None
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except (OSError, http.client.HTTPException) as exc:
                    raise NoResponse(f"cannot connect: {_describe(exc)}") from exc
            sock = conn.sock
            if not isinstance(sock, socket.socket):
                raise Transient("connection has no socket after connect")
            try:
                # sendall's timeout bounds the whole send, not each chunk.
                sock.settimeout(min(self.read_timeout, remaining()))
                conn.request(method, target, body=body, headers={**self._headers, **headers})
                resp = conn.getresponse()
                got_response = True
                found = {k.lower(): v for k, v in reversed(resp.getheaders())}  # the first of repeated names
                if method == "GET" and resp.status == 200:
                    data = self._read_body(resp, size, url, limit)
                else:
                    data = resp.read(_MAX_ERROR_BODY) if method != "HEAD" else b""  # never an unbounded read
                keep = pooled and resp.isclosed() and not resp.will_close  # whole body read, server keeps it
                return resp.status, found, data
            except (OSError, http.client.HTTPException) as exc:
                raise (Transient if got_response else NoResponse)(_describe(exc)) from exc
        finally:
            if keep:
                self._keep(conn)
            else:
                # A response left half read holds the socket past conn.close() (the server would
                # go on sending while an exception's traceback keeps it): close both.
                if resp is not None:
                    resp.close()
                conn.close()

    def _read_body(self, resp: http.client.HTTPResponse, size: int | None, url: str, limit: int | None = None) -> bytes:
        limit = limit_for(size) if limit is None else limit
        declared = resp.getheader("Content-Length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise Transient(f"bad Content-Length {show(declared)}") from None
            if (size is not None and length != size) or length > limit:
                raise IntegrityError(
                    f"GET {url}: server declares {length} bytes, expected "
                    f"{size if size is not None else f'at most {limit}'}; not downloaded"
                )
        chunks: list[bytes] = []
        total = 0
        # The response closes the socket itself once a declared length has been read.
        while total <= limit and not resp.isclosed():
            try:
                chunk = resp.read(min(_CHUNK, limit + 1 - total))
            except http.client.IncompleteRead as exc:
                got = total + len(exc.partial)
                raise Transient(f"truncated body: got {got} of {got + (exc.expected or 0)} bytes") from exc
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise IntegrityError(f"GET {url}: body longer than the expected {limit} bytes; download stopped")
        if size is not None and total < size:
            raise Transient(f"truncated body: got {total} of {size} bytes")
        return b"".join(chunks)


class _DeadlineReader(io.RawIOBase):
    """The socket as a raw stream whose every receive waits at most the time left (and at most
    the read timeout). http.client's buffered reads loop over receives until they have what
    they asked for; bounding each receive by the remaining time bounds the whole response."""

    def __init__(self, sock: socket.socket, remaining: Callable[[], float], read_timeout: float) -> None:
        super().__init__()
        self._sock = sock
        # A socket file keeps the descriptor open after http.client closes the connection
        # object, which it does as soon as a `Connection: close` response has its headers.
        self._raw = sock.makefile("rb", buffering=0)
        self._remaining = remaining
        self._read_timeout = read_timeout

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        self._sock.settimeout(min(self._read_timeout, self._remaining()))
        view = memoryview(b)
        return self._raw.readinto(view[: min(len(view), _CHUNK)]) or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: Any, remaining: Callable[[], float], read_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # http.client's own unbounded reader, replaced before anything was read
        self.fp = io.BufferedReader(_DeadlineReader(sock, remaining, read_timeout), _CHUNK)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "server closed the connection without a response"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
