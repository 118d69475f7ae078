"""The accept/refuse decision on channel releases: a pure function of the candidates offered, the
trust policy, this host's floor and the time. No I/O: what it decides on was fetched by ``channel``.

A candidate is accepted when

* its signature verifies under a key the trust policy allows for that channel and has not revoked;
* its record is for that channel (a record of another channel is not replayable here);
* it has not expired (a frozen or stale channel stops being served: python-tuf's timestamp role);
* its version is not above the policy's ``max_version`` for the channel, not lower than the
  host's floor (no rollback), and an equal version names the same release (no fork).

Of the accepted, the highest version wins; when none is, the most specific reason is the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cubinstore.errors import (
    CubinstoreError,
    ExpiredReleaseError,
    RollbackError,
    TrustError,
)
from cubinstore.trust.records import (
    Accepted,
    ReleaseRecord,
    SignatureBlob,
    TrustPolicy,
    crypto,
    format_time,
)

__all__ = ["Candidate", "Decision", "check_expiry", "check_floor", "check_signature", "decide", "refusal"]


@dataclass(frozen=True)
class Candidate:
    """A release offered for a channel: its record and signature, and where the pointer came from."""

    record: ReleaseRecord
    signature: SignatureBlob
    origin: str


@dataclass(frozen=True)
class Decision:
    """``best``: the release to use (None: every offer was refused); ``refused``: (origin, why) of each refusal."""

    best: Candidate | None
    refused: tuple[tuple[str, CubinstoreError], ...]


def check_signature(policy: TrustPolicy, record: ReleaseRecord, signature: SignatureBlob, channel: str) -> None:
    """Raise ``TrustError`` unless ``signature`` is a valid signature of ``record`` for ``channel`` under ``policy``."""
    what = f"release record {record.digest} (channel {channel}, version {record.version})"
    if record.channel != channel:
        raise TrustError(f"{what} is for channel {record.channel!r}, not {channel!r}; refusing a record of another channel")
    if signature.record != record.digest:
        raise TrustError(f"signature {signature.digest} is for record {signature.record}, not {record.digest}")
    if signature.key != record.key:
        raise TrustError(f"{what} names signer key {record.key}, but its signature is by key {signature.key}")
    if signature.key in policy.revoked:
        raise TrustError(f"{what} is signed by key {signature.key}, which {policy.source} revokes")
    keys = policy.channels.get(channel)
    if keys is None:
        raise TrustError(f"{what}: {policy.source} allows no key for channel {channel!r} "
                         f"(it has {', '.join(sorted(policy.channels)) or 'no channels'})")
    public = keys.get(signature.key)
    if public is None:
        raise TrustError(f"{what} is signed by key {signature.key}, which {policy.source} does not allow for channel {channel!r}")
    if record.version > policy.max_version(channel):
        raise TrustError(f"{what}: version {record.version} is above max_version {policy.max_version(channel)} "
                         f"that {policy.source} allows for channel {channel!r}")
    ed25519, _serialization, invalid = crypto()
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public).verify(signature.signature, record.raw)
    except invalid:
        raise TrustError(f"{what}: the signature by key {signature.key} does not verify; the record or signature was altered") from None


def check_expiry(channel: str, candidate: Candidate, now: float) -> None:
    """Raise ``ExpiredReleaseError`` if ``candidate``'s record has expired at ``now``."""
    record = candidate.record
    if now >= record.expires:
        raise ExpiredReleaseError(
            f"channel:{channel} version {record.version} from {candidate.origin} expired at {format_time(record.expires)} "
            f"(now {format_time(int(now))}); the channel is stale or frozen: ask its signer for a fresh record"
        )


def check_floor(channel: str, candidate: Candidate, floor: tuple[str, Accepted] | None, meanwhile: str = "") -> None:
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


def decide(channel: str, offers: Sequence[tuple[str, Candidate | CubinstoreError]], policy: TrustPolicy,
           floor: tuple[str, Accepted] | None, now: float) -> Decision:
    """Which of ``offers`` to use: each (origin, the candidate it offered or why it could not be
    read) is checked in order (signature, expiry, floor); the highest accepted version wins."""
    accepted: list[Candidate] = []
    refused: list[tuple[str, CubinstoreError]] = []
    for origin, offer in offers:
        if isinstance(offer, CubinstoreError):
            refused.append((origin, offer))
            continue
        try:
            check_signature(policy, offer.record, offer.signature, channel)
            check_expiry(channel, offer, now)
            check_floor(channel, offer, floor)
        except CubinstoreError as exc:
            refused.append((origin, exc))
            continue
        accepted.append(offer)
    best = max(accepted, key=lambda c: c.record.version) if accepted else None
    return Decision(best, tuple(refused))


def refusal(problems: Sequence[CubinstoreError]) -> CubinstoreError:
    """The error to raise when no release was accepted: the most specific reason wins (a rollback
    or an expiry says more than a missing blob), with a count of the others."""
    for kind in (RollbackError, ExpiredReleaseError, TrustError):
        chosen = next((p for p in problems if isinstance(p, kind)), None)
        if chosen is not None:
            return type(chosen)(str(chosen) + (f" (and {len(problems) - 1} other problems)" if len(problems) > 1 else ""))
    return problems[0]
