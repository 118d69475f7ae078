"""Signed release channels: ``channel:NAME`` resolves to a manifest digest someone trusted signed.

A release record (``cubinstore/release/v1``) names a channel, a version, a manifest digest, an
expiry and the signer's key id; a signature blob (``cubinstore/signature/v1``) holds an
Ed25519 signature over the record's exact bytes. Both are CAS blobs. A channel pointer
(``<remote>/channels/<NAME>``, and ``v1/channels/<NAME>.json`` locally) names the signature
blob; the pointer itself is untrusted: what makes a release acceptable is

* the signature verifies under a key the trust policy allows for that channel and has not revoked;
* the record is for that channel (a record of another channel is not replayable here);
* it has not expired (a frozen or stale channel stops being served: python-tuf's timestamp role);
* its version is not lower than the highest this host accepted (no rollback), and an equal
  version names the same record (no fork).

``cryptography`` is imported only here, and only when a policy is loaded, so ``import
cubinstore`` stays stdlib-only.
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cubinstore import _env
from cubinstore._digest import Digest, show
from cubinstore._files import open_regular
from cubinstore._log import get_logger
from cubinstore._safedir import NotRegularFile
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    ExpiredReleaseError,
    MissingBlobError,
    RollbackError,
    StoreError,
    TrustError,
)

if TYPE_CHECKING:
    from cubinstore._http import HttpStore
    from cubinstore._local import LocalStore
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
STATE_SCHEMA = "cubinstore/channel-state/v1"
CHANNEL_PREFIX = "channel:"
_CHANNEL_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
_KEY_ID_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
_TIME_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z", re.ASCII)
_PUBLIC_PREFIX = "ed25519:"
MAX_SMALL_BLOB = 4096       # a record, a signature, a pointer or a state file
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
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TrustError(f"{where}: not valid JSON ({exc})") from None
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
    """Which keys may sign which channel (``cubinstore/trust/v1``); revoked key ids are refused everywhere."""

    channels: Mapping[str, Mapping[str, bytes]]  # channel -> key id -> raw public key
    revoked: frozenset[str]
    source: str

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
        for name, entry in channels_doc.items():
            try:
                channel_name(name)
            except BadArgumentError as exc:
                raise TrustError(f"{where}: channels: {exc}") from None
            if not isinstance(entry, dict) or set(entry) != {"keys"} or not isinstance(entry["keys"], list) \
                    or not entry["keys"]:
                raise TrustError(f"{where}: channels.{name}: expected {{\"keys\": [\"ed25519:<base64>\", ...]}}, "
                                 f"got {show(entry)}")
            keys: dict[str, bytes] = {}
            for i, text in enumerate(entry["keys"]):
                public = _parse_public(text, f"{where}: channels.{name}.keys[{i}]")
                keys[key_id(public)] = public
            channels[name] = keys
        return cls(channels, frozenset(revoked), source)

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


def _load_private(path: Path) -> Any:
    ed25519, serialization, _ = _crypto()
    with open_regular(path, "signing key", TrustError) as f:
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
        if state is not None and state[0] >= version:
            raise RollbackError(f"channel {channel}: version {version} is not above version {state[0]}, "
                                f"the last one signed or accepted in {local.root}; sign a higher version")
        local.write(record.digest, record.raw)
        local.write(signature.digest, signature.raw)
        _write_state(local, channel, version, signature.digest)
    return record, signature


# -- the host's memory of each channel (rollback protection) ----------------------------------------

def _read_state(local: LocalStore, channel: str) -> tuple[int, Digest] | None:
    where = local.v1 / "channels" / f"{channel}.json"
    try:
        raw = local.read_file(("channels",), f"{channel}.json", MAX_SMALL_BLOB)
    except NotRegularFile as exc:
        raise TrustError(f"channel state {where} is not a regular file ({exc}); remove it") from None
    if raw is None:
        return None
    doc = _json_object(raw, f"channel state {where}", STATE_SCHEMA, frozenset({"schema", "channel", "version", "signature"}))
    if doc["channel"] != channel:
        raise TrustError(f"channel state {where}: is for channel {show(doc['channel'])}")
    try:
        return _version(doc["version"], f"channel state {where}"), Digest.parse(doc["signature"])
    except BadArgumentError as exc:
        raise TrustError(f"channel state {where}: {exc}") from None


def _write_state(local: LocalStore, channel: str, version: int, signature: Digest) -> None:
    doc = {"schema": STATE_SCHEMA, "channel": channel, "version": version, "signature": str(signature)}
    local.write_file(("channels",), f"{channel}.json", _canonical(doc))


def local_pointer(local: LocalStore, channel: str) -> Digest | None:
    """The signature blob this host last signed or accepted for ``channel`` (for ``publish``)."""
    state = _read_state(local, channel_name(channel))
    return None if state is None else state[1]


# -- resolution -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Candidate:
    record: ReleaseRecord
    signature: SignatureBlob
    origin: str


def _candidate(store: Store, pointer: Digest, origin: str) -> _Candidate:
    sig_raw = store.get(pointer, name=f"signature of {origin}")
    signature = SignatureBlob.from_bytes(sig_raw, source=f"{pointer} ({origin})")
    record_raw = store.get(signature.record, name=f"release record of {origin}")
    return _Candidate(ReleaseRecord.from_bytes(record_raw, source=f"{signature.record} ({origin})"), signature, origin)


def _pointer_at(remote: HttpStore, channel: str) -> Digest | None:
    raw = remote.get_named(f"channels/{channel}", MAX_SMALL_BLOB)
    if raw is None:
        return None
    try:
        return Digest.parse(raw.decode("ascii").strip())
    except (UnicodeDecodeError, BadArgumentError) as exc:
        raise TrustError(f"channel pointer {remote.url}/channels/{channel} is malformed: {exc}") from None


def resolve_channel(name: str, store: Store | None = None, policy: TrustPolicy | str | Path | None = None,
                    *, now: float | None = None) -> Digest:
    """The manifest digest of the newest trusted release of channel ``name``.

    Candidates: each remote's pointer and this host's last accepted release. Each is verified
    (signature under ``policy``, channel, expiry, no rollback); the highest valid version wins
    and becomes the host's new floor. ``policy`` defaults to ``CUBINSTORE_TRUST_POLICY``.
    """
    from cubinstore._http import HttpStore
    from cubinstore.store import Store as _Store

    channel = channel_name(name[len(CHANNEL_PREFIX):] if name.startswith(CHANNEL_PREFIX) else name)
    if policy is None:
        policy = _env.trust_policy()
        if policy is None:
            raise TrustError(f"channel:{channel} needs a trust policy: set CUBINSTORE_TRUST_POLICY "
                             "(or pass one) to the file that lists the keys allowed to sign it")
    if not isinstance(policy, TrustPolicy):
        policy = TrustPolicy.load(policy)
    store = store if store is not None else _Store.from_env()
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
    floor = _read_state(local, channel) if local is not None else None
    if floor is not None and not pointers:
        # No remote answered with a pointer (offline, unreachable): the release accepted last
        # serves until it expires. A remote that answers is never overruled by it: if what
        # it offers is older or stale, that is an error to see, not to route around.
        pointers.append((floor[1], f"the release {local.root if local else ''} accepted last"))
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
            if floor is not None and (record.version < floor[0] or (record.version == floor[0]
                                                                     and candidate.signature.digest != floor[1])):
                raise RollbackError(
                    f"channel:{channel}: {origin} offers version {record.version}, but this host already accepted "
                    f"version {floor[0]} ({floor[1]}); refusing a rollback" if record.version < floor[0] else
                    f"channel:{channel}: {origin} offers a different release as version {record.version}, which this "
                    f"host already accepted as {floor[1]}; refusing a forked channel"
                )
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
    if local is not None and (floor is None or best.record.version > floor[0]):
        try:
            with local.file_lock(("channels",), f"{channel}.lock", what=f"channel {channel}"):
                current = _read_state(local, channel)
                if current is not None and current[0] > best.record.version:
                    raise RollbackError(f"channel:{channel}: version {current[0]} was accepted meanwhile; "
                                        f"refusing version {best.record.version}")
                _write_state(local, channel, best.record.version, best.signature.digest)
        except StoreError as exc:  # a read-only store cannot remember: expiry still bounds staleness
            _log.warning("cannot remember channel %s version %d in %s: %s", channel, best.record.version, local.root, exc)
    _log.debug("channel %s: version %d from %s -> %s", channel, best.record.version, best.origin, best.record.manifest)
    return best.record.manifest
