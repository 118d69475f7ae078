"""The accept/refuse decision on channel releases (``trust.verify``), tested as the pure function it
is: records, signatures and a policy built in memory, no store, no network, a fixed clock."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: E402

from cubinstore import Digest, ExpiredReleaseError, MissingBlobError, RollbackError, TrustError  # noqa: E402
from cubinstore.trust.records import (  # noqa: E402
    Accepted,
    ChannelState,
    ReleaseRecord,
    SignatureBlob,
    TrustPolicy,
    key_id,
)
from cubinstore.trust.verify import Candidate, check_floor, decide, refusal  # noqa: E402

NOW = 1_700_000_000


class Key:
    def __init__(self) -> None:
        self.private = ed25519.Ed25519PrivateKey.generate()
        self.public = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.id = key_id(self.public)
        self.line = "ed25519:" + base64.b64encode(self.public).decode("ascii")

    def release(self, version: int, *, channel: str = "prod", expires: int = NOW + 3600, origin: str = "remote",
                manifest: bytes | None = None) -> Candidate:
        record = ReleaseRecord.build(channel, version, Digest.of(manifest or b"manifest %d" % version), expires, self.id)
        return Candidate(record, SignatureBlob.build(record, self.id, self.private.sign(record.raw)), origin)


def policy(keys: list[Key], *, revoked: list[Key] = (), max_version: int | None = None) -> TrustPolicy:
    entry: dict[str, object] = {"keys": [k.line for k in keys]}
    if max_version is not None:
        entry["max_version"] = max_version
    doc = {"schema": "cubinstore/trust/v1", "channels": {"prod": entry}, "revoked": [k.id for k in revoked]}
    return TrustPolicy.from_bytes(json.dumps(doc).encode(), source="policy.json")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The decision does no I/O: any socket it opened would fail the test."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("trust.verify opened a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    yield


def test_the_highest_valid_version_wins_and_nothing_is_refused() -> None:
    ci = Key()
    offers = [("a", ci.release(3)), ("b", ci.release(5)), ("c", ci.release(4))]
    decision = decide("prod", offers, policy([ci]), None, NOW)
    assert decision.best is offers[1][1] and decision.refused == ()


def test_an_invalid_offer_is_refused_with_its_reason_and_a_valid_one_still_wins() -> None:
    ci, thief = Key(), Key()
    good = ci.release(2)
    forged = thief.release(9)
    decision = decide("prod", [("thief", forged), ("ci", good)], policy([ci]), None, NOW)
    assert decision.best is good
    [(origin, why)] = decision.refused
    assert origin == "thief" and isinstance(why, TrustError)
    assert f"is signed by key {thief.id}, which policy.json does not allow for channel 'prod'" in str(why)


def test_an_altered_record_or_another_channel_is_refused() -> None:
    ci = Key()
    offer = ci.release(2)
    bad_sig = SignatureBlob.build(offer.record, ci.id, bytes(64))
    other = ci.release(2, channel="staging")
    decision = decide("prod", [("x", Candidate(offer.record, bad_sig, "x")), ("y", other)], policy([ci]), None, NOW)
    assert decision.best is None
    assert "does not verify; the record or signature was altered" in str(decision.refused[0][1])
    assert "is for channel 'staging', not 'prod'; refusing a record of another channel" in str(decision.refused[1][1])


def test_expiry_is_judged_against_the_clock_given() -> None:
    ci = Key()
    offer = ci.release(2, expires=NOW + 10)
    assert decide("prod", [("r", offer)], policy([ci]), None, NOW + 9).best is offer
    decision = decide("prod", [("r", offer)], policy([ci]), None, NOW + 10)
    assert decision.best is None
    [(_, why)] = decision.refused
    assert isinstance(why, ExpiredReleaseError) and "channel:prod version 2 from remote expired at" in str(why)


def test_the_floor_refuses_a_rollback_and_a_fork_but_not_the_release_it_names() -> None:
    ci = Key()
    current = ci.release(5)
    floor = (ci.id, Accepted(5, current.signature.digest))
    assert decide("prod", [("r", current)], policy([ci]), floor, NOW).best is current
    older, fork = ci.release(4), ci.release(5, manifest=b"another build")
    decision = decide("prod", [("old", older), ("fork", fork)], policy([ci]), floor, NOW)
    assert decision.best is None
    assert "offers version 4, but this host already accepted version 5" in str(decision.refused[0][1])
    assert "refusing a forked channel" in str(decision.refused[1][1])
    with pytest.raises(RollbackError, match=r"this host \(another process, meanwhile\) already accepted"):
        check_floor("prod", older, floor, meanwhile="(another process, meanwhile) ")


def test_a_revoked_key_neither_signs_nor_holds_the_floor() -> None:
    ci, thief = Key(), Key()
    rules = policy([ci, thief], revoked=[thief])
    state = ChannelState("prod", {thief.id: Accepted(2**63 - 1, thief.release(7).signature.digest),
                                  ci.id: Accepted(3, ci.release(3).signature.digest)})
    floor = state.floor(rules)
    assert floor is not None and floor[0] == ci.id
    assert any(f"key {thief.id} is revoked by policy.json" in line for line in state.ignored(rules))
    decision = decide("prod", [("thief", thief.release(8)), ("ci", ci.release(4))], rules, floor, NOW)
    assert decision.best is not None and decision.best.record.version == 4
    assert "which policy.json revokes" in str(decision.refused[0][1])


def test_max_version_caps_what_is_accepted() -> None:
    ci = Key()
    decision = decide("prod", [("r", ci.release(11))], policy([ci], max_version=10), None, NOW)
    assert decision.best is None and "is above max_version 10" in str(decision.refused[0][1])


def test_the_refusal_names_the_most_specific_reason() -> None:
    missing = MissingBlobError("signature not available")
    rollback = RollbackError("refusing a rollback")
    expired = ExpiredReleaseError("expired")
    chosen = refusal([missing, expired, rollback])
    assert type(chosen) is RollbackError and str(chosen) == "refusing a rollback (and 2 other problems)"
    assert refusal([missing]) is missing
    ci = Key()
    decision = decide("prod", [("gone", missing), ("r", ci.release(1, expires=NOW - 1))], policy([ci]), None, NOW)
    assert decision.best is None and [origin for origin, _ in decision.refused] == ["gone", "r"]
    assert isinstance(refusal([why for _, why in decision.refused]), ExpiredReleaseError)
