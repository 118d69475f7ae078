"""The REAPI ActionResult codec (cubinstore/store/action_result.py) and the HTTP store's `/ac/`
transport: round trips, hostile bytes, the real protobuf library (BuildGrid's generated REAPI
classes, run in `.venv-buildgrid`), nginx and BuildGrid's action cache."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubinstore import BadArgumentError, Digest, IntegrityError
from cubinstore.store import HttpLayer
from cubinstore.store.action_result import (
    MAX_ACTION_RESULT_BYTES,
    ActionResult,
    BlobDigest,
    OutputFile,
    action_digest_for,
    action_for,
    decode_action_result,
)

REPO = Path(__file__).resolve().parents[2]
BUILDGRID_PYTHON = REPO / ".venv-buildgrid" / "bin" / "python"
REQUIRE_ENV = "CUBINSTORE_REQUIRE_BAZEL_TESTS"  # as tests/bazel/conftest.py: CI fails instead of skipping

CUBIN = b"\x7fELF\x02\x01\x01" + random.Random(7).randbytes(1000)
KEY = hashlib.sha256(b"a cubinstore-nvcc key").hexdigest()
SCHEME = "nvcc-cubin/v1"


def unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def a_result(**overrides: object) -> ActionResult:
    fields: dict[str, object] = dict(
        output_files=(OutputFile("kernel.cubin", Digest.of(CUBIN), len(CUBIN)),),
        stdout_raw=b"ptxas info    : Used 32 registers\n",
        stderr_raw=b"kernel.cu(3): warning #177-D: variable declared but never referenced\n",
    )
    fields.update(overrides)
    return ActionResult(**fields)  # type: ignore[arg-type]


# -- wire format written by hand, apart from the module's encoder ---------------------------------

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def length_field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def digest_msg(hex_: str, size: int) -> bytes:
    return length_field(1, hex_.encode()) + varint_field(2, size)


def output_msg(path: bytes, digest: bytes | None = None, *extra: bytes) -> bytes:
    if digest is None:
        digest = digest_msg(Digest.of(CUBIN).hex, len(CUBIN))
    return length_field(1, path) + length_field(2, digest) + b"".join(extra)


def unknown_fields(first: int) -> bytes:
    """One unknown field of each wire type, a group holding a nested group among them."""
    group = (varint(first + 3 << 3 | 3) + varint_field(1, 5) + varint(2 << 3 | 3) + length_field(1, b"x")
             + varint(2 << 3 | 4) + varint(3 << 3 | 1) + bytes(8) + varint(first + 3 << 3 | 4))
    return (varint_field(first, 1 << 63) + varint(first + 1 << 3 | 1) + bytes(range(8))
            + length_field(first + 2, b"\xff\x00 anything") + group + varint(first + 4 << 3 | 5) + b"\x01\x02\x03\x04")


# -- round trips ----------------------------------------------------------------------------------

def test_a_result_round_trips_through_its_canonical_bytes() -> None:
    result = a_result(
        output_files=(OutputFile("out/kernel.cubin", Digest.of(CUBIN), len(CUBIN), contents=CUBIN),
                      OutputFile("run.sh", Digest.of(b"#!/bin/sh\n"), 10, is_executable=True)),
        exit_code=-2,
        stdout_digest=BlobDigest.of(b"ptxas info    : Used 32 registers\n"),
        stderr_raw=b"",
        stderr_digest=BlobDigest.of(b"a log kept in the CAS"),
    )
    data = result.encode()
    assert decode_action_result(data) == result
    assert a_result().encode() == a_result().encode()
    assert data[0] == 2 << 3 | 2  # output_files (field 2) first: fields go in number order


def test_an_empty_stdout_digest_reads_as_none_but_an_empty_output_digest_is_refused() -> None:
    # What a writer that always sets the sub-message sends for "no digest".
    assert decode_action_result(length_field(6, b"")).stdout_digest is None
    with pytest.raises(IntegrityError, match=r"^malformed ActionResult: output_files\[0\]\.digest\.hash at byte 11: "
                                             r"invalid digest length: 0, expected 64"):
        decode_action_result(length_field(2, output_msg(b"k.cubin", b"")))


def test_unknown_fields_of_every_wire_type_are_skipped_at_every_level() -> None:
    result = a_result(exit_code=3)
    hex_ = Digest.of(CUBIN).hex
    data = (unknown_fields(20)
            + length_field(2, length_field(1, b"kernel.cubin") + unknown_fields(9)
                           + length_field(2, unknown_fields(30) + digest_msg(hex_, len(CUBIN)) + unknown_fields(40))
                           + unknown_fields(50))
            + unknown_fields(60) + varint_field(4, 3)
            + length_field(5, result.stdout_raw) + length_field(7, result.stderr_raw) + unknown_fields(100))
    assert decode_action_result(data) == result


def test_every_prefix_and_every_flipped_byte_is_a_result_or_an_integrity_error() -> None:
    data = a_result(stdout_digest=BlobDigest.of(b"ptxas info    : Used 32 registers\n"), exit_code=1).encode()
    rng = random.Random(0)
    candidates = [data[:cut] for cut in range(len(data))]
    candidates += [data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1:] for i in range(len(data))]
    refused = 0
    for candidate in candidates:
        try:
            decode_action_result(candidate)
        except IntegrityError as exc:
            assert str(exc).startswith("malformed ActionResult: ")
            refused += 1
    assert refused > len(data)  # most damage is caught, not read as another valid result


# -- hostile bytes --------------------------------------------------------------------------------

GOOD_HEX = Digest.of(CUBIN).hex

HOSTILE = {
    "truncated string": (length_field(2, output_msg(b"kernel.cubin"))[:-30],
                         "output_files (field 2) at byte 0: length 85 runs past the end of its message (55 bytes left)"),
    "length past the end": (b"\x12\x05ab", "output_files (field 2) at byte 0: length 5 runs past the end"),
    "huge declared length": (b"\x2a" + varint(1 << 62) + b"x",
                             f"stdout_raw (field 5) at byte 0: length {1 << 62} runs past the end"),
    "overlong varint": (b"\x20" + b"\xff" * 10 + b"\x01", "exit_code (field 4) at byte 1: varint longer than 10 bytes"),
    "varint over 64 bits": (b"\x20" + b"\xff" * 9 + b"\x02", "exit_code (field 4) at byte 1: varint longer than 10 bytes"),
    "varint cut short": (b"\x20\xff\xff", "exit_code (field 4) at byte 1: varint runs past the end"),
    "fixed64 cut short": (b"\x49" + bytes(7), "field 9 at byte 0: 8-byte value runs past the end"),
    "field number 0": (b"\x02\x00", "field key at byte 0: field number 0 is out of range"),
    "wire type 6": (b"\x26", "exit_code (field 4) at byte 0: invalid wire type 6"),
    "wire type 7": (b"\x7f", "field 15 at byte 0: invalid wire type 7"),
    "end-group alone": (b"\x4c", "field 9 at byte 0: end-group with no group open"),
    "group never closed": (b"\x4b\x08\x01", "field 9 at byte 3: group 9 is never closed"),
    "group closed by another": (b"\x4b\x54", "field 9 at byte 1: end-group 10 closes group 9"),
    "groups nested too deep": (b"\x4b" * 40, "field 9 at byte 32: groups nested deeper than 32"),
    "wrong wire type": (length_field(4, b"\x00"), "exit_code at byte 0: expected wire type 0 (varint), got 2"),
    "field twice": (varint_field(4, 0) + varint_field(4, 1), "exit_code at byte 2: field appears twice"),
    "exit code over int32": (varint_field(4, 1 << 32), "exit_code at byte 0: 4294967296 is out of the int32 range"),
    "path ..": (length_field(2, output_msg(b"../x")), "output_files[0].path at byte 2: '../x' has a '..' component"),
    "path inner ..": (length_field(2, output_msg(b"a/../../x")), "output_files[0].path at byte 2: 'a/../../x' has a '..'"),
    "absolute path": (length_field(2, output_msg(b"/etc/passwd")), "output_files[0].path at byte 2: '/etc/passwd' is absolute"),
    "empty path part": (length_field(2, output_msg(b"a//b")), "output_files[0].path at byte 2: 'a//b' has a empty component"),
    "dot path part": (length_field(2, output_msg(b"./a")), "output_files[0].path at byte 2: './a' has a '.' component"),
    "no path": (length_field(2, length_field(2, digest_msg(GOOD_HEX, 3))),
                "output_files[0].path at byte 0: '' is empty"),
    "newline in path": (length_field(2, output_msg(b"a\nb")), "output_files[0].path at byte 2: 'a\\nb' has a control"),
    "NUL in path": (length_field(2, output_msg(b"a\x00b")), "output_files[0].path at byte 2: 'a\\x00b' has a control"),
    "path not UTF-8": (length_field(2, output_msg(b"a\xffb")), "output_files[0].path at byte 2: not UTF-8"),
    "path too long": (length_field(2, output_msg(b"a" * 4097)), "output_files[0].path at byte 3: 'aaaa"),
    "no digest": (length_field(2, length_field(1, b"k.cubin")), "output_files[0].digest at byte 0: output 'k.cubin' has no digest"),
    "uppercase hex": (length_field(2, output_msg(b"k", digest_msg(GOOD_HEX.upper(), 5))),
                      "output_files[0].digest.hash at byte 7: invalid digest character"),
    "63 hex": (length_field(2, output_msg(b"k", digest_msg(GOOD_HEX[:63], 5))),
               "output_files[0].digest.hash at byte 7: invalid digest length: 63, expected 64"),
    "path in the hash": (length_field(2, output_msg(b"k", digest_msg("../" + GOOD_HEX[3:], 5))),
                         "output_files[0].digest.hash at byte 7: invalid digest character '.' at position 0"),
    "negative size": (length_field(2, output_msg(b"k", digest_msg(GOOD_HEX, -1))),
                      "output_files[0].digest.size_bytes at byte 73: -1 is negative"),
    "is_executable 2": (length_field(2, output_msg(b"k", None, varint_field(4, 2))),
                        "output_files[0].is_executable at byte 76: 2 is not a bool (0 or 1)"),
    "contents not the digest's": (length_field(2, output_msg(b"k", None, length_field(5, CUBIN[:-1] + b"!"))),
                                  "output_files[0] at byte 0: contents of output k: bytes do not match"),
    "same path twice": (length_field(2, output_msg(b"k")) * 2, "output_files[1].path at byte 76: 'k' appears twice"),
    "stdout not its digest": (length_field(5, b"abc") + length_field(6, digest_msg(GOOD_HEX, 3)),
                              "stdout_raw at byte 0: stdout_raw: bytes do not match"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bytes_are_refused_naming_the_field_and_offset(case: str) -> None:
    data, message = HOSTILE[case]
    with pytest.raises(IntegrityError) as info:
        decode_action_result(data)
    assert str(info.value).startswith(f"malformed ActionResult: {message}"), str(info.value)


def test_the_size_limit_is_checked_before_any_byte_is_parsed() -> None:
    garbage = b"\xff" * 101  # parsed, it would be a bad varint
    with pytest.raises(IntegrityError, match=r"^malformed ActionResult: 101 bytes, over the limit of 100; not parsed"):
        decode_action_result(garbage, limit=100)
    with pytest.raises(IntegrityError, match=rf"^malformed ActionResult: {MAX_ACTION_RESULT_BYTES + 1} bytes, over"):
        decode_action_result(bytes(MAX_ACTION_RESULT_BYTES + 1))


def test_values_that_would_encode_a_hostile_result_are_refused_when_built() -> None:
    digest = Digest.of(CUBIN)
    with pytest.raises(BadArgumentError, match=r"^invalid output path '\.\./x': has a '\.\.' component"):
        OutputFile("../x", digest, 5)
    with pytest.raises(BadArgumentError, match=r"^invalid size of output k: expected an int64 >= 0, got -1"):
        OutputFile("k", digest, -1)
    with pytest.raises(BadArgumentError, match=r"^ActionResult\.output_files: path 'k' appears twice"):
        ActionResult((OutputFile("k", digest, 5), OutputFile("k", digest, 5)))
    with pytest.raises(BadArgumentError, match=r"^ActionResult of \d+ bytes is over the 4194304-byte limit"):
        a_result(stdout_raw=bytes(MAX_ACTION_RESULT_BYTES)).encode()


# -- the action a key is stored under -------------------------------------------------------------

def test_the_action_digest_is_a_function_of_scheme_and_key_only() -> None:
    assert action_digest_for(SCHEME, KEY) == action_digest_for(SCHEME, KEY)
    assert action_digest_for(SCHEME, KEY) != action_digest_for("nvcc-fatbin/v1", KEY)
    assert action_digest_for(SCHEME, KEY) != action_digest_for(SCHEME, hashlib.sha256(b"other").hexdigest())
    blobs = action_for(SCHEME, KEY)
    assert blobs.digest.digest.hex == action_digest_for(SCHEME, KEY) == hashlib.sha256(blobs.action).hexdigest()
    assert KEY.encode() in blobs.command and blobs.input_root == b""
    # cubinstore-nvcc's call keys are xxh3-128 (32 hex): they name actions too.
    assert action_digest_for(SCHEME, KEY[:32]) != action_digest_for(SCHEME, KEY)


@pytest.mark.parametrize(("scheme", "key", "message"), [
    ("nvcc cubin", KEY, "invalid key scheme 'nvcc cubin': expected 1..64 characters"),
    ("", KEY, "invalid key scheme '': expected"),
    (SCHEME, KEY.upper(), "invalid key for scheme nvcc-cubin/v1: expected 32 or 64 lowercase hex"),
    (SCHEME, KEY[:63], "invalid key for scheme nvcc-cubin/v1: expected 32 or 64 lowercase hex"),
    (SCHEME, KEY[:31], "invalid key for scheme nvcc-cubin/v1: expected 32 or 64 lowercase hex"),
])
def test_a_malformed_scheme_or_key_names_no_action(scheme: str, key: str, message: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        action_digest_for(scheme, key)
    assert str(info.value).startswith(message)


# -- the real protobuf library --------------------------------------------------------------------

# Runs in .venv-buildgrid: BuildGrid's generated REAPI classes over google.protobuf.
PROTOBUF_SCRIPT = r'''
import hashlib, json, sys
from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2 as re

def fields(result):
    def digest(d):
        return [d.hash, d.size_bytes]
    return {
        "output_files": [{"path": f.path, "digest": digest(f.digest), "is_executable": f.is_executable,
                          "contents": f.contents.hex()} for f in result.output_files],
        "exit_code": result.exit_code, "stdout_raw": result.stdout_raw.hex(), "stderr_raw": result.stderr_raw.hex(),
        "stdout_digest": digest(result.stdout_digest) if result.HasField("stdout_digest") else None,
        "stderr_digest": digest(result.stderr_digest) if result.HasField("stderr_digest") else None,
    }

def build(doc):
    result = re.ActionResult(exit_code=doc["exit_code"], stdout_raw=bytes.fromhex(doc["stdout_raw"]),
                             stderr_raw=bytes.fromhex(doc["stderr_raw"]))
    for f in doc["output_files"]:
        result.output_files.add(path=f["path"], digest=re.Digest(hash=f["digest"][0], size_bytes=f["digest"][1]),
                                is_executable=f["is_executable"], contents=bytes.fromhex(f["contents"]))
    return result

def rich(doc):
    """What Bazel or BuildGrid write: every field cubinstore skips, set."""
    result = build(doc)
    result.output_files[0].node_properties.properties.add(name="n", value="v")
    result.output_files[0].node_properties.unix_mode.value = 0o755
    result.output_file_symlinks.add(path="l1", target="kernel.cubin")
    result.output_symlinks.add(path="l2", target="kernel.cubin")
    result.output_directories.add(path="d", tree_digest=re.Digest(hash="ab" * 32, size_bytes=9),
                                  is_topologically_sorted=True)
    result.output_directory_symlinks.add(path="l3", target="d")
    stdout = result.stdout_raw
    result.stdout_digest.hash, result.stdout_digest.size_bytes = hashlib.sha256(stdout).hexdigest(), len(stdout)
    meta = result.execution_metadata
    meta.worker = "worker-7"
    meta.queued_timestamp.seconds = 1700000000
    meta.execution_completed_timestamp.nanos = 5
    meta.virtual_execution_duration.seconds = 2
    meta.auxiliary_metadata.add().Pack(re.Digest(hash="cd" * 32, size_bytes=1))
    return result

answers = []
for job in json.load(sys.stdin):
    op = job["op"]
    if op == "parse":
        answers.append(fields(re.ActionResult.FromString(bytes.fromhex(job["hex"]))))
    elif op == "serialize":
        answers.append(build(job["doc"]).SerializeToString(deterministic=True).hex())
    elif op == "rich":
        answers.append(rich(job["doc"]).SerializeToString().hex())
    elif op == "action":
        action = re.Action.FromString(bytes.fromhex(job["action"]))
        command = re.Command.FromString(bytes.fromhex(job["command"]))
        directory = re.Directory.FromString(bytes.fromhex(job["input_root"]))
        built = re.Action(command_digest=re.Digest(hash=hashlib.sha256(command.SerializeToString()).hexdigest(),
                                                   size_bytes=len(command.SerializeToString())),
                          input_root_digest=re.Digest(hash=hashlib.sha256(b"").hexdigest(), size_bytes=0))
        answers.append({"arguments": list(command.arguments), "empty_root": directory == re.Directory(),
                        "command_digest": [action.command_digest.hash, action.command_digest.size_bytes],
                        "input_root_digest": [action.input_root_digest.hash, action.input_root_digest.size_bytes],
                        "built_action_sha256": hashlib.sha256(built.SerializeToString(deterministic=True)).hexdigest()})
json.dump(answers, sys.stdout)
'''


def protobuf(jobs: list[dict]) -> list:
    if not BUILDGRID_PYTHON.exists():
        unavailable("no .venv-buildgrid with google.protobuf (tools/bootstrap.sh installs it)")
    proc = subprocess.run([str(BUILDGRID_PYTHON), "-c", PROTOBUF_SCRIPT], input=json.dumps(jobs),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def as_doc(result: ActionResult) -> dict:
    """``result`` in the protobuf script's terms."""
    def digest(blob: BlobDigest | None) -> list | None:
        return None if blob is None else [blob.digest.hex, blob.size]

    return {
        "output_files": [{"path": f.path, "digest": [f.digest.hex, f.size], "is_executable": f.is_executable,
                          "contents": f.contents.hex()} for f in result.output_files],
        "exit_code": result.exit_code, "stdout_raw": result.stdout_raw.hex(), "stderr_raw": result.stderr_raw.hex(),
        "stdout_digest": digest(result.stdout_digest), "stderr_digest": digest(result.stderr_digest),
    }


def test_protobuf_reads_our_bytes_and_writes_the_same_bytes() -> None:
    plain = a_result(exit_code=-1, output_files=(
        OutputFile("kernel.cubin", Digest.of(CUBIN), len(CUBIN), contents=CUBIN),
        OutputFile("bin/tool", Digest.of(b"x"), 1, is_executable=True)))
    with_digests = a_result(stdout_digest=BlobDigest.of(plain.stdout_raw), stderr_digest=BlobDigest.of(b"err"),
                            stderr_raw=b"")
    padded = unknown_fields(20) + plain.encode() + unknown_fields(60)  # our notion of skippable is protobuf's
    parsed, again, parsed_digests, parsed_padded = protobuf([
        {"op": "parse", "hex": plain.encode().hex()},
        {"op": "serialize", "doc": as_doc(plain)},
        {"op": "parse", "hex": with_digests.encode().hex()},
        {"op": "parse", "hex": padded.hex()},
    ])
    assert parsed == as_doc(plain) == parsed_padded
    assert bytes.fromhex(again) == plain.encode()  # byte for byte protobuf's deterministic serialization
    assert parsed_digests == as_doc(with_digests)
    assert decode_action_result(padded) == plain


def test_a_result_protobuf_wrote_with_every_field_we_skip_decodes() -> None:
    ours = a_result(output_files=(OutputFile("kernel.cubin", Digest.of(CUBIN), len(CUBIN), is_executable=True),))
    (rich,) = protobuf([{"op": "rich", "doc": as_doc(ours)}])
    decoded = decode_action_result(bytes.fromhex(rich))
    assert decoded.output_files == ours.output_files and decoded.stdout_raw == ours.stdout_raw
    assert decoded.stdout_digest == BlobDigest.of(ours.stdout_raw) and decoded.stderr_raw == ours.stderr_raw


def test_the_action_command_and_input_root_are_valid_reapi_messages() -> None:
    blobs = action_for(SCHEME, KEY)
    (seen,) = protobuf([{"op": "action", "action": blobs.action.hex(), "command": blobs.command.hex(),
                         "input_root": blobs.input_root.hex()}])
    assert seen["arguments"] == ["cubinstore-nvcc", SCHEME, KEY] and seen["empty_root"]
    assert seen["command_digest"] == [hashlib.sha256(blobs.command).hexdigest(), len(blobs.command)]
    assert seen["input_root_digest"] == [hashlib.sha256(b"").hexdigest(), 0]
    assert seen["built_action_sha256"] == action_digest_for(SCHEME, KEY)


# -- the HTTP cache's /ac/ (nginx WebDAV) ---------------------------------------------------------

def http(url: str) -> HttpLayer:
    return HttpLayer(url, connect_timeout=2.0, read_timeout=5.0, retries=1, deadline=20.0, backoff=0.01)


@pytest.mark.usefixtures("clean_env")
def test_an_action_result_put_to_nginx_is_read_back_under_its_action_digest(nginx) -> None:
    url = nginx.base()
    store = http(url)
    action = action_digest_for(SCHEME, KEY)
    assert store.get_action_result(action) is None  # a clean miss: 404
    result = a_result()
    store.put_action_result(action, result.encode())
    assert (nginx.www / url.rsplit("/", 1)[1] / "ac" / action).read_bytes() == result.encode()
    assert decode_action_result(http(url).get_action_result(action)) == result  # type: ignore[arg-type]
    assert nginx.requests("GET", f"/ac/{action}") == 2 and nginx.requests("PUT", f"/ac/{action}") == 1


@pytest.mark.usefixtures("clean_env")
def test_a_malformed_action_digest_makes_no_request(nginx) -> None:
    url = nginx.base()
    prefix = url.rsplit("/", 1)[1]
    for bad in ("../../etc/passwd", KEY[:63], KEY.upper(), KEY + "\n"):
        with pytest.raises(BadArgumentError, match=rf"^invalid action digest for {url}/ac/: invalid digest"):
            http(url).get_action_result(bad)
        with pytest.raises(BadArgumentError, match=rf"^invalid action digest for {url}/ac/: invalid digest"):
            http(url).put_action_result(bad, b"")
    with pytest.raises(BadArgumentError, match=rf"^action result for {KEY} is {MAX_ACTION_RESULT_BYTES + 1} bytes, over"):
        http(url).put_action_result(KEY, bytes(MAX_ACTION_RESULT_BYTES + 1))
    assert nginx.requests("GET", prefix) == nginx.requests("PUT", prefix) == 0


@pytest.mark.usefixtures("clean_env")
def test_an_oversized_entry_is_refused_before_its_body_is_read(nginx) -> None:
    url = nginx.base()
    path = nginx.www / url.rsplit("/", 1)[1] / "ac" / KEY
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(MAX_ACTION_RESULT_BYTES + 1))
    with pytest.raises(IntegrityError, match=rf"^GET {url}/ac/{KEY}: server declares {MAX_ACTION_RESULT_BYTES + 1} "
                                             rf"bytes, expected at most {MAX_ACTION_RESULT_BYTES}; not downloaded"):
        http(url).get_action_result(KEY)


@pytest.mark.usefixtures("clean_env")
def test_an_endless_entry_stops_at_the_limit(faulty) -> None:
    faulty.script(f"/ac/{KEY}", [("endless",)])
    with pytest.raises(IntegrityError, match=rf"^GET {faulty.url}/ac/{KEY}: body longer than the expected "
                                             rf"{MAX_ACTION_RESULT_BYTES} bytes; download stopped"):
        http(faulty.url).get_action_result(KEY)


# -- BuildGrid's action cache (REAPI over gRPC) ---------------------------------------------------

# Runs in .venv-buildgrid: uploads blobs to the CAS, stores our bytes as the action's result,
# reads it back; prints what GetActionResult answered.
BUILDGRID_SCRIPT = r'''
import json, sys
import grpc
from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2 as re
from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2_grpc as services

job = json.load(sys.stdin)
channel = grpc.insecure_channel(job["target"])
grpc.channel_ready_future(channel).result(timeout=60)
uploads = [re.BatchUpdateBlobsRequest.Request(digest=re.Digest(hash=h, size_bytes=len(bytes.fromhex(b))),
                                              data=bytes.fromhex(b)) for h, b in job["upload"].items()]
statuses = []
if uploads:
    reply = services.ContentAddressableStorageStub(channel).BatchUpdateBlobs(re.BatchUpdateBlobsRequest(requests=uploads))
    statuses = [r.status.code for r in reply.responses]
cache = services.ActionCacheStub(channel)
action = re.Digest(hash=job["action"][0], size_bytes=job["action"][1])
cache.UpdateActionResult(re.UpdateActionResultRequest(
    action_digest=action, action_result=re.ActionResult.FromString(bytes.fromhex(job["result"]))))
try:
    got = cache.GetActionResult(re.GetActionResultRequest(action_digest=action))
except grpc.RpcError as exc:
    answer = {"error": exc.code().name}
else:
    answer = {"result": got.SerializeToString().hex()}
answer["upload_status"] = statuses
json.dump(answer, sys.stdout)
'''


@pytest.fixture(scope="module")
def buildgrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from bazel._servers import BuildGridCache
    from bazel._workspace import find_bgd

    bgd = find_bgd()
    if bgd is None or not BUILDGRID_PYTHON.exists():
        unavailable("BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    server = BuildGridCache(tmp_path_factory.mktemp("buildgrid_ac"), bgd)  # type: ignore[arg-type]
    server.start()
    yield server
    server.stop()


def buildgrid_round_trip(server: object, action: BlobDigest, result: ActionResult, upload: dict[str, bytes]) -> dict:
    job = {"target": f"127.0.0.1:{server.port}", "action": [action.digest.hex, action.size],  # type: ignore[attr-defined]
           "result": result.encode().hex(), "upload": {Digest.of(b).hex: b.hex() for b in upload.values()}}
    proc = subprocess.run([str(BUILDGRID_PYTHON), "-c", BUILDGRID_SCRIPT], input=json.dumps(job),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.bazel
def test_buildgrid_keeps_our_result_once_its_output_is_in_the_cas(buildgrid) -> None:
    action = action_for(SCHEME, KEY).digest  # the Action itself is never uploaded: BuildGrid does not need it
    cubin = CUBIN + b"only in this test"  # not in the CAS yet, whichever test ran first
    result = a_result(output_files=(OutputFile("kernel.cubin", Digest.of(cubin), len(cubin)),))
    # BuildGrid drops an entry whose output blobs are missing from its CAS: upload the CUBIN first.
    assert buildgrid_round_trip(buildgrid, action, result, {})["error"] == "NOT_FOUND"
    answer = buildgrid_round_trip(buildgrid, action, result, {"cubin": cubin})
    assert answer["upload_status"] == [0], answer
    assert decode_action_result(bytes.fromhex(answer["result"])) == result
    assert bytes.fromhex(answer["result"]) == result.encode()


@pytest.mark.bazel
def test_buildgrid_takes_the_action_blobs_under_the_digests_we_computed(buildgrid) -> None:
    blobs = action_for("nvcc-ptx/v1", KEY)
    result = a_result()
    answer = buildgrid_round_trip(buildgrid, blobs.digest, result,
                                  {"cubin": CUBIN, "action": blobs.action, "command": blobs.command})
    assert answer["upload_status"] == [0, 0, 0], answer  # CAS checks each digest against the bytes
    assert decode_action_result(bytes.fromhex(answer["result"])) == result
