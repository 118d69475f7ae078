"""The documents of release channels: what they hold, how they are parsed, their canonical bytes.

A release record (``cubinstore/release/v1``) names a channel, a version, a manifest digest, an
expiry and the signer's key id; a signature blob (``cubinstore/signature/v1``) holds an
Ed25519 signature over the record's exact bytes; a trust policy (``cubinstore/trust/v1``)
names the keys allowed per channel; a host's channel state (``cubinstore/channel-state/v2``)
remembers, per signer, the highest release it accepted. Parsing is strict (a duplicate key, a
non-canonical record, an unknown key is refused) and does no I/O, except `TrustPolicy.load`
reading the policy file.

``cryptography`` is imported by `crypto` alone, when a signature is made or checked.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, TrustError
from cubinstore._core.userfile import open_regular

__all__ = [
    "CHANNEL_PREFIX",
    "MAX_SMALL_BLOB",
    "MAX_STATE_BYTES",
    "MAX_STATE_KEYS",
    "POLICY_SCHEMA",
    "RECORD_SCHEMA",
    "SIGNATURE_SCHEMA",
    "STATE_SCHEMA",
    "Accepted",
    "ChannelState",
    "ReleaseRecord",
    "SignatureBlob",
    "TrustPolicy",
    "channel_name",
    "format_time",
    "key_id",
    "parse_state",
]

RECORD_SCHEMA = "cubinstore/release/v1"
SIGNATURE_SCHEMA = "cubinstore/signature/v1"
POLICY_SCHEMA = "cubinstore/trust/v1"
STATE_SCHEMA = "cubinstore/channel-state/v2"
STATE_SCHEMA_V1 = "cubinstore/channel-state/v1"  # read, never written
CHANNEL_PREFIX = "channel:"
_CHANNEL_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
KEY_ID_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_TIME_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z", re.ASCII)
PUBLIC_PREFIX = "ed25519:"
MAX_SMALL_BLOB = 4096       # a record, a signature or a pointer: read no further than this
MAX_STATE_BYTES = 16384     # a host's channel state (MAX_STATE_KEYS signers)
MAX_STATE_KEYS = 64
MAX_POLICY_BYTES = 1 << 20
MAX_VERSION = 2**63 - 1


# -- small helpers ----------------------------------------------------------------------------------

def channel_name(name: object) -> str:
    """Validate a channel name (it becomes a URL and a file name): ``[a-z0-9][a-z0-9._-]{0,63}``."""
    if not isinstance(name, str) or not _CHANNEL_RE.fullmatch(name):
        raise BadArgumentError(f"invalid channel name {show(name)}: expected [a-z0-9][a-z0-9._-]{{0,63}}")
    return name


def key_id(public_raw: bytes) -> str:
    """The id of an Ed25519 public key: the sha256 hex of its 32 raw bytes."""
    return hashlib.sha256(public_raw).hexdigest()


def canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


def format_time(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def parse_time(text: object, where: str) -> int:
    if not isinstance(text, str) or not _TIME_RE.fullmatch(text):
        raise TrustError(f"{where}: expected a UTC time YYYY-MM-DDTHH:MM:SSZ, got {show(text)}")
    try:
        return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        raise TrustError(f"{where}: not a valid date {show(text)}") from None


def json_object(raw: bytes, where: str, schema: str, keys: frozenset[str]) -> dict[str, Any]:
    # The strict parser: a duplicate key is refused (never "the last wins": a policy with
    # "revoked" twice would drop a revocation), as are NaN and deep nesting.
    doc = loads_strict(raw, where, TrustError)
    if not isinstance(doc, dict):
        raise TrustError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != schema:
        raise TrustError(f"{where}: schema: expected {schema!r}, got {show(doc.get('schema'))}")
    if set(doc) != keys:
        missing, extra = sorted(keys - set(doc)), sorted(set(doc) - keys)
        raise TrustError(f"{where}: expected keys {', '.join(sorted(keys))}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unknown {', '.join(map(show, extra))}" if extra else ""))
    return doc


def check_version(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise TrustError(f"{where}: version: expected an integer 1..{MAX_VERSION}, got {show(value)}")
    return value


def crypto() -> Any:
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise TrustError(
            "signed channels need the `cryptography` package (pip install 'cubinstore[trust]'); "
            f"it could not be imported: {exc}"
        ) from exc
    return ed25519, serialization, InvalidSignature



# -- the record and its signature ---------------------------------------------------------------

_RECORD_KEYS = frozenset({"schema", "channel", "version", "manifest", "expires", "key"})
_SIGNATURE_KEYS = frozenset({"schema", "record", "key", "algorithm", "signature"})


@dataclass(frozen=True)
class ReleaseRecord:
    """What a signer vouches for: this channel's release ``version`` is ``manifest`` until ``expires``."""

    channel: str
    version: int
    manifest: Digest
    expires: int  # seconds since the epoch, UTC
    key: str  # the signer's key id
    raw: bytes

    @property
    def digest(self) -> Digest:
        return Digest.of(self.raw)

    @classmethod
    def build(cls, channel: str, version: int, manifest: Digest, expires: int, key: str) -> ReleaseRecord:
        doc = {"schema": RECORD_SCHEMA, "channel": channel_name(channel), "version": version,
               "manifest": str(manifest), "expires": format_time(expires), "key": key}
        return cls.from_bytes(canonical(doc), source="<new record>")

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> ReleaseRecord:
        where = f"release record {source}"
        if len(raw) > MAX_SMALL_BLOB:
            raise TrustError(f"{where}: {len(raw)} bytes, expected at most {MAX_SMALL_BLOB}")
        doc = json_object(raw, where, RECORD_SCHEMA, _RECORD_KEYS)
        if raw != canonical(doc):  # one byte string per record: what is signed is what is parsed
            raise TrustError(f"{where}: not in canonical form (sorted keys, compact, ASCII, one newline)")
        try:
            channel = channel_name(doc["channel"])
            manifest = Digest.parse(doc["manifest"])
        except BadArgumentError as exc:
            raise TrustError(f"{where}: {exc}") from None
        key = doc["key"]
        if not isinstance(key, str) or not KEY_ID_RE.fullmatch(key):
            raise TrustError(f"{where}: key: expected a 64-hex key id, got {show(key)}")
        return cls(channel, check_version(doc["version"], where), manifest, parse_time(doc["expires"], f"{where}: expires"),
                   key, bytes(raw))


@dataclass(frozen=True)
class SignatureBlob:
    """An Ed25519 signature by key ``key`` over the exact bytes of the record ``record``."""

    record: Digest
    key: str
    signature: bytes
    raw: bytes

    @property
    def digest(self) -> Digest:
        return Digest.of(self.raw)

    @classmethod
    def build(cls, record: ReleaseRecord, key: str, signature: bytes) -> SignatureBlob:
        doc = {"schema": SIGNATURE_SCHEMA, "record": str(record.digest), "key": key, "algorithm": "ed25519",
               "signature": base64.b64encode(signature).decode("ascii")}
        return cls.from_bytes(canonical(doc), source="<new signature>")

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> SignatureBlob:
        where = f"signature {source}"
        if len(raw) > MAX_SMALL_BLOB:
            raise TrustError(f"{where}: {len(raw)} bytes, expected at most {MAX_SMALL_BLOB}")
        doc = json_object(raw, where, SIGNATURE_SCHEMA, _SIGNATURE_KEYS)
        if doc["algorithm"] != "ed25519":
            raise TrustError(f"{where}: algorithm: expected 'ed25519', got {show(doc['algorithm'])}")
        try:
            record = Digest.parse(doc["record"])
        except BadArgumentError as exc:
            raise TrustError(f"{where}: {exc}") from None
        key = doc["key"]
        if not isinstance(key, str) or not KEY_ID_RE.fullmatch(key):
            raise TrustError(f"{where}: key: expected a 64-hex key id, got {show(key)}")
        try:
            signature = base64.b64decode(doc["signature"], validate=True) if isinstance(doc["signature"], str) else b""
        except binascii.Error:
            signature = b""
        if len(signature) != 64:
            raise TrustError(f"{where}: signature: expected 64 bytes of base64, got {show(doc['signature'])}")
        return cls(record, key, signature, bytes(raw))



# -- the trust policy -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TrustPolicy:
    """Which keys may sign which channel (``cubinstore/trust/v1``), up to which version; revoked key
    ids are refused everywhere, and what they signed never holds a host's floor."""

    channels: Mapping[str, Mapping[str, bytes]]  # channel -> key id -> raw public key
    revoked: frozenset[str]
    source: str
    max_versions: Mapping[str, int] = field(default_factory=dict)  # channel -> highest version allowed

    @classmethod
    def load(cls, path: str | Path) -> TrustPolicy:
        path = Path(path)
        with open_regular(path, "trust policy", TrustError) as f:
            raw = f.read(MAX_POLICY_BYTES + 1)
        if len(raw) > MAX_POLICY_BYTES:
            raise TrustError(f"trust policy {path}: more than {MAX_POLICY_BYTES} bytes")
        return cls.from_bytes(raw, source=str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> TrustPolicy:
        where = f"trust policy {source}"
        doc = json_object(raw, where, POLICY_SCHEMA, frozenset({"schema", "channels", "revoked"}))
        revoked = doc["revoked"]
        if not isinstance(revoked, list) or not all(isinstance(k, str) and KEY_ID_RE.fullmatch(k) for k in revoked):
            raise TrustError(f"{where}: revoked: expected a list of 64-hex key ids, got {show(revoked)}")
        channels_doc = doc["channels"]
        if not isinstance(channels_doc, dict):
            raise TrustError(f"{where}: channels: expected an object, got {show(channels_doc)}")
        channels: dict[str, dict[str, bytes]] = {}
        max_versions: dict[str, int] = {}
        for name, entry in channels_doc.items():
            try:
                channel_name(name)
            except BadArgumentError as exc:
                raise TrustError(f"{where}: channels: {exc}") from None
            if not isinstance(entry, dict) or not {"keys"} <= set(entry) <= {"keys", "max_version"} \
                    or not isinstance(entry["keys"], list) or not entry["keys"]:
                raise TrustError(f"{where}: channels.{name}: expected {{\"keys\": [\"ed25519:<base64>\", ...]"
                                 f"[, \"max_version\": N]}}, got {show(entry)}")
            keys: dict[str, bytes] = {}
            for i, text in enumerate(entry["keys"]):
                public = parse_public(text, f"{where}: channels.{name}.keys[{i}]")
                keys[key_id(public)] = public
            channels[name] = keys
            if "max_version" in entry:
                max_versions[name] = check_version(entry["max_version"], f"{where}: channels.{name}.max_version")
        return cls(channels, frozenset(revoked), source, max_versions)

    def max_version(self, channel: str) -> int:
        """The highest version of ``channel`` this policy accepts (``max_version``, else 2^63-1)."""
        return self.max_versions.get(channel, MAX_VERSION)

    def floor_ignored(self, channel: str, key: str, version: int) -> str | None:
        """Why a version accepted under ``key`` no longer bounds ``channel`` from below (None: it does).

        A revoked key's releases never set a floor: a thief's version 2^63-1 stops locking the
        channel the moment the policy revokes the key, or names a lower ``max_version``."""
        if key in self.revoked:
            return f"key {key} is revoked by {self.source}"
        if version > self.max_version(channel):
            return f"it is above max_version {self.max_version(channel)} of {self.source}"
        return None


def parse_public(text: object, where: str) -> bytes:
    if isinstance(text, str) and text.startswith(PUBLIC_PREFIX):
        try:
            public = base64.b64decode(text[len(PUBLIC_PREFIX):], validate=True)
        except binascii.Error:
            public = b""
        if len(public) == 32:
            return public
    raise TrustError(f"{where}: expected 'ed25519:<base64 of the 32-byte public key>', got {show(text)}")


# -- the host's memory of each channel (rollback protection) ----------------------------------------

@dataclass(frozen=True)
class Accepted:
    """The highest version a host accepted (or signed) under one key, and its signature blob."""

    version: int
    signature: Digest


@dataclass(frozen=True)
class ChannelState:
    """``v1/channels/<NAME>.json``: per signer key id, the highest release this host accepted.

    The floor is the highest of those the policy still lets hold it (``TrustPolicy.floor_ignored``):
    a release signed by a key revoked later, or above the policy's ``max_version``, stops
    bounding the channel. Key id ``""`` is a release remembered by a version 1 state whose
    signer is not known here."""

    channel: str
    keys: Mapping[str, Accepted]

    def floor(self, policy: TrustPolicy | None) -> tuple[str, Accepted] | None:
        """(key id, release) of the highest release that still bounds the channel; None: no floor."""
        held = [(k, a) for k, a in self.keys.items()
                if policy is None or policy.floor_ignored(self.channel, k, a.version) is None]
        return max(held, key=lambda item: (item[1].version, item[0]), default=None)

    def ignored(self, policy: TrustPolicy) -> list[str]:
        """Why each release above the floor no longer holds it (for the log)."""
        floor = self.floor(policy)
        return [f"version {a.version} ({a.signature}): {why}" for k, a in sorted(self.keys.items())
                if (why := policy.floor_ignored(self.channel, k, a.version)) is not None
                and (floor is None or a.version > floor[1].version)]

    def with_release(self, key: str, version: int, signature: Digest) -> ChannelState:
        keys = {**self.keys, key: Accepted(version, signature)}
        if len(keys) > MAX_STATE_KEYS:  # the lowest go first: they bound nothing the others do not
            keep = sorted(keys, key=lambda k: (keys[k].version, k == key), reverse=True)[:MAX_STATE_KEYS]
            keys = {k: keys[k] for k in keep}
        return ChannelState(self.channel, keys)

    def to_bytes(self) -> bytes:
        return canonical({"schema": STATE_SCHEMA, "channel": self.channel,
                           "keys": {k: {"version": a.version, "signature": str(a.signature)} for k, a in self.keys.items()}})


def parse_state(raw: bytes, channel: str, where: str) -> ChannelState | Accepted:
    """The channel state ``raw`` of ``channel`` (``where`` names it in errors).

    A version 1 state (one version, one signature) comes back as its `Accepted` alone: its
    signer is not in it, and the caller reads it from the signature blob."""
    if len(raw) > MAX_STATE_BYTES:
        raise TrustError(f"{where}: more than {MAX_STATE_BYTES} bytes")
    doc = loads_strict(raw, where, TrustError)
    if isinstance(doc, dict) and doc.get("schema") == STATE_SCHEMA_V1:
        doc = json_object(raw, where, STATE_SCHEMA_V1, frozenset({"schema", "channel", "version", "signature"}))
        if doc["channel"] != channel:
            raise TrustError(f"{where}: is for channel {show(doc['channel'])}")
        try:
            return Accepted(check_version(doc["version"], where), Digest.parse(doc["signature"]))
        except BadArgumentError as exc:
            raise TrustError(f"{where}: {exc}") from None
    doc = json_object(raw, where, STATE_SCHEMA, frozenset({"schema", "channel", "keys"}))
    if doc["channel"] != channel:
        raise TrustError(f"{where}: is for channel {show(doc['channel'])}")
    keys_doc = doc["keys"]
    if not isinstance(keys_doc, dict):
        raise TrustError(f"{where}: keys: expected an object of key id -> {{signature, version}}, got {show(keys_doc)}")
    keys: dict[str, Accepted] = {}
    for kid, entry in keys_doc.items():
        if kid != "" and not KEY_ID_RE.fullmatch(kid):
            raise TrustError(f"{where}: keys: expected 64-hex key ids, got {show(kid)}")
        if not isinstance(entry, dict) or set(entry) != {"signature", "version"}:
            raise TrustError(f"{where}: keys.{kid}: expected {{\"signature\": ..., \"version\": N}}, got {show(entry)}")
        try:
            keys[kid] = Accepted(check_version(entry["version"], f"{where}: keys.{kid}"), Digest.parse(entry["signature"]))
        except BadArgumentError as exc:
            raise TrustError(f"{where}: keys.{kid}: {exc}") from None
    return ChannelState(channel, keys)
