"""The OCI distribution protocol, client side, over ``HttpLayer``'s connections, limits and deadlines.

Why not the ``oras`` SDK (or ``requests``): what cubinstore must guarantee lives in how each byte
is read, and ``HttpLayer`` already does it: a body is never read past its expected size, every
receive waits at most the time left of one total deadline, keep-alive connections are pooled
per process, a registry that gives no response at all trips the circuit breaker. The protocol
on top is small (a blob GET/HEAD, a two-request upload, a manifest GET/PUT, a token fetch), so
it is written here rather than wrapped around a library that reads bodies its own way.

What this adds to ``HttpLayer``: any method and headers, the response's headers, the 401
challenge (Basic, or the Bearer token flow), 429/503 ``Retry-After`` within the deadline, and
redirects (a blob GET often goes to object storage): at most ``MAX_REDIRECTS`` hops, never a
loop, never with the ``Authorization`` header, and never to plain HTTP unless the registry itself
is plain HTTP on loopback. A 401 is answered only when the registry's own origin (scheme, host,
port) sent it: one from a redirect target is an error, and no credentials go anywhere for it.
"""

from __future__ import annotations

import email.utils
import http.client
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlencode, urljoin, urlsplit

from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.grammar import decimal
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore.errors import IntegrityError, RemoteUnavailableError
from cubinstore.store.http import RETRY_STATUS, HttpLayer, NoResponse, Transient
from cubinstore.store.oci.auth import Credentials, find_credentials, parse_challenge, realm_allowed
from cubinstore.store.oci.reference import RegistryRef, is_loopback

__all__ = ["MAX_REDIRECTS", "RegistryClient", "Reply"]

_log = get_logger(__name__)

MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_TOKEN_RESPONSE = 64 * 1024
_MAX_AUTH_ROUNDS = 2  # per request: a challenge, then one more if the token expired meanwhile
_MAX_LENGTH_DIGITS = 20  # a Content-Length: 2**64 has 20 digits
_MAX_RETRY_AFTER_CHARS = 64  # delta seconds, or an HTTP date ("Wed, 21 Oct 2015 07:28:00 GMT")
_MAX_RETRY_AFTER = 86400


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header's first value
    body: bytes
    url: str  # where the final response came from (after redirects)

    def error_code(self) -> str:
        """The registry's error code and message from a JSON error body, for a message."""
        try:
            errors = loads_strict(self.body, "error body", RemoteUnavailableError).get("errors") or []
            first = errors[0]
            return f" {show(first.get('code'), 40)}: {show(first.get('message'), 120)}"
        except (RemoteUnavailableError, AttributeError, IndexError, KeyError, TypeError):
            return ""  # not the distribution spec's error document: the status alone says it


class RegistryClient(HttpLayer):
    """Requests to one repository of one registry. Not a store layer itself (``OciLayer`` is):
    it is an ``HttpLayer`` only for its connection pool, deadline reader and circuit breaker."""

    def __init__(self, ref: RegistryRef, *, push: bool = False, credentials: Credentials | None = None,
                 **kwargs: object) -> None:
        super().__init__(ref.http_base, **kwargs)  # type: ignore[arg-type]
        self.ref = ref
        self.actions = "pull,push" if push else "pull"
        self._credentials = credentials
        self._credentials_read = credentials is not None
        self._origin = _origin(self.url)
        self._authorization: str | None = None
        self._auth_lock = threading.Lock()

    @property
    def where(self) -> str:
        """The repository, for messages: ``oci://HOST[:PORT]/REPO``."""
        return self.ref.base

    # -- one request, with retries, authentication and redirects ---------------------------------

    def call(self, method: str, path: str, *, what: str, headers: dict[str, str] | None = None,
             body: bytes | None = None, size: int | None = None, limit: int | None = None,
             ok: frozenset[int] | tuple[int, ...] = (200,)) -> Reply:
        """``method path`` on the registry: the final reply when its status is in ``ok`` or is
        404; ``RemoteUnavailableError`` naming ``what`` for anything else, once retries, the
        deadline or the authentication rounds are spent. A GET 200 body is read as ``HttpLayer``
        reads one: ``size`` bytes exactly, or at most ``limit``."""
        url = f"{self.url}{path}"
        start = time.monotonic()
        if start < self._down_until:
            raise RemoteUnavailableError(f"{what}: {method} {url} skipped: {self.url} {self._down_reason}; "
                                         f"trying it again in {self._down_until - start:.0f}s")
        deadline = start + self.deadline
        last, attempts, auth_rounds, answered = "", 0, 0, False
        while attempts <= self.retries:
            if time.monotonic() >= deadline:
                last = f"total deadline of {self.deadline:g}s passed; last error: {last}"
                break
            attempts += 1
            wait: float | None = None
            try:
                reply = self._attempt_hops(method, path, headers or {}, body, size, limit, deadline, what)
            except NoResponse as exc:
                last = str(exc)
            except Transient as exc:
                answered, last = True, str(exc)
            else:
                answered = True
                if reply.status == 401 and _origin(reply.url) != self._origin:
                    # A redirect target (object storage, or anyone the registry points at) asks for
                    # credentials: they are the registry's alone, so neither they nor a token go there.
                    raise RemoteUnavailableError(
                        f"{what}: {method} {url} was redirected to {show(_short(reply.url), 200)}, which answered "
                        f"HTTP 401; not answered: credentials go only to {self.url}")
                if reply.status == 401 and auth_rounds < _MAX_AUTH_ROUNDS:
                    auth_rounds += 1
                    attempts -= 1  # answering a challenge is not a failed attempt
                    self._authenticate(reply, what, deadline)
                    continue
                if reply.status in ok or reply.status == 404:
                    return reply
                if reply.status == 401:
                    raise RemoteUnavailableError(f"{what}: {method} {url}: HTTP 401 again after authenticating"
                                                 f"{reply.error_code()}; {self._credentials_hint()}")
                if reply.status not in RETRY_STATUS:
                    raise RemoteUnavailableError(f"{what}: {method} {url}: HTTP {reply.status}{reply.error_code()}")
                last = f"HTTP {reply.status}{reply.error_code()}"
                wait = _retry_after(reply.headers.get("retry-after"))
                if wait is not None and time.monotonic() + wait > deadline:
                    raise RemoteUnavailableError(
                        f"{what}: {method} {url}: HTTP {reply.status}, asked to retry after {wait:g}s, past the "
                        f"total deadline of {self.deadline:g}s (CUBINSTORE_HTTP_DEADLINE)")
            _log.debug("%s %s attempt %d failed: %s", method, url, attempts, last)
            if attempts <= self.retries:
                pause = wait if wait is not None else (
                    min(self.max_backoff, self.backoff * 2 ** (attempts - 1)) * random.uniform(0.5, 1.0))
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        if not answered:
            self._down_until = time.monotonic() + self.breaker_reset
            self._down_reason = f"gave no response to {attempts} attempt{'s' * (attempts != 1)} ({last})"
        raise RemoteUnavailableError(
            f"{what}: {method} {url} failed after {attempts} attempt{'s' * (attempts != 1)} in "
            f"{time.monotonic() - start:.1f}s: {last}; check the registry, or set CUBINSTORE_OFFLINE=1 to use "
            "only the local store")

    def _attempt_hops(self, method: str, path: str, headers: dict[str, str], body: bytes | None, size: int | None,
                      limit: int | None, deadline: float, what: str) -> Reply:
        """One attempt: the request to the registry, then its redirects (GET and HEAD only)."""
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoResponse(f"total deadline of {self.deadline:g}s passed")
            return left

        sent = dict(headers)
        with self._auth_lock:
            if self._authorization:
                sent["Authorization"] = self._authorization
        reply = self._on_registry(method, path, sent, body, size, limit, remaining)
        seen = [reply.url]
        while reply.status in _REDIRECTS and method in ("GET", "HEAD"):
            location = reply.headers.get("location")
            if not location:
                raise RemoteUnavailableError(f"{what}: {method} {reply.url}: HTTP {reply.status} without a Location")
            target = urljoin(reply.url, location)
            if target in seen:
                raise RemoteUnavailableError(f"{what}: redirect loop: {' -> '.join(map(_short, [*seen, target]))}")
            if len(seen) > MAX_REDIRECTS:
                raise RemoteUnavailableError(f"{what}: more than {MAX_REDIRECTS} redirects from {self.url}{path}")
            seen.append(target)
            reply = self._elsewhere(method, target, size, limit, remaining, what)
        return reply

    def _on_registry(self, method: str, path: str, headers: dict[str, str], body: bytes | None, size: int | None,
                     limit: int | None, remaining: Callable[[], float]) -> Reply:
        """The request on a pooled keep-alive connection to the registry (a reused one that gave
        no response is tried once more on a fresh one, as ``HttpLayer`` does)."""
        url = f"{self.url}{path}"
        conn, reused = self._connection(min(self.connect_timeout, remaining()))
        try:
            return self._exchange_full(conn, method, path, headers, body, size, limit, url, remaining, pooled=True)
        except NoResponse:
            if not reused:
                raise
        conn = self._new_connection(min(self.connect_timeout, remaining()))
        return self._exchange_full(conn, method, path, headers, body, size, limit, url, remaining, pooled=True)

    def _elsewhere(self, method: str, url: str, size: int | None, limit: int | None,
                   remaining: Callable[[], float], what: str) -> Reply:
        """A redirect hop: a fresh connection, no Authorization, HTTPS unless both the registry and the
        target are plain HTTP on loopback (a registry elsewhere must not steer us to local services)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise RemoteUnavailableError(f"{what}: redirect to a malformed URL {show(_short(url))}") from None
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise RemoteUnavailableError(f"{what}: redirect to {show(_short(url))}: expected an http(s) URL")
        if parts.scheme == "http" and not (self.ref.plain_loopback and is_loopback(host)):
            raise RemoteUnavailableError(f"{what}: redirect to plain HTTP {show(_short(url), 200)} refused (HTTPS only, "
                                         f"unless the registry itself is plain HTTP on loopback; it is {self.url})")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=min(self.connect_timeout, remaining()))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return self._exchange_full(conn, method, target, {}, None, size, limit, url, remaining, pooled=False)

    def _exchange_full(self, conn: http.client.HTTPConnection, method: str, target: str, headers: dict[str, str],
                       body: bytes | None, size: int | None, limit: int | None, url: str,
                       remaining: Callable[[], float], *, pooled: bool) -> Reply:
        """``HttpLayer._request`` with its answer as a ``Reply``; the connection goes back to the pool
        only after a whole response from the registry itself (``pooled``)."""
        status, found, data = self._request(conn, method, target, headers, body, size, url, limit, remaining,
                                            pooled=pooled)
        return Reply(status, found, data, url)

    # -- authentication ------------------------------------------------------------------------

    def _creds(self) -> Credentials | None:
        with self._auth_lock:
            if not self._credentials_read:
                self._credentials = find_credentials(self.ref.registry, self.ref.repository)
                self._credentials_read = True
            return self._credentials

    def _credentials_hint(self) -> str:
        creds = self._creds()
        if creds is None:
            return (f"no credentials for {self.ref.registry} in REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/"
                    f"auth.json or ~/.docker/config.json (`skopeo login {self.ref.registry}` writes them)")
        return f"the registry refused the credentials for {self.ref.registry} from {creds.source}"

    def _authenticate(self, reply: Reply, what: str, deadline: float) -> None:
        """Answer a 401: Basic with the stored credentials, or fetch a Bearer token from the realm."""
        where = f"{what}: {self.ref.registry}"
        challenge = parse_challenge(reply.headers.get("www-authenticate"), where)
        creds = self._creds()
        if challenge.scheme == "basic":
            if creds is None:
                raise RemoteUnavailableError(f"{where} asks for a password (Basic); {self._credentials_hint()}")
            if not self.ref.https and not self.ref.plain_loopback:
                raise RemoteUnavailableError(f"{where}: refusing to send a password over plain HTTP")
            value = creds.basic()
        else:
            value = "Bearer " + self._token(challenge.params, creds, where, deadline)
        with self._auth_lock:
            self._authorization = value

    def _token(self, params: dict[str, str], creds: Credentials | None, where: str, deadline: float) -> str:
        realm = params.get("realm", "")
        refused = realm_allowed(realm, self.ref)
        if refused is not None:
            raise RemoteUnavailableError(f"{where} for {self.ref.base}: token realm {show(_short(realm))} refused: "
                                         f"{refused}; credentials are never sent there")
        query = {"scope": f"repository:{self.ref.repository}:{self.actions}"}
        if params.get("service"):
            query["service"] = params["service"]
        parts = urlsplit(realm)
        target = (parts.path or "/") + "?" + ((parts.query + "&") if parts.query else "") + urlencode(query)
        headers = {"Authorization": creds.basic()} if creds is not None else {}
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoResponse(f"total deadline of {self.deadline:g}s passed")
            return left

        try:
            conn = cls(parts.hostname or "", parts.port, timeout=min(self.connect_timeout, remaining()))
            reply = self._exchange_full(conn, "GET", target, headers, None, None, _MAX_TOKEN_RESPONSE,
                                        f"{parts.scheme}://{parts.netloc}{parts.path}", remaining, pooled=False)
        except (Transient, IntegrityError) as exc:
            raise RemoteUnavailableError(f"{where}: token request to {_short(realm)} failed: {exc}") from None
        if reply.status != 200:
            hint = f"; {self._credentials_hint()}" if reply.status in (401, 403) else ""
            raise RemoteUnavailableError(f"{where}: token request to {_short(realm)}: HTTP {reply.status}{hint}")
        doc = loads_strict(reply.body, f"{where}: token realm {_short(realm)} answered", RemoteUnavailableError)
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token or not token.isascii() or any(c in token for c in "\r\n\0 "):
            raise RemoteUnavailableError(f"{where}: token realm {_short(realm)} answered without a usable token")
        return token

    # -- the distribution API ------------------------------------------------------------------

    def blob_path(self, digest: Digest) -> str:
        return f"/v2/{self.ref.repository}/blobs/{digest}"

    def blob_url(self, digest: Digest) -> str:
        return f"{self.where}@{digest}"

    def get_blob(self, digest: Digest, size: int | None, *, limit: int | None = None, what: str = "") -> bytes | None:
        """The blob's bytes (unverified: at most ``size`` or ``limit`` + 1), or None on 404."""
        reply = self.call("GET", self.blob_path(digest), size=size, limit=limit,
                          what=what or f"blob {digest} of {self.where}")
        return None if reply.status == 404 else reply.body

    def head_blob(self, digest: Digest) -> int | None:
        """The blob's size as the registry declares it, or None when it lacks the blob."""
        reply = self.call("HEAD", self.blob_path(digest), what=f"blob {digest} of {self.where}")
        if reply.status == 404:
            return None
        length = reply.headers.get("content-length")
        if length is None:
            return -1  # not declared: present, size unknown
        found = decimal(length.strip(), _MAX_LENGTH_DIGITS)
        if found is None:
            raise RemoteUnavailableError(f"blob {digest} of {self.where}: HEAD {self.url}{self.blob_path(digest)} "
                                         f"declares Content-Length {show(length, 40)}: expected 1 to "
                                         f"{_MAX_LENGTH_DIGITS} ASCII digits")
        return found

    def put_blob(self, digest: Digest, data: bytes) -> None:
        """Upload ``data`` (verified by the caller) as ``digest``: POST an upload, PUT the bytes
        (the monolithic upload). An upload that fails part-way is begun again once."""
        what = f"upload of blob {digest} to {self.where}"
        for attempt in (1, 2):
            try:
                start = self.call("POST", f"/v2/{self.ref.repository}/blobs/uploads/", body=b"", ok=(202,), what=what)
                if start.status != 202:
                    raise RemoteUnavailableError(f"{what}: POST answered HTTP {start.status}")
                location = self._same_origin(start.headers.get("location"), what)
                sep = "&" if "?" in location else "?"
                done = self.call("PUT", f"{location}{sep}digest={quote(str(digest), safe='')}", body=bytes(data),
                                 headers={"Content-Type": "application/octet-stream"}, ok=(201, 204), what=what)
                if done.status == 404:
                    raise RemoteUnavailableError(f"{what}: the upload session vanished (HTTP 404)")
                return
            except RemoteUnavailableError:
                if attempt == 2:
                    raise

    def _same_origin(self, location: str | None, what: str) -> str:
        """The path (and query) of an upload ``Location``, which must be on the registry itself:
        the bytes and the Authorization header go there."""
        if not location:
            raise RemoteUnavailableError(f"{what}: the registry gave no upload Location")
        absolute = urljoin(self.url + "/", location)
        if _origin(absolute) != self._origin:
            raise RemoteUnavailableError(f"{what}: upload Location {show(_short(absolute))} is not on {self.url}")
        parts = urlsplit(absolute)
        return parts.path + (f"?{parts.query}" if parts.query else "")

    def get_manifest(self, reference: str, accept: str, limit: int, what: str) -> tuple[bytes, str] | None:
        """(bytes, content type) of the manifest ``reference`` (a tag or digest), at most ``limit``
        bytes (a longer one is refused unread); None on 404."""
        reply = self.call("GET", f"/v2/{self.ref.repository}/manifests/{reference}", headers={"Accept": accept},
                          limit=limit, what=what)
        if reply.status == 404:
            return None
        return reply.body, reply.headers.get("content-type", "").split(";")[0].strip()

    def put_manifest(self, reference: str, data: bytes, media_type: str, what: str) -> None:
        reply = self.call("PUT", f"/v2/{self.ref.repository}/manifests/{reference}", body=bytes(data),
                          headers={"Content-Type": media_type}, ok=(201,), what=what)
        if reply.status != 201:
            raise RemoteUnavailableError(f"{what}: PUT manifest {reference}: HTTP {reply.status}{reply.error_code()}")


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the port made explicit; None for anything else.
    Where credentials may go is decided by this, never by comparing URL text."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta seconds or an HTTP date), at most a
    day; None (the usual backoff) for a missing, overlong or malformed value."""
    if not value or len(value) > _MAX_RETRY_AFTER_CHARS:
        return None
    value = value.strip()
    seconds = decimal(value, _MAX_RETRY_AFTER_CHARS)
    if seconds is not None:
        return float(min(seconds, _MAX_RETRY_AFTER))
    try:
        when = email.utils.parsedate_to_datetime(value)
        return min(float(_MAX_RETRY_AFTER), max(0.0, when.timestamp() - time.time()))
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _short(url: str) -> str:
    """A URL for a message, without its query (a signed object-storage URL's query is a credential)."""
    return url.split("?", 1)[0] + ("?***" if "?" in url else "")
