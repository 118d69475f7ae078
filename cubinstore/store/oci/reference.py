"""``oci://HOST[:PORT]/REPO[:TAG][@sha256:HEX]``: where a release lies in an OCI registry, parsed once.

The grammar is the distribution spec's (repository path components, tag), checked before any
byte is sent, so a repository or tag is always safe to put in a URL path. ``oci://`` is HTTPS,
except on loopback (a test or a local registry), where plain HTTP is used; ``oci+http://``
asks for plain HTTP anywhere, ``oci+https://`` for TLS on loopback too. Credentials never go
in the URL: they come from the files container tools write (``auth.py``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from cubinstore._core.digest import Digest
from cubinstore._core.grammar import decimal
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError

__all__ = ["LAYOUT_SCHEME", "SCHEMES", "RegistryRef", "is_loopback", "is_oci_url"]

#: The URL schemes of a registry remote.
SCHEMES = ("oci://", "oci+http://", "oci+https://")
#: An OCI image layout directory (``layout.OciLayout``).
LAYOUT_SCHEME = "oci-layout:"

# The distribution spec's grammar: path components of lowercase alphanumerics joined by
# separators, and tags of at most 128 characters.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*", re.ASCII)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", re.ASCII)
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
                   re.ASCII)
_MAX_REPOSITORY = 255


def is_oci_url(text: object) -> bool:
    """Whether ``text`` is meant as a registry reference (then ``RegistryRef.parse`` says if it is a good one)."""
    return isinstance(text, str) and text.startswith(SCHEMES)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class RegistryRef:
    """A parsed registry reference. ``tag`` and ``digest`` are None when not given."""

    https: bool
    host: str  # a DNS name or an IP address, without brackets
    port: int | None
    repository: str
    tag: str | None = None
    digest: Digest | None = None

    @classmethod
    def parse(cls, text: object, *, what: str = "registry reference") -> RegistryRef:
        if not isinstance(text, str) or not is_oci_url(text):
            raise BadArgumentError(f"invalid {what} {show(text)}: expected oci://HOST[:PORT]/REPOSITORY[:TAG][@sha256:HEX]")
        if any(c in text for c in "\r\n\t\0 ?#\\"):
            raise BadArgumentError(f"invalid {what} {show(text)}: no spaces, control characters, query or fragment")
        scheme, rest = text.split("://", 1)
        if "@" in rest.split("/", 1)[0]:
            raise BadArgumentError(f"invalid {what} {show(_redact_userinfo(text))}: no credentials in the URL; "
                                   "they are read from REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json "
                                   "or ~/.docker/config.json (`skopeo login` / `docker login` write them)")
        authority, _, path = rest.partition("/")
        host, port = _authority(authority, text, what)
        digest = None
        if "@" in path:
            path, _, pinned = path.partition("@")
            try:
                digest = Digest.parse(pinned)
            except BadArgumentError as exc:
                raise BadArgumentError(f"invalid {what} {show(text)}: {exc}") from None
        tag = None
        last = path.rsplit("/", 1)[-1]
        if ":" in last:
            path, _, tag = path.rpartition(":")
            if not _TAG.fullmatch(tag):
                raise BadArgumentError(f"invalid tag {show(tag)} in {what} {show(text)}: expected 1-128 of "
                                       "A-Z a-z 0-9 _ . -, not starting with . or -")
        if not path or len(path) > _MAX_REPOSITORY or not _REPOSITORY.fullmatch(path):
            raise BadArgumentError(f"invalid repository {show(path)} in {what} {show(text)}: expected lowercase "
                                   "path components such as team/kernels (a-z 0-9, joined by . _ __ -)")
        https = scheme == "oci+https" or (scheme == "oci" and not is_loopback(host))
        return cls(https=https, host=host, port=port, repository=path, tag=tag, digest=digest)

    @property
    def plain_loopback(self) -> bool:
        """Plain HTTP on a loopback host (a test or a local registry): the one registry whose token
        realm and redirects may be plain HTTP too (on loopback)."""
        return not self.https and is_loopback(self.host)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" if self.port else host

    @property
    def registry(self) -> str:
        """How credential files name this registry: ``HOST[:PORT]``."""
        return self.netloc

    @property
    def base(self) -> str:
        """The repository, without tag or digest, as an ``oci://`` URL that means the same
        (``oci+http://`` only where plain HTTP is not the default)."""
        if self.https:
            scheme = "oci+https" if is_loopback(self.host) else "oci"
        else:
            scheme = "oci" if is_loopback(self.host) else "oci+http"
        return f"{scheme}://{self.netloc}/{self.repository}"

    @property
    def http_base(self) -> str:
        """The registry's HTTP origin: ``https://HOST[:PORT]`` (or ``http://``)."""
        return f"{'https' if self.https else 'http'}://{self.netloc}"

    def __str__(self) -> str:
        return self.base + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def pinned(self, digest: Digest) -> str:
        """This repository's reference to the artifact ``digest`` (what a person pastes to open it)."""
        return f"{self.base}@{digest}"


def _authority(authority: str, text: str, what: str) -> tuple[str, int | None]:
    if authority.startswith("["):
        host, sep, after = authority[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise BadArgumentError(f"invalid host {show(host)} in {what} {show(text)}") from None
        port_text = after[1:] if after.startswith(":") else None
        if not sep or (after and port_text is None):
            raise BadArgumentError(f"invalid host in {what} {show(text)}")
    else:
        host, _, port_text = authority.partition(":")
        port_text = port_text if ":" in authority else None
        if not _HOST.fullmatch(host) or len(host) > 253:
            raise BadArgumentError(f"invalid host {show(host)} in {what} {show(text)}: expected a DNS name or an IP address")
        host = host.lower()
    port = None
    if port_text is not None:
        port = decimal(port_text, 5)
        if port is None or not 0 < port < 65536:
            raise BadArgumentError(f"invalid port {show(port_text)} in {what} {show(text)}: expected 1-65535")
    return host, port


def _redact_userinfo(text: str) -> str:
    scheme, rest = text.split("://", 1)
    authority, slash, path = rest.partition("/")
    return f"{scheme}://***@{authority.rsplit('@', 1)[-1]}{slash}{path}"
