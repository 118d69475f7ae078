"""``Digest``: a sha256 content address, validated once where it enters the program."""

from __future__ import annotations

from cubinstore.errors import BadArgumentError, IntegrityError

__all__ = ["Digest", "EMPTY_SHA256_HEX", "verify"]

_PREFIX = "sha256:"
_HEX_LEN = 64
_HEX_CHARS = frozenset("0123456789abcdef")
# sha256(b""); a test checks it. A constant, so that importing this module does not import hashlib.
EMPTY_SHA256_HEX = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def _check_hex(hex_: object, original: object) -> str:
    if not isinstance(hex_, str):
        raise BadArgumentError(
            f"invalid digest: expected a string 'sha256:<64 lowercase hex>', got {type(hex_).__name__}"
        )
    if len(hex_) == _HEX_LEN and _HEX_CHARS.issuperset(hex_):  # the common case; the checks below word the error
        return hex_
    from cubinstore._core.text import show  # an error path: `import cubinstore` loads this module only

    if len(hex_) != _HEX_LEN:
        raise BadArgumentError(
            f"invalid digest length: {len(hex_)}, expected {_HEX_LEN} (in {show(original)})"
        )
    for pos, char in enumerate(hex_):
        if char not in _HEX_CHARS:
            raise BadArgumentError(
                f"invalid digest character {show(char)} at position {pos}: "
                f"expected lowercase hex (in {show(original)})"
            )
    return hex_


class Digest:
    """A sha256 digest. ``str(d)`` is ``sha256:<hex>``; ``d.hex`` is the 64 hex characters.

    Construction validates, so a ``Digest`` can always be used to build a path
    or URL safely: only 64 lowercase hex characters ever reach ``hex``. Immutable,
    hashable, equal by value. (A plain class rather than a frozen dataclass: importing
    ``dataclasses`` was a fifth of ``import cubinstore``.)
    """

    __slots__ = ("hex",)
    hex: str

    def __init__(self, hex: str) -> None:  # noqa: A002 - the field's public name
        object.__setattr__(self, "hex", _check_hex(hex, hex))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Digest is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Digest is immutable: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is Digest:
            return self.hex == other.hex  # type: ignore[attr-defined]
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.hex)

    def __repr__(self) -> str:
        return f"Digest(hex={self.hex!r})"

    def __reduce__(self) -> tuple[type[Digest], tuple[str]]:
        return (Digest, (self.hex,))

    @classmethod
    def parse(cls, text: object) -> Digest:
        """Parse ``sha256:<64 lowercase hex>``; raise ``BadArgumentError`` naming what is wrong."""
        if isinstance(text, Digest):
            return text
        if not isinstance(text, str):
            raise BadArgumentError(
                "invalid digest: expected a string 'sha256:<64 lowercase hex>', "
                f"got {type(text).__name__}"
            )
        if not text.startswith(_PREFIX):
            from cubinstore._core.text import show

            raise BadArgumentError(f"invalid digest {show(text)}: expected the prefix 'sha256:'")
        # Checked here once; the constructor would check the same hex again (a manifest parses thousands).
        digest = object.__new__(cls)
        object.__setattr__(digest, "hex", _check_hex(text[len(_PREFIX) :], text))
        return digest

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview) -> Digest:
        """The digest of ``data``."""
        import hashlib

        return cls(hashlib.sha256(data).hexdigest())

    @property
    def algorithm(self) -> str:
        return "sha256"

    @property
    def short(self) -> str:
        """First 12 hex characters, for progress lines and logs."""
        return self.hex[:12]

    @property
    def is_empty_blob(self) -> bool:
        """True for the digest of zero bytes, which is never a valid CUBIN."""
        return self.hex == EMPTY_SHA256_HEX

    def __str__(self) -> str:
        return _PREFIX + self.hex


def verify(data: bytes, digest: Digest, size: int | None, *, where: str, name: str | None = None) -> None:
    """Raise ``IntegrityError`` unless ``data`` has ``size`` bytes (checked first) and hashes to ``digest``."""
    # The one sha256 check of fetched and stored bytes. The messages are built only on a
    # mismatch: this runs once per blob of every fetch and pack.
    import hashlib  # not at import: `import cubinstore` stays small
    if size is not None and len(data) != size:
        what = f"{digest}" + (f" ({name})" if name else "")
        raise IntegrityError(f"size mismatch for {what} from {where}: expected {size} bytes, got {len(data)}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest.hex:
        what = f"{digest}" + (f" ({name})" if name else "")
        raise IntegrityError(f"digest mismatch for {what} from {where}: expected {digest}, got sha256:{actual}")
