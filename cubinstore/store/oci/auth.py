"""Registry credentials and challenges: read from the files container tools write, never printed.

Credentials come from the first file (``knobs.registry_auth_files``) that has an entry for the
registry (``HOST[:PORT]``, or a longer ``HOST[:PORT]/NAMESPACE`` prefix of the repository, as
containers-auth.json(5) matches). They are sent only to that registry and to a token realm on
the registry's exact host, or on a host ``TOKEN_SERVICES`` names for it (Docker Hub's
``auth.docker.io``): a challenge naming any other realm is refused, not followed. A shared parent
domain is no proof of one owner (``evil.co.uk``, ``attacker.azurecr.io``, any S3 bucket).
A file that is not a regular file (a FIFO, a device) is skipped unread, as an unreadable one is.
Credential helpers (``credHelpers``, ``credsStore``) run programs: not supported, said once.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from cubinstore._core import knobs
from cubinstore._core.abi import loads_strict
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore._core.userfile import open_regular
from cubinstore.errors import BadArgumentError, RemoteUnavailableError
from cubinstore.store.oci.reference import RegistryRef

__all__ = ["DOCKER_HUB_HOSTS", "TOKEN_SERVICES", "Challenge", "Credentials", "find_credentials", "parse_challenge",
           "realm_allowed"]

_log = get_logger(__name__)

_MAX_AUTH_FILE = 1 << 20  # a credentials file is small: a larger one is not read
_MAX_CHALLENGE = 4096

#: The names Docker Hub's registry goes by (its credentials are also filed under its v1 URL).
DOCKER_HUB_HOSTS = frozenset({"registry-1.docker.io", "docker.io", "index.docker.io"})
#: Token realms off the registry's own host, by registry host: known pairs of exact names, nothing
#: matched by suffix. Every other realm must be on the registry's own host.
TOKEN_SERVICES: dict[str, frozenset[str]] = {
    **{host: frozenset({"auth.docker.io"}) for host in DOCKER_HUB_HOSTS},
    "registry.gitlab.com": frozenset({"gitlab.com"}),
}


@dataclass(frozen=True)
class Credentials:
    """A user name and password (or a registry token as password). ``repr`` hides the password."""

    username: str
    password: str = field(repr=False)
    source: str = ""  # the file they came from, for messages

    def basic(self) -> str:
        token = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(token).decode("ascii")


def _load(path: Path) -> dict | None:
    """The file's JSON object; None when it does not exist or cannot be read (a FIFO, a device, a
    directory, no permission), which is logged and skips to the next file."""
    try:
        # open_regular refuses a FIFO or device before any read (a plain open() of a FIFO blocks).
        with open_regular(path, "registry credentials file") as f:
            raw = f.read(_MAX_AUTH_FILE + 1)
    except BadArgumentError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            _log.warning("%s; skipping it", exc)
        return None
    except OSError as exc:
        _log.warning("cannot read registry credentials file %s: %s; skipping it", path, exc.strerror or exc)
        return None
    if len(raw) > _MAX_AUTH_FILE:
        raise BadArgumentError(f"registry credentials file {path}: larger than {_MAX_AUTH_FILE} bytes")
    # loads_strict's messages say where and why, never quote the text (which holds passwords).
    doc = loads_strict(raw, f"registry credentials file {path}", BadArgumentError)
    if not isinstance(doc, dict):
        raise BadArgumentError(f"registry credentials file {path}: expected a JSON object")
    return doc


def _keys_for(registry: str, repository: str) -> list[str]:
    """Entry names that match, most specific first: HOST/ns/repo, HOST/ns, HOST, and docker's URL forms."""
    parts = repository.split("/")
    keys = [f"{registry}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)]
    keys += [registry, f"https://{registry}", f"http://{registry}"]
    if registry in DOCKER_HUB_HOSTS:
        keys.append("https://index.docker.io/v1/")
    return keys


def find_credentials(registry: str, repository: str, files: list[Path] | None = None) -> Credentials | None:
    """The credentials for ``registry`` (``HOST[:PORT]``) and ``repository``, or None."""
    for path in knobs.registry_auth_files() if files is None else files:
        doc = _load(path)
        if doc is None:
            continue
        auths = doc.get("auths")
        if isinstance(auths, dict):
            for key in _keys_for(registry, repository):
                entry = auths.get(key)
                if isinstance(entry, dict):
                    return _decode(entry, path, key)
        helpers = doc.get("credHelpers")
        if (isinstance(helpers, dict) and registry in helpers) or doc.get("credsStore"):
            _log.info("%s names a credential helper for %s; cubinstore runs no helper programs: "
                      "put the credentials in REGISTRY_AUTH_FILE (`skopeo login --authfile`)", path, registry)
    return None


def _decode(entry: dict, path: Path, key: str) -> Credentials | None:
    where = f"registry credentials file {path}, entry {show(key)}"
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            user, sep, password = base64.b64decode(auth, validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise BadArgumentError(f"{where}: 'auth' is not base64 of USER:PASSWORD") from None
        if not sep:
            raise BadArgumentError(f"{where}: 'auth' is not base64 of USER:PASSWORD")
        return Credentials(user, password, str(path))
    user, password = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(password, str):
        return Credentials(user, password, str(path))
    if entry.get("identitytoken"):
        _log.info("%s: an identity token (OAuth refresh token) is not supported; log in with a password or token", where)
    return None


# -- WWW-Authenticate ---------------------------------------------------------------------------

_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,"]*))\s*(?:,|$)')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic" or "bearer"
    params: dict[str, str]


def parse_challenge(header: str | None, where: str) -> Challenge:
    """The first challenge of a ``WWW-Authenticate`` header (registries send one)."""
    if not header:
        raise RemoteUnavailableError(f"{where}: HTTP 401 without a WWW-Authenticate challenge")
    if len(header) > _MAX_CHALLENGE:
        raise RemoteUnavailableError(f"{where}: WWW-Authenticate header longer than {_MAX_CHALLENGE} bytes")
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str] = {}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        match = _PARAM.match(rest, pos)
        if match is None:
            break  # a second challenge, or junk: the parameters read so far are the first one's
        params[match.group(1).lower()] = match.group(2) if match.group(2) is not None else match.group(3)
        pos = match.end()
    scheme = scheme.lower()
    if scheme not in ("basic", "bearer"):
        raise RemoteUnavailableError(f"{where}: unsupported authentication scheme {show(scheme)}; "
                                     "expected Basic or Bearer")
    return Challenge(scheme, params)


def realm_allowed(realm: str, registry: RegistryRef) -> str | None:
    """Why a Bearer realm may not be used (None: it may). Stored credentials go to the realm, so it
    must be HTTPS on the registry's exact host (any port) or on a host ``TOKEN_SERVICES`` pairs
    with it; plain HTTP only when the registry itself is plain HTTP on loopback (its own host)."""
    try:
        parts = urlsplit(realm)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "not a URL"
    if parts.scheme not in ("https", "http") or not host:
        return "not an http(s) URL"
    if parts.scheme == "http" and not registry.plain_loopback:
        return "plain HTTP; credentials only go over HTTPS (or to a plain-HTTP loopback registry's own host)"
    known = TOKEN_SERVICES.get(registry.host, frozenset()) if parts.scheme == "https" else frozenset()
    if host == registry.host or host in known:
        return None
    also = f" nor {' or '.join(sorted(known))}" if known else ""
    return f"host {host} is not the registry's host {registry.host}{also}"
