"""REAPI ``ActionResult`` and the ``Action`` that names one, in protobuf wire format, by hand.

``cubinstore-nvcc`` keeps its key -> CUBIN mapping in a remote's action cache, the one table
every Bazel remote cache already has (nginx's ``/ac/<hex>``, bazel-remote, BuildGrid). An entry
there must be a valid ``build.bazel.remote.execution.v2.ActionResult`` under the digest of a
valid ``Action``, or a REAPI server refuses it (bazel-remote validates what is PUT to ``/ac/``
as an ActionResult) and a reader on another cache cannot use it. The messages are written
here, not with the protobuf package: the package has no dependencies, and the handful of
fields needed is small. Writers upload the CUBIN to the CAS before the result that names it,
as Bazel does: BuildGrid answers NOT_FOUND for (and drops) a result whose outputs its CAS
lacks; it does not need the Action itself (tests/store/test_action_result.py shows both).

What a remote serves is hostile. ``decode_action_result`` refuses a message over
``MAX_ACTION_RESULT_BYTES`` before parsing it, checks every length against the bytes left,
reads varints of at most 10 bytes, skips unknown fields by their wire type (so a result
Bazel or BuildGrid wrote, with execution metadata and more, decodes), and validates every
value it keeps: relative printable paths without ``.``/``..``, lowercase sha256 hex, sizes
>= 0, inlined bytes that match their digest. Every refusal is an ``IntegrityError`` naming
the field and the byte offset.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, IntegrityError

__all__ = [
    "MAX_ACTION_RESULT_BYTES",
    "ActionBlobs",
    "ActionResult",
    "BlobDigest",
    "OutputFile",
    "TOOL",
    "action_digest_for",
    "action_for",
    "decode_action_result",
]

#: Largest ActionResult read or written: gRPC's default limit on a received message, so no
#: REAPI server hands out more; ours hold one digest and a compile's output.
MAX_ACTION_RESULT_BYTES = 4 * 1024 * 1024
_MAX_PATH_BYTES = 4096  # PATH_MAX
_MAX_GROUP_DEPTH = 32  # nested (deprecated) groups in an unknown field; a deeper nest is an attack
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64_MAX = (1 << 63) - 1
_UINT64 = 1 << 64
_MAX_FIELD_NUMBER = (1 << 29) - 1

# Wire types (protobuf encoding): what follows a field's key.
_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_WIRE_NAMES = {_VARINT: "varint", _I64: "fixed64", _LEN: "length-delimited", _SGROUP: "start-group",
               _EGROUP: "end-group", _I32: "fixed32"}

# The key's scheme names the action's command; a short token, never a path or free text.
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-/")
_MAX_SCHEME = 64
_HEX = frozenset("0123456789abcdef")
TOOL = "cubinstore-nvcc"  # Command.arguments[0] of every action this module names


# -- values ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlobDigest:
    """A REAPI ``Digest``: a sha256 and the size of the bytes it names."""

    digest: Digest
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, Digest):
            raise BadArgumentError(f"BlobDigest.digest: expected a Digest, got {type(self.digest).__name__}")
        _check_size(self.size, f"size of {self.digest}")

    @classmethod
    def of(cls, data: bytes) -> BlobDigest:
        return cls(Digest(hashlib.sha256(data).hexdigest()), len(data))


@dataclass(frozen=True)
class OutputFile:
    """One file an action produced: ``path`` relative to its working directory, the ``digest``
    and ``size`` of its bytes in the CAS, and ``contents``, the bytes themselves when inlined
    (b"" when not: proto3 cannot tell an inlined empty file from one not inlined)."""

    path: str
    digest: Digest
    size: int
    is_executable: bool = False
    contents: bytes = b""

    def __post_init__(self) -> None:
        problem = _path_problem(self.path)
        if problem:
            raise BadArgumentError(f"invalid output path {show(self.path)}: {problem}")
        if not isinstance(self.digest, Digest):
            raise BadArgumentError(f"output {self.path}: digest: expected a Digest, got {type(self.digest).__name__}")
        _check_size(self.size, f"size of output {self.path}")
        if not isinstance(self.is_executable, bool):
            raise BadArgumentError(f"output {self.path}: is_executable: expected a bool, got {show(self.is_executable)}")
        if not isinstance(self.contents, bytes):
            raise BadArgumentError(f"output {self.path}: contents: expected bytes, got {type(self.contents).__name__}")
        if self.contents:
            _check_inlined(self.contents, BlobDigest(self.digest, self.size), f"contents of output {self.path}")


@dataclass(frozen=True)
class ActionResult:
    """The fields of a REAPI ``ActionResult`` cubinstore reads and writes (output directories,
    symlinks and execution metadata are skipped when read and never written).

    ``stdout_raw``/``stderr_raw`` are the output inlined; ``stdout_digest``/``stderr_digest``
    name it in the CAS instead (or as well: then the two must agree)."""

    output_files: tuple[OutputFile, ...] = ()
    exit_code: int = 0
    stdout_raw: bytes = b""
    stderr_raw: bytes = b""
    stdout_digest: BlobDigest | None = None
    stderr_digest: BlobDigest | None = None

    def __post_init__(self) -> None:
        files = self.output_files
        if not isinstance(files, (tuple, list)) or not all(isinstance(f, OutputFile) for f in files):
            raise BadArgumentError(f"ActionResult.output_files: expected a tuple of OutputFile, got {show(files)}")
        object.__setattr__(self, "output_files", tuple(files))
        seen: set[str] = set()
        for output in files:
            if output.path in seen:  # which one a reader took would depend on the reader
                raise BadArgumentError(f"ActionResult.output_files: path {show(output.path)} appears twice")
            seen.add(output.path)
        if isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int) or not (
                _INT32[0] <= self.exit_code <= _INT32[1]):
            raise BadArgumentError(f"ActionResult.exit_code: expected an int32, got {show(self.exit_code)}")
        for stream in ("stdout", "stderr"):
            raw, digest = getattr(self, f"{stream}_raw"), getattr(self, f"{stream}_digest")
            if not isinstance(raw, bytes):
                raise BadArgumentError(f"ActionResult.{stream}_raw: expected bytes, got {type(raw).__name__}")
            if digest is not None and not isinstance(digest, BlobDigest):
                raise BadArgumentError(f"ActionResult.{stream}_digest: expected a BlobDigest or None, got {show(digest)}")
            if raw and digest is not None:
                _check_inlined(raw, digest, f"{stream}_raw")

    def encode(self) -> bytes:
        """The canonical wire form: fields in number order, defaults left out (what protobuf's
        deterministic serialization gives), so equal results are equal bytes."""
        out = bytearray()
        for output in self.output_files:
            out += _message(2, _encode_output_file(output))
        out += _int(4, self.exit_code)
        out += _bytes(5, self.stdout_raw)
        if self.stdout_digest is not None:
            out += _message(6, _encode_digest(self.stdout_digest))
        out += _bytes(7, self.stderr_raw)
        if self.stderr_digest is not None:
            out += _message(8, _encode_digest(self.stderr_digest))
        if len(out) > MAX_ACTION_RESULT_BYTES:
            raise BadArgumentError(
                f"ActionResult of {len(out)} bytes is over the {MAX_ACTION_RESULT_BYTES}-byte limit: "
                "put large stdout/stderr in the CAS and name them by digest"
            )
        return bytes(out)


# -- the action naming a key -------------------------------------------------------------------

@dataclass(frozen=True)
class ActionBlobs:
    """The encoded ``Action`` a key is stored under, and the ``Command`` and input root
    ``Directory`` it names: what to upload to a CAS that wants an action's blobs present."""

    action: bytes
    command: bytes
    input_root: bytes

    @property
    def digest(self) -> BlobDigest:
        return BlobDigest.of(self.action)


def action_for(kind: str, key_hex: str) -> ActionBlobs:
    """The REAPI ``Action`` under whose digest the result for key ``key_hex`` of scheme ``kind``
    is stored: ``Command{arguments: ["cubinstore-nvcc", kind, key_hex]}`` over an empty input root.

    Why an Action and not the key itself: a REAPI action cache is keyed by Action digests, and
    a server may read the Action from its CAS (BuildGrid refreshes it when present; it does not
    require it, a test shows). A real Action makes the entry one any REAPI server and its tools
    can make sense of, the key (already a content hash of every input) lives in the command
    line, and no Bazel action can ever have the same digest: its Command lists its own tool.
    The action is never executed; only trusted writers (CI) put results under it.
    """
    if not isinstance(kind, str) or not kind or len(kind) > _MAX_SCHEME or not _SCHEME_CHARS.issuperset(kind):
        raise BadArgumentError(
            f"invalid key scheme {show(kind)}: expected 1..{_MAX_SCHEME} characters of A-Z a-z 0-9 . _ + - /"
        )
    # A content key: 32 (xxh3-128, cubinstore-nvcc's call keys) or 64 (sha256) lowercase hex.
    if not isinstance(key_hex, str) or len(key_hex) not in (32, 64) or not _HEX.issuperset(key_hex):
        raise BadArgumentError(f"invalid key for scheme {kind}: expected 32 or 64 lowercase hex, got {show(key_hex)}")
    command = b"".join(_bytes(1, arg.encode()) for arg in (TOOL, kind, key_hex))
    input_root = b""  # an empty Directory: the key already covers every input
    action = _message(1, _encode_digest(BlobDigest.of(command))) + _message(2, _encode_digest(BlobDigest.of(input_root)))
    return ActionBlobs(action=action, command=command, input_root=input_root)


def action_digest_for(kind: str, key_hex: str) -> str:
    """The sha256 hex of ``action_for(kind, key_hex)``'s Action: the action-cache key of the mapping."""
    return action_for(kind, key_hex).digest.digest.hex


# -- encoding -------------------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    value &= _UINT64 - 1  # negative int32/int64: ten bytes of two's complement, as protobuf writes them
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _message(number: int, payload: bytes) -> bytes:
    """A sub-message: written even when empty, since its presence is part of the value."""
    return _key(number, _LEN) + _varint(len(payload)) + payload


def _bytes(number: int, payload: bytes) -> bytes:
    """A string or bytes field; left out when empty (proto3's default)."""
    return _message(number, payload) if payload else b""


def _int(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(value) if value else b""


def _encode_digest(blob: BlobDigest) -> bytes:
    return _bytes(1, blob.digest.hex.encode("ascii")) + _int(2, blob.size)


def _encode_output_file(output: OutputFile) -> bytes:
    return (_bytes(1, output.path.encode()) + _message(2, _encode_digest(BlobDigest(output.digest, output.size)))
            + _int(4, int(output.is_executable)) + _bytes(5, output.contents))


# -- decoding -------------------------------------------------------------------------------------

# The fields read, by number: (name, wire type). Any other field is skipped by its wire type.
_Known = dict[int, tuple[str, int]]
_RESULT_FIELDS: _Known = {2: ("output_files", _LEN), 4: ("exit_code", _VARINT), 5: ("stdout_raw", _LEN),
                          6: ("stdout_digest", _LEN), 7: ("stderr_raw", _LEN), 8: ("stderr_digest", _LEN)}
_OUTPUT_FIELDS: _Known = {1: ("path", _LEN), 2: ("digest", _LEN), 4: ("is_executable", _VARINT),
                          5: ("contents", _LEN)}
_DIGEST_FIELDS: _Known = {1: ("hash", _LEN), 2: ("size_bytes", _VARINT)}


def decode_action_result(data: bytes, *, limit: int = MAX_ACTION_RESULT_BYTES) -> ActionResult:
    """Parse an ``ActionResult`` from a remote. Raises ``IntegrityError`` naming the field and
    byte offset for anything malformed or invalid, and for more than ``limit`` bytes (checked
    before any parsing)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadArgumentError(f"ActionResult: expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise IntegrityError(f"malformed ActionResult: {len(data)} bytes, over the limit of {limit}; not parsed")
    data = bytes(data)
    outputs: list[OutputFile] = []
    values: dict[int, _Field] = {}
    for field in _fields(data, 0, len(data), "", _RESULT_FIELDS):
        if field.number == 2:
            name = f"output_files[{len(outputs)}]"
            _expect(field, _LEN, name)
            output = _decode_output_file(data, field, name)
            if any(output.path == seen.path for seen in outputs):  # which one a reader took would vary
                raise _malformed(f"{name}.path", field.offset, f"{show(output.path)} appears twice")
            outputs.append(output)
        elif field.number in _RESULT_FIELDS:  # 2 is handled above
            name, wire_type = _RESULT_FIELDS[field.number]
            _expect(field, wire_type, name)
            if field.number in values:  # readers differ on which copy wins: refuse both
                raise _malformed(name, field.offset, "field appears twice")
            values[field.number] = field
    streams: dict[str, tuple[bytes, BlobDigest | None]] = {}
    for stream, raw_number, digest_number in (("stdout", 5, 6), ("stderr", 7, 8)):
        raw = _payload(data, values.get(raw_number))
        digest = _optional_digest(data, values.get(digest_number), f"{stream}_digest")
        if raw and digest is not None:
            try:
                _check_inlined(raw, digest, f"{stream}_raw")
            except BadArgumentError as exc:
                raise _malformed(f"{stream}_raw", values[raw_number].offset, str(exc)) from None
        streams[stream] = (raw, digest)
    return ActionResult(
        output_files=tuple(outputs),
        exit_code=_int32(values[4], "exit_code") if 4 in values else 0,
        stdout_raw=streams["stdout"][0],
        stdout_digest=streams["stdout"][1],
        stderr_raw=streams["stderr"][0],
        stderr_digest=streams["stderr"][1],
    )


@dataclass(frozen=True)
class _Field:
    number: int
    wire_type: int
    offset: int  # of the field's key, from the start of the whole message
    value: int  # a varint or fixed value; for a length-delimited field, where its payload starts
    end: int = 0  # where a length-delimited payload ends


def _within(message: str, what: str) -> str:
    return f"{message} {what}" if message else what


def _malformed(name: str, offset: int, problem: str) -> IntegrityError:
    return IntegrityError(f"malformed ActionResult: {name} at byte {offset}: {problem}")


def _expect(field: _Field, wire_type: int, name: str) -> None:
    if field.wire_type != wire_type:
        raise _malformed(name, field.offset, f"expected wire type {wire_type} ({_WIRE_NAMES[wire_type]}), "
                                             f"got {field.wire_type} ({_WIRE_NAMES[field.wire_type]})")


def _read_varint(data: bytes, pos: int, end: int, name: str) -> tuple[int, int]:
    start = pos
    value = 0
    for shift in range(0, 70, 7):
        if pos >= end:
            raise _malformed(name, start, "varint runs past the end of its message")
        byte = data[pos]
        pos += 1
        if shift == 63 and byte > 1:  # the tenth byte holds the 64th bit only
            raise _malformed(name, start, "varint longer than 10 bytes or over 64 bits")
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise _malformed(name, start, "varint longer than 10 bytes or over 64 bits")


def _fields(data: bytes, pos: int, end: int, name: str, known: _Known) -> Iterator[_Field]:
    """Every field of the message ``name`` in ``data[pos:end]``; unknown groups are skipped here,
    other unknown fields by the caller ignoring them. Lengths are checked against ``end``;
    errors call a field by its name in ``known`` where it has one."""
    while pos < end:
        offset = pos
        key, pos = _read_varint(data, pos, end, _within(name, "field key"))
        number, wire_type = key >> 3, key & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise _malformed(_within(name, "field key"), offset,
                             f"field number {number} is out of range 1..{_MAX_FIELD_NUMBER}")
        where = _within(name, f"{known[number][0]} (field {number})" if number in known else f"field {number}")
        if wire_type == _VARINT:
            value, pos = _read_varint(data, pos, end, where)
            yield _Field(number, wire_type, offset, value)
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if end - pos < width:
                raise _malformed(where, offset, f"{width}-byte value runs past the end of its message")
            yield _Field(number, wire_type, offset, int.from_bytes(data[pos:pos + width], "little"))
            pos += width
        elif wire_type == _LEN:
            length, pos = _read_varint(data, pos, end, where)
            if length > end - pos:
                raise _malformed(where, offset, f"length {length} runs past the end of its message "
                                                f"({end - pos} bytes left)")
            yield _Field(number, wire_type, offset, pos, pos + length)
            pos += length
        elif wire_type == _SGROUP:
            pos = _skip_group(data, pos, end, number, where, 1)
        elif wire_type == _EGROUP:
            raise _malformed(where, offset, "end-group with no group open")
        else:
            raise _malformed(where, offset, f"invalid wire type {wire_type}")


def _skip_group(data: bytes, pos: int, end: int, number: int, where: str, depth: int) -> int:
    """The position after the end-group matching ``number``; the group's fields are skipped."""
    while pos < end:
        offset = pos
        key, pos = _read_varint(data, pos, end, where)
        inner, wire_type = key >> 3, key & 7
        if not 1 <= inner <= _MAX_FIELD_NUMBER:
            raise _malformed(where, offset, f"field number {inner} is out of range 1..{_MAX_FIELD_NUMBER}")
        if wire_type == _EGROUP:
            if inner != number:
                raise _malformed(where, offset, f"end-group {inner} closes group {number}")
            return pos
        if wire_type == _VARINT:
            pos = _read_varint(data, pos, end, where)[1]
        elif wire_type in (_I64, _I32):
            pos += 8 if wire_type == _I64 else 4
        elif wire_type == _LEN:
            length, pos = _read_varint(data, pos, end, where)
            pos += length
        elif wire_type == _SGROUP:
            if depth >= _MAX_GROUP_DEPTH:
                raise _malformed(where, offset, f"groups nested deeper than {_MAX_GROUP_DEPTH}")
            pos = _skip_group(data, pos, end, inner, where, depth + 1)
            continue
        else:
            raise _malformed(where, offset, f"invalid wire type {wire_type}")
        if pos > end:
            raise _malformed(where, offset, "field runs past the end of its message")
    raise _malformed(where, pos, f"group {number} is never closed")


def _payload(data: bytes, field: _Field | None) -> bytes:
    return data[field.value:field.end] if field is not None else b""


def _string(data: bytes, field: _Field, name: str) -> str:
    try:
        return data[field.value:field.end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed(name, field.offset, f"not UTF-8 ({exc.reason} at byte {field.value + exc.start})") from None


def _int32(field: _Field, name: str) -> int:
    value = field.value - _UINT64 if field.value >> 63 else field.value
    if not _INT32[0] <= value <= _INT32[1]:  # protobuf would cut it to 32 bits; that is never meant
        raise _malformed(name, field.offset, f"{value} is out of the int32 range")
    return value


def _digest_fields(data: bytes, outer: _Field, name: str) -> tuple[str, int, int]:
    """A Digest's hash (as parsed, unchecked), its size (>= 0) and the offset to blame for the hash."""
    seen: dict[int, _Field] = {}
    for field in _fields(data, outer.value, outer.end, name, _DIGEST_FIELDS):
        if field.number in _DIGEST_FIELDS:
            field_name, wire_type = _DIGEST_FIELDS[field.number]
            _expect(field, wire_type, f"{name}.{field_name}")
            if field.number in seen:
                raise _malformed(f"{name}.{field_name}", field.offset, "field appears twice")
            seen[field.number] = field
    hex_ = _string(data, seen[1], f"{name}.hash") if 1 in seen else ""
    size = 0
    if 2 in seen:
        raw = seen[2].value
        size = raw - _UINT64 if raw >> 63 else raw  # int64: two's complement
        if size < 0:
            raise _malformed(f"{name}.size_bytes", seen[2].offset, f"{size} is negative")
    return hex_, size, seen[1].offset if 1 in seen else outer.offset


def _decode_digest(data: bytes, outer: _Field, name: str, *, optional: bool = False) -> BlobDigest | None:
    hex_, size, offset = _digest_fields(data, outer, name)
    if optional and not hex_ and not size:
        return None  # an empty Digest: what a writer that always sets the field means by "none"
    try:
        return BlobDigest(Digest(hex_), size)
    except BadArgumentError as exc:
        raise _malformed(f"{name}.hash", offset, str(exc)) from None


def _optional_digest(data: bytes, field: _Field | None, name: str) -> BlobDigest | None:
    return None if field is None else _decode_digest(data, field, name, optional=True)


def _decode_output_file(data: bytes, outer: _Field, name: str) -> OutputFile:
    seen: dict[int, _Field] = {}
    for field in _fields(data, outer.value, outer.end, name, _OUTPUT_FIELDS):
        if field.number in _OUTPUT_FIELDS:
            field_name, wire_type = _OUTPUT_FIELDS[field.number]
            _expect(field, wire_type, f"{name}.{field_name}")
            if field.number in seen:
                raise _malformed(f"{name}.{field_name}", field.offset, "field appears twice")
            seen[field.number] = field
    path = _string(data, seen[1], f"{name}.path") if 1 in seen else ""
    problem = _path_problem(path)
    if problem:
        raise _malformed(f"{name}.path", seen[1].offset if 1 in seen else outer.offset, f"{show(path)} {problem}")
    if 2 not in seen:
        raise _malformed(f"{name}.digest", outer.offset, f"output {show(path)} has no digest")
    blob = _decode_digest(data, seen[2], f"{name}.digest")
    if blob is None:  # only an optional digest can be absent
        raise _malformed(f"{name}.digest", seen[2].offset, "no digest")
    executable = seen[4].value if 4 in seen else 0
    if executable > 1:
        raise _malformed(f"{name}.is_executable", seen[4].offset, f"{executable} is not a bool (0 or 1)")
    try:
        return OutputFile(path, blob.digest, blob.size, bool(executable), _payload(data, seen.get(5)))
    except BadArgumentError as exc:  # inlined contents that do not match the digest
        raise _malformed(name, outer.offset, str(exc)) from None


# -- checks -------------------------------------------------------------------------------------

def _path_problem(path: object) -> str | None:
    """Why ``path`` is not a safe output path (relative, '/'-separated, no '.' or '..' part,
    printable), or None."""
    if not isinstance(path, str):
        return f"is a {type(path).__name__}, expected a string"
    if not path:
        return "is empty"
    if len(path.encode("utf-8", "surrogatepass")) > _MAX_PATH_BYTES:
        return f"is longer than {_MAX_PATH_BYTES} bytes"
    if not path.isprintable():
        return "has a control or non-printable character"
    if path.startswith("/"):
        return "is absolute; expected a path relative to the action's working directory"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"has a {show(part) if part else 'empty'} component; expected a normalized relative path"
    return None


def _check_size(size: object, what: str) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= _INT64_MAX:
        raise BadArgumentError(f"invalid {what}: expected an int64 >= 0, got {show(size)}")


def _check_inlined(data: bytes, blob: BlobDigest, what: str) -> None:
    if len(data) != blob.size:
        raise BadArgumentError(f"{what}: {len(data)} bytes, but its digest says {blob.size}")
    if hashlib.sha256(data).hexdigest() != blob.digest.hex:
        raise BadArgumentError(f"{what}: bytes do not match {blob.digest}")
