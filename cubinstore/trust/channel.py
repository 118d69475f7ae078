"""Signed release channels: ``channel:NAME`` resolves to a manifest digest someone trusted signed.

A release record (``cubinstore/release/v1``) names a channel, a version, a manifest digest, an
expiry and the signer's key id; a signature blob (``cubinstore/signature/v1``) holds an
Ed25519 signature over the record's exact bytes. Both are CAS blobs. A channel pointer
(``<remote>/channels/<NAME>``, and ``v1/channels/<NAME>.json`` locally) names the signature
blob; the pointer itself is untrusted: what makes a release acceptable is

* the signature verifies under a key the trust policy allows for that channel and has not revoked;
* the record is for that channel (a record of another channel is not replayable here);
* it has not expired (a frozen or stale channel stops being served: python-tuf's timestamp role);
* its version is not above the policy's ``max_version`` for the channel, not lower than the
  highest this host accepted under a key the policy has not revoked (no rollback; a thief's
  version stops counting once its key is revoked), and an equal version names the same record
  (no fork). Accepting is one compare-and-set on ``v1/channels/<NAME>.json`` under its lock.

Channel documents (pointer, signature, record) are read no further than ``MAX_SMALL_BLOB``
bytes and stored only once accepted; ``v1/channels`` is never reached through a link.

``cryptography`` is imported only here, and only when a policy is loaded, so ``import
cubinstore`` stays stdlib-only.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cubinstore._core import knobs as _env
from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest, show
from cubinstore.store.local.files import open_regular
from cubinstore._core.log import get_logger
from cubinstore.store.local.root import _DIR_FLAGS, NotRegularFile, read_at
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    ExpiredReleaseError,
    IntegrityError,
    LockTimeoutError,
    MissingBlobError,
    RemoteUnavailableError,
    RollbackError,
    StoreError,
    TrustError,
    UnsafeStoreError,
)

if TYPE_CHECKING:
    from cubinstore.store.http import HttpStore
    from cubinstore.store.local.cas import LocalStore
    from cubinstore.store import Store

__all__ = [
    "POLICY_SCHEMA",
    "RECORD_SCHEMA",
    "SIGNATURE_SCHEMA",
    "STATE_SCHEMA",
    "ReleaseRecord",
    "SignatureBlob",
    "TrustPolicy",
    "channel_name",
    "generate_key",
    "key_id",
    "resolve_channel",
    "sign_release",
]

_log = get_logger(__name__)

RECORD_SCHEMA = "cubinstore/release/v1"
SIGNATURE_SCHEMA = "cubinstore/signature/v1"
POLICY_SCHEMA = "cubinstore/trust/v1"
STATE_SCHEMA = "cubinstore/channel-state/v2"
_STATE_SCHEMA_V1 = "cubinstore/channel-state/v1"  # read, never written
CHANNEL_PREFIX = "channel:"
_CHANNEL_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
_KEY_ID_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_TIME_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z", re.ASCII)
_PUBLIC_PREFIX = "ed25519:"
MAX_SMALL_BLOB = 4096       # a record, a signature or a pointer: read no further than this
MAX_STATE_BYTES = 16384     # a host's channel state (MAX_STATE_KEYS signers)
MAX_STATE_KEYS = 64
MAX_POLICY_BYTES = 1 << 20
_MAX_VERSION = 2**63 - 1


# -- small helpers ----------------------------------------------------------------------------------

def channel_name(name: object) -> str:
    """Validate a channel name (it becomes a URL and a file name): ``[a-z0-9][a-z0-9._-]{0,63}``."""
    if not isinstance(name, str) or not _CHANNEL_RE.fullmatch(name):
        raise BadArgumentError(f"invalid channel name {show(name)}: expected [a-z0-9][a-z0-9._-]{{0,63}}")
    return name


def key_id(public_raw: bytes) -> str:
    """The id of an Ed25519 public key: the sha256 hex of its 32 raw bytes."""
    return hashlib.sha256(public_raw).hexdigest()


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


def format_time(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _parse_time(text: object, where: str) -> int:
    if not isinstance(text, str) or not _TIME_RE.fullmatch(text):
        raise TrustError(f"{where}: expected a UTC time YYYY-MM-DDTHH:MM:SSZ, got {show(text)}")
    try:
        return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        raise TrustError(f"{where}: not a valid date {show(text)}") from None


def _json_object(raw: bytes, where: str, schema: str, keys: frozenset[str]) -> dict[str, Any]:
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


def _version(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_VERSION:
        raise TrustError(f"{where}: version: expected an integer 1..{_MAX_VERSION}, got {show(value)}")
    return value


def _crypto() -> Any:
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
        return cls.from_bytes(_canonical(doc), source="<new record>")

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> ReleaseRecord:
        where = f"release record {source}"
        if len(raw) > MAX_SMALL_BLOB:
            raise TrustError(f"{where}: {len(raw)} bytes, expected at most {MAX_SMALL_BLOB}")
        doc = _json_object(raw, where, RECORD_SCHEMA, _RECORD_KEYS)
        if raw != _canonical(doc):  # one byte string per record: what is signed is what is parsed
            raise TrustError(f"{where}: not in canonical form (sorted keys, compact, ASCII, one newline)")
        try:
            channel = channel_name(doc["channel"])
            manifest = Digest.parse(doc["manifest"])
        except BadArgumentError as exc:
            raise TrustError(f"{where}: {exc}") from None
        key = doc["key"]
        if not isinstance(key, str) or not _KEY_ID_RE.fullmatch(key):
            raise TrustError(f"{where}: key: expected a 64-hex key id, got {show(key)}")
        return cls(channel, _version(doc["version"], where), manifest, _parse_time(doc["expires"], f"{where}: expires"),
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
        return cls.from_bytes(_canonical(doc), source="<new signature>")

    @classmethod
    def from_bytes(cls, raw: bytes, *, source: str) -> SignatureBlob:
        where = f"signature {source}"
        if len(raw) > MAX_SMALL_BLOB:
            raise TrustError(f"{where}: {len(raw)} bytes, expected at most {MAX_SMALL_BLOB}")
        doc = _json_object(raw, where, SIGNATURE_SCHEMA, _SIGNATURE_KEYS)
        if doc["algorithm"] != "ed25519":
            raise TrustError(f"{where}: algorithm: expected 'ed25519', got {show(doc['algorithm'])}")
        try:
            record = Digest.parse(doc["record"])
        except BadArgumentError as exc:
            raise TrustError(f"{where}: {exc}") from None
        key = doc["key"]
        if not isinstance(key, str) or not _KEY_ID_RE.fullmatch(key):
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
        doc = _json_object(raw, where, POLICY_SCHEMA, frozenset({"schema", "channels", "revoked"}))
        revoked = doc["revoked"]
        if not isinstance(revoked, list) or not all(isinstance(k, str) and _KEY_ID_RE.fullmatch(k) for k in revoked):
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
                public = _parse_public(text, f"{where}: channels.{name}.keys[{i}]")
                keys[key_id(public)] = public
            channels[name] = keys
            if "max_version" in entry:
                max_versions[name] = _version(entry["max_version"], f"{where}: channels.{name}.max_version")
        return cls(channels, frozenset(revoked), source, max_versions)

    def max_version(self, channel: str) -> int:
        """The highest version of ``channel`` this policy accepts (``max_version``, else 2^63-1)."""
        return self.max_versions.get(channel, _MAX_VERSION)

    def floor_ignored(self, channel: str, key: str, version: int) -> str | None:
        """Why a version accepted under ``key`` no longer bounds ``channel`` from below (None: it does).

        A revoked key's releases never set a floor: a thief's version 2^63-1 stops locking the
        channel the moment the policy revokes the key, or names a lower ``max_version``."""
        if key in self.revoked:
            return f"key {key} is revoked by {self.source}"
        if version > self.max_version(channel):
            return f"it is above max_version {self.max_version(channel)} of {self.source}"
        return None

    def check(self, record: ReleaseRecord, signature: SignatureBlob, channel: str) -> None:
        """Raise ``TrustError`` unless ``signature`` is a valid signature of ``record`` for ``channel``."""
        what = f"release record {record.digest} (channel {channel}, version {record.version})"
        if record.channel != channel:
            raise TrustError(f"{what} is for channel {record.channel!r}, not {channel!r}; refusing a record of another channel")
        if signature.record != record.digest:
            raise TrustError(f"signature {signature.digest} is for record {signature.record}, not {record.digest}")
        if signature.key != record.key:
            raise TrustError(f"{what} names signer key {record.key}, but its signature is by key {signature.key}")
        if signature.key in self.revoked:
            raise TrustError(f"{what} is signed by key {signature.key}, which {self.source} revokes")
        keys = self.channels.get(channel)
        if keys is None:
            raise TrustError(f"{what}: {self.source} allows no key for channel {channel!r} "
                             f"(it has {', '.join(sorted(self.channels)) or 'no channels'})")
        public = keys.get(signature.key)
        if public is None:
            raise TrustError(f"{what} is signed by key {signature.key}, which {self.source} does not allow for channel {channel!r}")
        if record.version > self.max_version(channel):
            raise TrustError(f"{what}: version {record.version} is above max_version {self.max_version(channel)} "
                             f"that {self.source} allows for channel {channel!r}")
        ed25519, _serialization, invalid = _crypto()
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signature.signature, record.raw)
        except invalid:
            raise TrustError(f"{what}: the signature by key {signature.key} does not verify; the record or signature was altered") from None


def _parse_public(text: object, where: str) -> bytes:
    if isinstance(text, str) and text.startswith(_PUBLIC_PREFIX):
        try:
            public = base64.b64decode(text[len(_PUBLIC_PREFIX):], validate=True)
        except binascii.Error:
            public = b""
        if len(public) == 32:
            return public
    raise TrustError(f"{where}: expected 'ed25519:<base64 of the 32-byte public key>', got {show(text)}")


# -- keys and signing -----------------------------------------------------------------------------

def generate_key() -> tuple[bytes, str]:
    """A new Ed25519 private key as PEM (PKCS#8, unencrypted) and its public key line for a policy."""
    ed25519, serialization, _ = _crypto()
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return pem, _PUBLIC_PREFIX + base64.b64encode(public).decode("ascii")


def _check_key_mode(path: Path, mode: int) -> None:
    """A private key others can read is a key others may have copied: refuse to sign with it."""
    if os.name != "nt" and mode & 0o077:
        raise TrustError(f"signing key {path}: mode {stat.S_IMODE(mode):04o} lets group or others access it, "
                         f"expected 0600 (owner only); run `chmod 600 {path}` (and replace the key if others read it)")


def _load_private(path: Path) -> Any:
    ed25519, serialization, _ = _crypto()
    with open_regular(path, "signing key", TrustError) as f:
        _check_key_mode(path, os.fstat(f.fileno()).st_mode)
        pem = f.read(MAX_SMALL_BLOB + 1)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(f"signing key {path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise TrustError(f"signing key {path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def public_line(path: Path) -> tuple[str, str]:
    """(``ed25519:<base64>``, key id) of the private key file at ``path``."""
    _, serialization, _ = _crypto()
    public = _load_private(path).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _PUBLIC_PREFIX + base64.b64encode(public).decode("ascii"), key_id(public)


def sign_release(local: LocalStore, manifest: Digest, key_path: Path, channel: str, version: int,
                 expires_in: float) -> tuple[ReleaseRecord, SignatureBlob]:
    """Sign ``manifest`` as ``channel`` version ``version``; store record and signature in ``local``'s
    CAS and point the local channel at them. Refuses a version not above the one signed here last."""
    _, serialization, _ = _crypto()
    channel = channel_name(channel)
    version = _version(version, f"--version of channel {channel}")
    private = _load_private(key_path)
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    kid = key_id(public)
    record = ReleaseRecord.build(channel, version, manifest, int(time.time() + expires_in), kid)
    signature = SignatureBlob.build(record, kid, private.sign(record.raw))
    with local.file_lock(("channels",), f"{channel}.lock", what=f"channel {channel}"):
        state = _read_state(local, channel)
        top = state.floor(None) if state is not None else None
        if top is not None and top[1].version >= version:
            raise RollbackError(f"channel {channel}: version {version} is not above version {top[1].version}, "
                                f"the last one signed or accepted in {local.root}; sign a higher version")
        local.write(record.digest, record.raw)
        local.write(signature.digest, signature.raw)
        _write_state(local, (state or ChannelState(channel, {})).with_release(kid, version, signature.digest))
    return record, signature


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
        return _canonical({"schema": STATE_SCHEMA, "channel": self.channel,
                           "keys": {k: {"version": a.version, "signature": str(a.signature)} for k, a in self.keys.items()}})


def _channels_dir(local: LocalStore) -> int | None:
    """A descriptor of ``v1/channels`` reached without following a link below the root; None if absent.

    A link there is an error, never "no state": reading it as absent would turn rollback
    protection off without a word."""
    flags_follow = _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0)
    path = local.root
    try:
        fd = os.open(path, flags_follow)  # the root is followed: the user chose it
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot open store directory {path}: {exc.strerror or exc}") from exc
    for part in ("v1", "channels"):
        path = path / part
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise TrustError(f"channel state directory {path} is a symlink or not a directory; cubinstore never "
                                 "follows links inside its store, and without it this host's rollback floor is "
                                 "unknown: remove the link (the next resolution makes a real directory)") from None
            raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        fd = child
    return fd


def _read_state(local: LocalStore, channel: str) -> ChannelState | None:
    where = local.v1 / "channels" / f"{channel}.json"
    fd = _channels_dir(local)
    if fd is None:
        return None
    try:
        raw = read_at(fd, f"{channel}.json", MAX_STATE_BYTES, path=where)
    except NotRegularFile as exc:
        raise TrustError(f"channel state {where} is not a regular file ({exc}); remove it") from None
    finally:
        os.close(fd)
    if raw is None:
        return None
    where_ = f"channel state {where}"
    if len(raw) > MAX_STATE_BYTES:
        raise TrustError(f"{where_}: more than {MAX_STATE_BYTES} bytes")
    doc = loads_strict(raw, where_, TrustError)
    if isinstance(doc, dict) and doc.get("schema") == _STATE_SCHEMA_V1:
        return _read_state_v1(local, channel, raw, where_)
    doc = _json_object(raw, where_, STATE_SCHEMA, frozenset({"schema", "channel", "keys"}))
    if doc["channel"] != channel:
        raise TrustError(f"{where_}: is for channel {show(doc['channel'])}")
    keys_doc = doc["keys"]
    if not isinstance(keys_doc, dict):
        raise TrustError(f"{where_}: keys: expected an object of key id -> {{signature, version}}, got {show(keys_doc)}")
    keys: dict[str, Accepted] = {}
    for kid, entry in keys_doc.items():
        if kid != "" and not _KEY_ID_RE.fullmatch(kid):
            raise TrustError(f"{where_}: keys: expected 64-hex key ids, got {show(kid)}")
        if not isinstance(entry, dict) or set(entry) != {"signature", "version"}:
            raise TrustError(f"{where_}: keys.{kid}: expected {{\"signature\": ..., \"version\": N}}, got {show(entry)}")
        try:
            keys[kid] = Accepted(_version(entry["version"], f"{where_}: keys.{kid}"), Digest.parse(entry["signature"]))
        except BadArgumentError as exc:
            raise TrustError(f"{where_}: keys.{kid}: {exc}") from None
    return ChannelState(channel, keys)


def _read_state_v1(local: LocalStore, channel: str, raw: bytes, where: str) -> ChannelState:
    """A version 1 state (one version, one signature): its signer is read from the signature blob."""
    doc = _json_object(raw, where, _STATE_SCHEMA_V1, frozenset({"schema", "channel", "version", "signature"}))
    if doc["channel"] != channel:
        raise TrustError(f"{where}: is for channel {show(doc['channel'])}")
    try:
        accepted = Accepted(_version(doc["version"], where), Digest.parse(doc["signature"]))
    except BadArgumentError as exc:
        raise TrustError(f"{where}: {exc}") from None
    kid = ""
    try:
        data = local.read_entry(accepted.signature, MAX_SMALL_BLOB)
        if data is not None and len(data) <= MAX_SMALL_BLOB and Digest.of(data) == accepted.signature:
            kid = SignatureBlob.from_bytes(data, source=str(accepted.signature)).key
    except (NotRegularFile, CubinstoreError) as exc:
        _log.warning("%s: cannot tell who signed %s (%s); it bounds the channel until max_version excludes it",
                     where, accepted.signature, exc)
    return ChannelState(channel, {kid: accepted})


def _write_state(local: LocalStore, state: ChannelState) -> None:
    data = state.to_bytes()
    if len(data) > MAX_STATE_BYTES:  # MAX_STATE_KEYS entries fit: a bug, not an input
        raise StoreError(f"channel state of {state.channel}: {len(data)} bytes, over {MAX_STATE_BYTES}")
    local.write_file(("channels",), f"{state.channel}.json", data)


def local_pointer(local: LocalStore, channel: str) -> Digest | None:
    """The signature blob of the highest release this host signed or accepted for ``channel`` (for ``publish``)."""
    state = _read_state(local, channel_name(channel))
    top = state.floor(None) if state is not None else None
    return None if top is None else top[1].signature


# -- resolution -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Candidate:
    record: ReleaseRecord
    signature: SignatureBlob
    origin: str


def _small_document(store: Store, digest: Digest, what: str) -> bytes:
    """The verified bytes of ``digest``, a record or a signature: read no further than
    ``MAX_SMALL_BLOB`` bytes from any layer, and stored nowhere (``_remember`` stores what is accepted)."""
    from cubinstore.store.http import HttpStore
    from cubinstore.store.local.cas import LocalStore

    outcomes: list[str] = []
    # Kinds only, never the exceptions: a traceback would keep a refused download's socket open.
    kinds: set[type[CubinstoreError]] = set()
    for layer in store.layers:
        data: bytes | None = None
        try:
            if isinstance(layer, LocalStore):
                data = layer.read_entry(digest, MAX_SMALL_BLOB)
            elif isinstance(layer, HttpStore):
                data = layer.get_named(f"cas/{digest.hex}", MAX_SMALL_BLOB)  # the blob's URL, capped
            else:  # in-process memory, a build tree: nothing is downloaded
                data = layer.read(digest, None)
        except NotRegularFile as exc:
            outcomes.append(f"{layer.name}: {exc}")
            continue
        except CubinstoreError as exc:
            outcomes.append(f"{layer.name}: {exc}")
            kinds.add(type(exc))
            continue
        if data is None:
            outcomes.append(f"{layer.name}: miss")
        elif len(data) > MAX_SMALL_BLOB:
            outcomes.append(f"{layer.name}: more than {MAX_SMALL_BLOB} bytes")
            kinds.add(IntegrityError)
        elif Digest.of(data) != digest:
            outcomes.append(f"{layer.name}: bytes do not hash to it")
            kinds.add(IntegrityError)
        else:
            return bytes(data)
    message = (f"{what} {digest} not available as a document of at most {MAX_SMALL_BLOB} bytes: "
               + ("; ".join(outcomes) or "no store layers"))
    if any(issubclass(k, IntegrityError) for k in kinds):
        raise TrustError(message)
    if any(issubclass(k, RemoteUnavailableError) for k in kinds):
        raise RemoteUnavailableError(message)
    raise StoreError(message) if kinds else MissingBlobError(message)


def _candidate(store: Store, pointer: Digest, origin: str) -> _Candidate:
    sig_raw = _small_document(store, pointer, f"signature named by {origin}:")
    signature = SignatureBlob.from_bytes(sig_raw, source=f"{pointer} ({origin})")
    record_raw = _small_document(store, signature.record, f"release record of {origin}:")
    return _Candidate(ReleaseRecord.from_bytes(record_raw, source=f"{signature.record} ({origin})"), signature, origin)


def _pointer_at(remote: HttpStore, channel: str) -> Digest | None:
    where = f"channel pointer {remote.url}/channels/{channel}"
    too_long = ""
    try:
        raw = remote.get_named(f"channels/{channel}", MAX_SMALL_BLOB)
    except IntegrityError as exc:  # longer than a pointer can be: reading stopped there
        too_long = str(exc)
    if too_long:  # raised outside the handler: the refused response is closed once its traceback goes
        raise TrustError(f"{where}: more than {MAX_SMALL_BLOB} bytes, not a pointer ({too_long})")
    if raw is None:
        return None
    try:
        return Digest.parse(raw.decode("ascii").strip())
    except (UnicodeDecodeError, BadArgumentError) as exc:
        raise TrustError(f"{where} is malformed: {exc}") from None


def _check_floor(channel: str, candidate: _Candidate, floor: tuple[str, Accepted] | None, meanwhile: str = "") -> None:
    """Raise ``RollbackError`` if ``candidate`` is below the floor, or another release of the floor's version."""
    if floor is None:
        return
    accepted, record, origin = floor[1], candidate.record, candidate.origin
    if record.version < accepted.version:
        raise RollbackError(f"channel:{channel}: {origin} offers version {record.version}, but this host {meanwhile}"
                            f"already accepted version {accepted.version} ({accepted.signature}); refusing a rollback")
    if record.version == accepted.version and candidate.signature.digest != accepted.signature:
        raise RollbackError(f"channel:{channel}: {origin} offers a different release as version {record.version} "
                            f"({candidate.signature.digest}), which this host {meanwhile}already accepted as "
                            f"{accepted.signature}; refusing a forked channel")


def _remember(local: LocalStore, channel: str, best: _Candidate, policy: TrustPolicy) -> None:
    """Accept ``best``: one compare-and-set on the channel's state, under its lock.

    The state is read again under the lock and the decision made against it, so of two
    processes offered two releases of one version, the second sees the first's and refuses
    a fork. A store that cannot be written (read only) cannot remember: expiry still bounds
    staleness there. A link inside the store, or a lock held too long, is an error."""
    try:
        with local.file_lock(("channels",), f"{channel}.lock", what=f"channel {channel}"):
            state = _read_state(local, channel) or ChannelState(channel, {})
            floor = state.floor(policy)
            _check_floor(channel, best, floor, meanwhile="(another process, meanwhile) ")
            if floor is not None and floor[1].signature == best.signature.digest:
                return
            # Record and signature first: a state never names a blob the store lacks.
            local.write(best.record.digest, best.record.raw)
            local.write(best.signature.digest, best.signature.raw)
            _write_state(local, state.with_release(best.signature.key, best.record.version, best.signature.digest))
    except (UnsafeStoreError, LockTimeoutError):
        raise
    except StoreError as exc:
        _log.warning("cannot remember channel %s version %d in %s: %s", channel, best.record.version, local.root, exc)


def resolve_channel(name: str, store: Store | None = None, policy: TrustPolicy | str | Path | None = None,
                    *, now: float | None = None) -> Digest:
    """The manifest digest of the newest trusted release of channel ``name``.

    Candidates: each remote's pointer and this host's last accepted release. Each is verified
    (signature under ``policy``, channel, expiry, no rollback); the highest valid version wins
    and becomes the host's new floor. ``policy`` defaults to ``CUBINSTORE_TRUST_POLICY``.
    """
    from cubinstore.store.http import HttpStore
    from cubinstore.store import default_store as _default_store

    channel = channel_name(name[len(CHANNEL_PREFIX):] if name.startswith(CHANNEL_PREFIX) else name)
    if policy is None:
        policy = _env.trust_policy()
        if policy is None:
            raise TrustError(f"channel:{channel} needs a trust policy: set CUBINSTORE_TRUST_POLICY "
                             "(or pass one) to the file that lists the keys allowed to sign it")
    if not isinstance(policy, TrustPolicy):
        policy = TrustPolicy.load(policy)
    store = store if store is not None else _default_store()
    local = store.local
    now = time.time() if now is None else now

    pointers: list[tuple[Digest, str]] = []
    problems: list[CubinstoreError] = []
    for layer in store.layers:
        if isinstance(layer, HttpStore):
            try:
                pointer = _pointer_at(layer, channel)
            except CubinstoreError as exc:
                problems.append(exc)
                continue
            if pointer is not None:
                pointers.append((pointer, f"{layer.url}/channels/{channel}"))
    state = _read_state(local, channel) if local is not None else None
    floor = state.floor(policy) if state is not None else None
    if state is not None and (ignored := state.ignored(policy)):
        _log.warning("channel %s: not bounded by %s", channel, "; ".join(ignored))
    if floor is not None and not pointers:
        # No remote answered with a pointer (offline, unreachable): the release accepted last
        # serves until it expires. A remote that answers is never overruled by it: if what
        # it offers is older or stale, that is an error to see, not to route around.
        pointers.append((floor[1].signature, f"the release {local.root if local else ''} accepted last"))
    if not pointers and not problems:
        raise MissingBlobError(f"channel:{channel}: no remote has channels/{channel} and this host never accepted one "
                               f"({', '.join(layer.name for layer in store.layers) or 'no store layers'})")

    accepted: list[_Candidate] = []
    for pointer, origin in dict.fromkeys(pointers):
        try:
            candidate = _candidate(store, pointer, origin)
            policy.check(candidate.record, candidate.signature, channel)
            record = candidate.record
            if now >= record.expires:
                raise ExpiredReleaseError(
                    f"channel:{channel} version {record.version} from {origin} expired at {format_time(record.expires)} "
                    f"(now {format_time(int(now))}); the channel is stale or frozen: ask its signer for a fresh record"
                )
            _check_floor(channel, candidate, floor)
            accepted.append(candidate)
        except CubinstoreError as exc:
            _log.warning("not using %s for channel %s: %s", origin, channel, exc)
            problems.append(exc)
    if not accepted:
        # The most specific reason wins: a rollback or expiry says more than a missing blob.
        for kind in (RollbackError, ExpiredReleaseError, TrustError):
            chosen = next((p for p in problems if isinstance(p, kind)), None)
            if chosen is not None:
                raise type(chosen)(str(chosen) + (f" (and {len(problems) - 1} other problems)" if len(problems) > 1 else ""))
        raise problems[0]
    best = max(accepted, key=lambda c: c.record.version)
    if local is not None and (floor is None or best.signature.digest != floor[1].signature):
        _remember(local, channel, best, policy)
    _log.debug("channel %s: version %d from %s -> %s", channel, best.record.version, best.origin, best.record.manifest)
    return best.record.manifest
