"""Signed release channels, the I/O: ``channel:NAME`` resolves to a manifest digest someone trusted signed.

A channel pointer (``<remote>/channels/<NAME>``, the tag ``channel-<NAME>`` of an ``oci://``
registry, and ``v1/channels/<NAME>.json`` locally) names a signature blob; the pointer itself
is untrusted: a registry serving another tag, an old one or a forged manifest offers a
candidate that ``trust.verify`` refuses exactly as it refuses a bad HTTP pointer. This module fetches the pointers and
the documents they name, reads and writes the host's channel state, and takes its lock; what
makes a release acceptable is decided in ``trust.verify``, without I/O. Accepting is one
compare-and-set on ``v1/channels/<NAME>.json`` under its lock.

Channel documents (pointer, signature, record) are read no further than ``MAX_SMALL_BLOB``
bytes and stored only once accepted; ``v1/channels`` is never reached through a link.

``cryptography`` is imported only by ``trust``, and only when a signature is checked or made,
so ``import cubinstore`` stays stdlib-only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from cubinstore._core import knobs
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore.errors import (
    BadArgumentError,
    CubinstoreError,
    IntegrityError,
    LockTimeoutError,
    MissingBlobError,
    RemoteUnavailableError,
    StoreError,
    TrustError,
    UnsafeStoreError,
)
from cubinstore.store.local.root import LinkInStore, NotRegularFile
from cubinstore.trust.records import (
    CHANNEL_PREFIX,
    MAX_SMALL_BLOB,
    MAX_STATE_BYTES,
    Accepted,
    ChannelState,
    ReleaseRecord,
    SignatureBlob,
    TrustPolicy,
    channel_name,
    parse_state,
)
from cubinstore.trust.verify import Candidate, check_floor, decide, refusal

if TYPE_CHECKING:
    from cubinstore.store import Store
    from cubinstore.store.http import HttpLayer
    from cubinstore.store.local.cas import LocalLayer
    from cubinstore.store.oci.remote import OciLayer

__all__ = ["local_pointer", "read_state", "resolve_channel", "write_state"]

_log = get_logger(__name__)


# -- the host's memory of each channel (rollback protection) ----------------------------------------

def read_state(local: LocalLayer, channel: str) -> ChannelState | None:
    """The state of ``channel`` in ``local`` (None: this host never signed or accepted a release of it).

    Read strictly: a link on the way is an error, never "no state", since reading it as absent
    would turn rollback protection off without a word."""
    where = local.v1 / "channels" / f"{channel}.json"
    try:
        raw = local.read_file(("channels",), f"{channel}.json", MAX_STATE_BYTES, strict=True)
    except LinkInStore as exc:
        raise TrustError(f"channel state directory {exc.path} is a symlink or not a directory; cubinstore never "
                         "follows links inside its store, and without it this host's rollback floor is "
                         "unknown: remove the link (the next resolution makes a real directory)") from None
    except NotRegularFile as exc:
        raise TrustError(f"channel state {where} is not a regular file ({exc}); remove it") from None
    if raw is None:
        return None
    where_ = f"channel state {where}"
    state = parse_state(raw, channel, where_)
    if isinstance(state, Accepted):
        return _state_v1(local, channel, state, where_)
    return state


def _state_v1(local: LocalLayer, channel: str, accepted: Accepted, where: str) -> ChannelState:
    """A version 1 state (one version, one signature): its signer is read from the signature blob."""
    kid = ""
    try:
        data = local.read_entry(accepted.signature, MAX_SMALL_BLOB)
        if data is not None and len(data) <= MAX_SMALL_BLOB and Digest.of(data) == accepted.signature:
            kid = SignatureBlob.from_bytes(data, source=str(accepted.signature)).key
    except (NotRegularFile, CubinstoreError) as exc:
        _log.warning("%s: cannot tell who signed %s (%s); it bounds the channel until max_version excludes it",
                     where, accepted.signature, exc)
    return ChannelState(channel, {kid: accepted})


def write_state(local: LocalLayer, state: ChannelState) -> None:
    data = state.to_bytes()
    if len(data) > MAX_STATE_BYTES:  # MAX_STATE_KEYS entries fit: a bug, not an input
        raise StoreError(f"channel state of {state.channel}: {len(data)} bytes, over {MAX_STATE_BYTES}")
    local.write_file(("channels",), f"{state.channel}.json", data)


def local_pointer(local: LocalLayer, channel: str) -> Digest | None:
    """The signature blob of the highest release this host signed or accepted for ``channel`` (for ``publish``)."""
    state = read_state(local, channel_name(channel))
    top = state.floor(None) if state is not None else None
    return None if top is None else top[1].signature


# -- resolution -------------------------------------------------------------------------------------

def _small_document(store: Store, digest: Digest, what: str) -> bytes:
    """The verified bytes of ``digest``, a record or a signature: read no further than
    ``MAX_SMALL_BLOB`` bytes from any layer, and stored nowhere (``_remember`` stores what is accepted)."""
    from cubinstore.store.http import HttpLayer
    from cubinstore.store.local.cas import LocalLayer
    from cubinstore.store.oci.layout import OciLayout
    from cubinstore.store.oci.remote import OciLayer
    from cubinstore.store.sources import DirectorySource

    outcomes: list[str] = []
    # Kinds only, never the exceptions: a traceback would keep a refused download's socket open.
    kinds: set[type[CubinstoreError]] = set()
    for layer in store.layers:
        data: bytes | None = None
        try:
            if isinstance(layer, LocalLayer):
                data = layer.read_entry(digest, MAX_SMALL_BLOB)
            elif isinstance(layer, HttpLayer):
                data = layer.get_named(f"cas/{digest.hex}", MAX_SMALL_BLOB)  # the blob's URL, capped
            elif isinstance(layer, (OciLayer, OciLayout, DirectorySource)):
                data = layer.read_capped(digest, MAX_SMALL_BLOB)
            else:  # in-process memory, a disk cache: ``size`` bounds the read (``Layer.read``)
                data = layer.read(digest, MAX_SMALL_BLOB)
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


def _fetch_candidate(store: Store, pointer: Digest, origin: str) -> Candidate:
    sig_raw = _small_document(store, pointer, f"signature named by {origin}:")
    signature = SignatureBlob.from_bytes(sig_raw, source=f"{pointer} ({origin})")
    record_raw = _small_document(store, signature.record, f"release record of {origin}:")
    return Candidate(ReleaseRecord.from_bytes(record_raw, source=f"{signature.record} ({origin})"), signature, origin)


def _pointer_at(remote: HttpLayer, channel: str) -> tuple[Digest, str] | None:
    """The signature an HTTP remote's ``channels/NAME`` names, and where it was read."""
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
        return Digest.parse(raw.decode("ascii").strip()), f"{remote.url}/channels/{channel}"
    except (UnicodeDecodeError, BadArgumentError) as exc:
        raise TrustError(f"{where} is malformed: {exc}") from None


def _registry_pointer(registry: OciLayer, channel: str) -> tuple[Digest, str] | None:
    """The signature the registry's tag ``channel-NAME`` names: the config of a channel artifact
    (``store.oci.artifact``), read at most ``MAX_ARTIFACT_BYTES``. Only its shape is checked here;
    whether it is acceptable is the signature's business, as for an HTTP pointer."""
    from cubinstore.store.oci.artifact import CHANNEL_ARTIFACT, SIGNATURE_MEDIA_TYPE, channel_tag, parse_artifact

    tag = channel_tag(channel)
    where = f"channel pointer {registry.url}:{tag}"
    try:
        found = registry.get_manifest(tag)
    except IntegrityError as exc:
        raise TrustError(f"{where}: {exc}") from None
    if found is None:
        return None
    digest, raw = found
    try:
        artifact = parse_artifact(raw, digest, registry.url, artifact_type=CHANNEL_ARTIFACT,
                                  config_type=SIGNATURE_MEDIA_TYPE)
    except IntegrityError as exc:
        raise TrustError(f"{where} is malformed: {exc}") from None
    return artifact.config.digest, f"{registry.url}:{tag}"


def _remember(local: LocalLayer, channel: str, best: Candidate, policy: TrustPolicy) -> None:
    """Accept ``best``: one compare-and-set on the channel's state, under its lock.

    The state is read again under the lock and the decision made against it, so of two
    processes offered two releases of one version, the second sees the first's and refuses
    a fork. A store that cannot be written (read only) cannot remember: expiry still bounds
    staleness there. A link inside the store, or a lock held too long, is an error."""
    try:
        with local.file_lock(("channels",), f"{channel}.lock", what=f"channel {channel}"):
            state = read_state(local, channel) or ChannelState(channel, {})
            floor = state.floor(policy)
            check_floor(channel, best, floor, meanwhile="(another process, meanwhile) ")
            if floor is not None and floor[1].signature == best.signature.digest:
                return
            # Record and signature first: a state never names a blob the store lacks.
            local.write(best.record.digest, best.record.raw)
            local.write(best.signature.digest, best.signature.raw)
            write_state(local, state.with_release(best.signature.key, best.record.version, best.signature.digest))
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
    from cubinstore.store import default_store as _default_store
    from cubinstore.store.http import HttpLayer
    from cubinstore.store.oci.remote import OciLayer

    channel = channel_name(name[len(CHANNEL_PREFIX):] if name.startswith(CHANNEL_PREFIX) else name)
    if policy is None:
        policy = knobs.trust_policy()
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
        # Each kind of remote keeps a channel's pointer its own way: a file, or a registry's tag.
        read = _pointer_at if isinstance(layer, HttpLayer) else _registry_pointer if isinstance(layer, OciLayer) else None
        if read is None:
            continue
        try:
            offered = read(layer, channel)  # type: ignore[arg-type]
        except CubinstoreError as exc:
            problems.append(exc)
            continue
        if offered is not None:
            pointers.append(offered)
    state = read_state(local, channel) if local is not None else None
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

    offers: list[tuple[str, Candidate | CubinstoreError]] = []
    for pointer, origin in dict.fromkeys(pointers):
        try:
            offers.append((origin, _fetch_candidate(store, pointer, origin)))
        except CubinstoreError as exc:
            offers.append((origin, exc))
    decision = decide(channel, offers, policy, floor, now)
    for origin, exc in decision.refused:
        _log.warning("not using %s for channel %s: %s", origin, channel, exc)
        problems.append(exc)
    best = decision.best
    if best is None:
        raise refusal(problems)
    if local is not None and (floor is None or best.signature.digest != floor[1].signature):
        _remember(local, channel, best, policy)
    _log.debug("channel %s: version %d from %s -> %s", channel, best.record.version, best.origin, best.record.manifest)
    return best.record.manifest
