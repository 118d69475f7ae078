"""Digest: validation at the boundary, value semantics, and what it costs to import."""

from __future__ import annotations

import copy
import hashlib
import pickle

import pytest

from cubinstore import Digest
from cubinstore.errors import BadArgumentError
from cubinstore.internals import EMPTY_SHA256_HEX


def test_the_empty_digest_constant_is_sha256_of_no_bytes() -> None:
    assert EMPTY_SHA256_HEX == hashlib.sha256(b"").hexdigest()
    assert Digest.of(b"").is_empty_blob and not Digest.of(b"x").is_empty_blob


def test_equal_digests_are_equal_hash_alike_and_survive_pickle_and_copy() -> None:
    d = Digest.of(b"kernel")
    e = Digest.parse(str(d))
    assert d == e and hash(d) == hash(e) and {d: 1}[e] == 1
    assert d != Digest.of(b"other") and d != d.hex  # a str is not a Digest
    assert pickle.loads(pickle.dumps(d)) == d and copy.deepcopy(d) == d
    assert repr(d) == f"Digest(hex={d.hex!r})" and str(d) == "sha256:" + d.hex


def test_a_digest_cannot_be_changed_after_it_was_validated() -> None:
    d = Digest.of(b"kernel")
    with pytest.raises(AttributeError, match="^Digest is immutable: cannot set 'hex'"):
        d.hex = "0" * 64  # type: ignore[misc]
    with pytest.raises(AttributeError, match="^Digest is immutable"):
        del d.hex


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sha256:" + "A" * 64, r"^invalid digest character 'A' at position 0: expected lowercase hex"),
        ("sha256:" + "a" * 63, r"^invalid digest length: 63, expected 64"),
        ("md5:" + "a" * 64, r"^invalid digest 'md5:a+': expected the prefix 'sha256:'"),
        ("sha256:" + "a" * 63 + "\u0661", r"^invalid digest character '\u0661' at position 63"),
    ],
)
def test_a_bad_digest_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        Digest.parse(text)
