"""Manifest schema validation, lookup, arch selection, and the Digest boundary type."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from cubinstore import (
    BadArgumentError,
    CubinstoreError,
    Digest,
    IncompatibleArchError,
    KernelNotFoundError,
    Manifest,
    ManifestError,
    Store,
    arch_compatible,
)
from cubinstore.manifest import dumps_canonical, fast, kernel_id
from cubinstore.store import MemoryLayer
from helpers.manifest_paths import full_checker as full_checker_of, outcome

pytestmark = pytest.mark.usefixtures("clean_env")

DATA = b"\x7fELF" + bytes(range(256)) * 8
HEX = hashlib.sha256(DATA).hexdigest()


def good_kernel() -> dict[str, Any]:
    return {
        "id": "axpy/f32/vec4/sm_90a",
        "family": "axpy",
        "params": {"dtype": "f32", "vec": 4},
        "arch": "sm_90a",
        "digest": f"sha256:{HEX}",
        "size": len(DATA),
        "entries": {"axpy_f32": ["i32", "f32", "ptr", "ptr"]},
        "target": "//kernels/axpy:axpy_f32_vec4_sm_90a",
    }


def doc_with(**changes: Any) -> dict[str, Any]:
    kernel = good_kernel()
    for key, value in changes.items():
        if value is _DELETE:
            del kernel[key]
        else:
            kernel[key] = value
    return {"schema": "cubinstore/manifest/v1", "kernels": [kernel]}


_DELETE = object()

# A v2 kernel: a templated entry with its mangled symbol, readable name, offsets and launch geometry.
V2_KERNEL: dict[str, Any] = {
    "id": "tgemm/bf16/bm128/sm_90a", "family": "tgemm", "params": {"dtype": "bf16", "bm": 128}, "arch": "sm_90a",
    "digest": f"sha256:{HEX}", "size": len(DATA), "target": "//kernels/tgemm:tgemm_bf16_bm128_sm_90a",
    "entries": {"_ZN2ns4gemmILi128EEEvj14CUtensorMap_st": {
        "name": "ns::gemm<128>", "params": ["u32", "tensormap", "struct:12:4"], "offsets": [0, 112, 240],
        "launch": {"block": [384, 1, 1], "shared_mem": 1024, "grid": ["min(sm_count, cdiv(args[0], 128))"]}}},
}


def parse(doc: Any) -> Manifest:
    return Manifest.from_bytes(json.dumps(doc).encode(), source="m.json")


def test_valid_manifest_parses_and_exposes_specs() -> None:
    m = parse(doc_with())
    (k,) = m.kernels
    assert k.id == "axpy/f32/vec4/sm_90a"
    assert k.digest == Digest(HEX) and k.size == len(DATA)
    assert dict(k.params) == {"dtype": "f32", "vec": 4}
    assert k.entries["axpy_f32"] == ("i32", "f32", "ptr", "ptr")
    assert m.by_id(k.id) is k
    assert m.archs == ("sm_90a",)
    assert m.digest == Digest.of(json.dumps(doc_with()).encode())
    with pytest.raises(TypeError):
        k.params["vec"] = 8  # type: ignore[index]


def test_specs_are_frozen_and_hashable() -> None:
    k = parse(doc_with()).kernels[0]
    with pytest.raises(AttributeError):
        k.size = 1  # type: ignore[misc]
    assert {k: 1}[parse(doc_with()).kernels[0]] == 1


BAD_FIELDS = [
    # (field changes, message start after "invalid manifest m.json: ")
    (dict(size=0), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected a positive integer (bytes), got 0"),
    (dict(size=-4), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected a positive integer (bytes), got -4"),
    (dict(size=4224.0), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected a positive integer (bytes), got 4224.0"),
    (dict(size=True), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected a positive integer (bytes), got True"),
    (dict(size="4224"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected a positive integer"),
    (dict(size=2**40), "kernels[0] (id 'axpy/f32/vec4/sm_90a').size: expected at most"),
    (dict(digest="sha256:" + HEX[:-1]), "kernels[0] (id 'axpy/f32/vec4/sm_90a').digest: invalid digest length: 63, expected 64"),
    (dict(digest="sha256:" + HEX.upper()), "kernels[0] (id 'axpy/f32/vec4/sm_90a').digest: invalid digest character"),
    (dict(digest="md5:" + HEX), "kernels[0] (id 'axpy/f32/vec4/sm_90a').digest: invalid digest 'md5:"),
    (dict(digest="sha256:../../etc/passwd"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').digest: invalid digest length"),
    (dict(digest="sha256:" + hashlib.sha256(b"").hexdigest()), "kernels[0] (id 'axpy/f32/vec4/sm_90a').digest: sha256:e3b0"),
    (dict(arch="sm90a"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').arch: expected 'sm_<digits>'"),
    (dict(arch="sm_90b"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').arch: expected 'sm_<digits>'"),
    (dict(arch="compute_90"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').arch: expected 'sm_<digits>'"),
    (dict(id="axpy/f32/vec4/sm_80"), "kernels[0] (id 'axpy/f32/vec4/sm_80').id: expected '<family>/<param values>/<arch>'"),
    (dict(id="axpy/f32/vec8/sm_90a"), "kernels[0] (id 'axpy/f32/vec8/sm_90a').id: expected '<family>/<param values>/<arch>'"),
    (dict(id="gemm/f32/vec4/sm_90a"), "kernels[0] (id 'gemm/f32/vec4/sm_90a').id: expected"),
    (dict(id=7), "kernels[0].id: expected a string, got 7"),
    (dict(family="ax/py"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').family: expected a name"),
    (dict(family=""), "kernels[0] (id 'axpy/f32/vec4/sm_90a').family: expected a name"),
    (dict(params=[1]), "kernels[0] (id 'axpy/f32/vec4/sm_90a').params: expected an object, got list"),
    (dict(params={"dtype": "f32", "vec": 4.0}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').params.vec: expected a string or an integer, got 4.0"),
    (dict(params={"dtype": "f/32", "vec": 4}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').params.dtype: expected a value"),
    (dict(params={"dtype": "f32", "vec": True}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').params.vec: expected a string or an integer, got True"),
    (dict(params={"d-type": "f32", "vec": 4}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').params: expected identifier keys, got 'd-type'"),
    (dict(entries={}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').entries: expected a non-empty object"),
    (dict(entries={"axpy f32": ["i32"]}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').entries: expected C identifiers as entry names, got 'axpy f32'"),
    (dict(entries={"1axpy": ["i32"]}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').entries: expected C identifiers"),
    (dict(entries={"axpy_f32": ["int"]}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').entries.axpy_f32[0]: expected one of i8 u8 i16 u16 i32 u32 i64 u64 f16 bf16 f32 f64 ptr tensormap struct:<size>:<align>, got 'int'"),
    (dict(entries={"axpy_f32": "i32"}), "kernels[0] (id 'axpy/f32/vec4/sm_90a').entries.axpy_f32: expected a list of parameter types"),
    (dict(target="kernels/axpy:x"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').target: expected a Bazel label like '//pkg:name', got 'kernels/axpy:x'"),
    (dict(target="//kernels/../etc:x"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').target: expected a Bazel label"),
    (dict(target="//k:a b"), "kernels[0] (id 'axpy/f32/vec4/sm_90a').target: expected a Bazel label"),
    (dict(target=None), "kernels[0] (id 'axpy/f32/vec4/sm_90a').target: expected a Bazel label"),
    (dict(path="/abs/x.cubin"), "kernels[0] (id 'axpy/f32/vec4/sm_90a'): unknown key 'path'"),
    (dict(size=_DELETE), "kernels[0] (id 'axpy/f32/vec4/sm_90a'): missing key 'size'"),
    (dict(entries=_DELETE), "kernels[0] (id 'axpy/f32/vec4/sm_90a'): missing key 'entries'"),
]


@pytest.mark.parametrize("changes, message", BAD_FIELDS, ids=[m.split(":")[0][:60] + str(i) for i, (_, m) in enumerate(BAD_FIELDS)])
def test_each_malformed_field_is_rejected_naming_field_and_value(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse(doc_with(**changes))
    assert str(info.value).startswith("invalid manifest m.json: " + message), str(info.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"schema": "cubinstore/manifest/v3", "kernels": []}', "schema: expected 'cubinstore/manifest/v2' or 'cubinstore/manifest/v1', got 'cubinstore/manifest/v3'"),
        (b'{"kernels": []}', "schema: expected 'cubinstore/manifest/v2' or 'cubinstore/manifest/v1', got None"),
        (b'{"schema": "cubinstore/manifest/v1", "kernels": []}', "kernels: expected a non-empty list, got []"),
        (b'{"schema": "cubinstore/manifest/v1", "kernels": {}}', "kernels: expected a non-empty list, got {}"),
        (b'{"schema": "cubinstore/manifest/v1", "kernels": [1]}', "kernels[0]: expected an object, got int"),
        (b'{"schema": "cubinstore/manifest/v1", "kernels": [], "extra": 1}', "top level: unknown key 'extra'"),
        (b'[]', "top level: expected an object, got list"),
        (b'{"schema": "a", "schema": "b"}', "file: duplicate key 'schema'"),
        (b'{"schema": NaN}', "file: not valid JSON: NaN is not allowed"),
        (b'{"schema": "\xff"}', "file: expected UTF-8, got an invalid byte at offset 12"),
        (b'{"schema": ', "file: not valid JSON: Expecting value at line 1 column 12"),
        (b"", "file: not valid JSON: Expecting value at line 1 column 1"),
        (b"[" * 100000 + b"]" * 100000, "file: JSON nested too deeply"),
        (b'{"size": ' + b"9" * 5000 + b"}", "file: not valid JSON"),
    ],
)
def test_malformed_documents_are_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError) as info:
        Manifest.from_bytes(raw, source="m.json")
    assert str(info.value).startswith("invalid manifest m.json: " + message), str(info.value)


def test_duplicate_ids_are_rejected() -> None:
    doc = doc_with()
    doc["kernels"].append(good_kernel())
    with pytest.raises(ManifestError, match=r"^invalid manifest m\.json: kernels\[1\]\.id: duplicate id 'axpy/f32/vec4/sm_90a'"):
        parse(doc)


def test_one_digest_with_two_sizes_is_rejected() -> None:
    doc = doc_with()
    other = good_kernel()
    other.update(id="axpy/f32/vec4/sm_80", arch="sm_80", size=len(DATA) + 1)
    doc["kernels"].append(other)
    with pytest.raises(ManifestError, match=r"^invalid manifest m\.json: kernels\[1\] \(id 'axpy/f32/vec4/sm_80'\)\.size: sha256:"):
        parse(doc)


def test_a_single_kernel_id_may_order_its_params_either_way() -> None:
    kernel = good_kernel()
    kernel["id"] = "axpy/vec4/f32/sm_90a"
    m = parse({"schema": "cubinstore/manifest/v1", "kernels": [kernel]})
    assert m.kernels[0].id == "axpy/vec4/f32/sm_90a"


def test_permuted_ids_of_one_kernel_identity_are_rejected() -> None:
    # Identity is (family, params, arch): two spellings of one kernel would make select() pick one silently.
    doc = doc_with()
    twin = good_kernel()
    twin["id"] = "axpy/vec4/f32/sm_90a"
    doc["kernels"].append(twin)
    with pytest.raises(ManifestError, match=(
        r"^invalid manifest m\.json: kernels\[1\] \(id 'axpy/vec4/f32/sm_90a'\): same family, params and arch "
        r"as kernels\[0\] \(id 'axpy/f32/vec4/sm_90a'\)")):
        parse(doc)


def test_ids_of_one_family_must_follow_one_grid_order() -> None:
    doc = doc_with()
    other = good_kernel()
    other.update(id="axpy/vec4/f64/sm_90a", params={"dtype": "f64", "vec": 4})
    doc["kernels"].append(other)
    with pytest.raises(ManifestError, match=(
        r"^invalid manifest m\.json: kernels\[1\] \(id 'axpy/vec4/f64/sm_90a'\)\.id: renders the params of family "
        r"'axpy' in another order than kernels\[0\]")):
        parse(doc)


def test_family_order_check_handles_equal_string_values() -> None:
    # {"a": "f32", "b": "f32"} fits either order; the next kernel decides which.
    def kernel(a: str, b: str) -> dict[str, Any]:
        k = good_kernel()
        k.update(id=f"axpy/{a}/{b}/sm_90a", params={"a": a, "b": b})
        return k

    m = parse({"schema": "cubinstore/manifest/v1", "kernels": [kernel("f32", "f32"), kernel("f32", "f64"), kernel("f64", "f32")]})
    assert len(m) == 3


def test_v1_manifests_still_load_and_rebuild_as_v2() -> None:
    m = parse(doc_with())
    assert m.schema == "cubinstore/manifest/v1"
    (k,) = m.kernels
    entry = k.entry("axpy_f32")
    assert (entry.symbol, entry.name, entry.types, entry.offsets, entry.launch) == (
        "axpy_f32", "axpy_f32", ("i32", "f32", "ptr", "ptr"), None, None)
    built = Manifest.build(m.kernels)
    assert built.schema == "cubinstore/manifest/v2"
    assert json.loads(built.raw)["kernels"][0]["entries"] == {
        "axpy_f32": {"name": "axpy_f32", "params": ["i32", "f32", "ptr", "ptr"], "offsets": [0, 4, 8, 16]}}


def test_build_writes_canonical_json_and_round_trips() -> None:
    m = Manifest.build([V2_KERNEL])
    assert m.raw == dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": [V2_KERNEL]})
    assert m.raw.endswith(b"}\n") and b"\": " not in m.raw
    built = Manifest.build(m.kernels)
    assert built.raw == m.raw
    assert Manifest.from_bytes(built.raw).kernels == m.kernels
    assert built.digest == Digest.of(built.raw)
    assert kernel_id("axpy", {"dtype": "f32", "vec": 4}, "sm_90a") == "axpy/f32/vec4/sm_90a"


def test_from_path_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(json.dumps(doc_with()).encode())
    assert Manifest.from_path(path).source == str(path)
    with pytest.raises(ManifestError, match=r"^cannot read manifest .*nope\.json: No such file"):
        Manifest.from_path(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(json.dumps(doc_with(size=0)).encode())
    with pytest.raises(ManifestError, match=rf"^invalid manifest {bad}: kernels\[0\]"):
        Manifest.from_path(bad)


def test_a_fifo_as_manifest_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)  # nobody writes it: an open that blocks would hang the test
    with pytest.raises(ManifestError, match=rf"^cannot read manifest {fifo}: it is a FIFO; expected a regular file"):
        Manifest.from_path(fifo)


def test_from_digest_pins_the_manifest_bytes() -> None:
    raw = dumps_canonical(doc_with())
    memory = MemoryLayer()
    digest = Digest.of(raw)
    memory.write(digest, raw)
    m = Manifest.from_digest(str(digest), Store([memory]))
    assert m.digest == digest and m.source == str(digest)
    assert Manifest.load(str(digest), Store([memory])).kernels == m.kernels
    # The manifest sits below the store: it builds none, and names the resolver that does.
    with pytest.raises(BadArgumentError, match=r"pass store=, or call cubinstore\._release\.refs\.load_manifest"):
        Manifest.load(str(digest))


# -- arch selection -------------------------------------------------------------------------------

ARCH_TABLE = [
    ("sm_90a", (9, 0), True),
    ("sm_90a", (9, 1), False),   # 'a' only on exactly X.Y
    ("sm_90a", (10, 0), False),
    ("sm_90", (9, 0), True),
    ("sm_80", (8, 0), True),
    ("sm_80", (8, 6), True),     # same major, higher minor
    ("sm_80", (8, 9), True),
    ("sm_86", (8, 0), False),    # lower minor than the CUBIN
    ("sm_80", (9, 0), False),    # never across majors
    ("sm_90", (8, 9), False),
    ("sm_86a", (8, 6), True),
    ("sm_86a", (8, 9), False),
    ("sm_100a", (10, 0), True),
    ("sm_100", (10, 3), True),
    ("sm_120", (12, 1), True),
    ("sm_120a", (12, 1), False),
    ("sm_100f", (10, 3), True),  # family-specific: that major, minor at least
    ("sm_103f", (10, 0), False),
    ("sm_100f", (11, 0), False),
]


@pytest.mark.parametrize("arch, cc, ok", ARCH_TABLE)
def test_arch_compatibility_table(arch: str, cc: tuple[int, int], ok: bool) -> None:
    assert arch_compatible(arch, cc) is ok


@pytest.mark.parametrize("bad", ["sm_9", "sm_090", "SM_90", "sm_90b", "", "sm_９０", "sm_05", "sm_1000", "sm_90af"])
def test_malformed_arch_is_a_bad_argument(bad: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid arch"):
        arch_compatible(bad, (9, 0))


@pytest.mark.parametrize("cc", [(9,), (9, "0"), [9, 0], (9, -1), (True, 0)])
def test_malformed_compute_capability_is_a_bad_argument(cc: Any) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid compute capability"):
        arch_compatible("sm_90", cc)


def multi_arch_manifest(archs: list[str], dtypes: tuple[str, ...] = ("f32",)) -> Manifest:
    kernels = []
    for dtype in dtypes:
        for arch in archs:
            data = f"{dtype}{arch}".encode() * 10
            kernels.append({
                "id": f"axpy/{dtype}/vec4/{arch}", "family": "axpy", "params": {"dtype": dtype, "vec": 4},
                "arch": arch, "digest": str(Digest.of(data)), "size": len(data),
                "entries": {f"axpy_{dtype}": {"name": f"axpy_{dtype}", "params": ["i32", "f32", "ptr", "ptr"],
                                               "offsets": [0, 4, 8, 16]}},
                "target": f"//kernels/axpy:axpy_{dtype}_vec4_{arch}",
            })
    return Manifest.build(kernels, source="multi.json")


@pytest.mark.parametrize(
    "cc, expected",
    [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_86"), ((8, 7), "sm_86")],
)
def test_select_prefers_exact_arch_then_highest_compatible_minor(cc: tuple[int, int], expected: str) -> None:
    m = multi_arch_manifest(["sm_80", "sm_86", "sm_90", "sm_90a"])
    assert m.select("axpy", cc, dtype="f32", vec=4).arch == expected
    assert m.select("axpy/f32/vec4", cc).arch == expected


def test_select_sm90_without_the_a_variant() -> None:
    m = multi_arch_manifest(["sm_80", "sm_90"])
    assert m.select("axpy", (9, 0), dtype="f32").arch == "sm_90"


@pytest.mark.parametrize("cc", [(7, 5), (10, 0), (9, 1)])
def test_select_never_returns_a_wrong_arch_and_lists_archs(cc: tuple[int, int]) -> None:
    m = multi_arch_manifest(["sm_80", "sm_90a"])
    with pytest.raises(IncompatibleArchError) as info:
        m.select("axpy", cc, dtype="f32")
    message = str(info.value)
    assert message.startswith(f"no CUBIN of 'axpy' for compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]})")
    assert "sm_80, sm_90a" in message


def test_sm90a_cubin_is_not_selected_on_9_1() -> None:
    m = multi_arch_manifest(["sm_90a"])
    with pytest.raises(IncompatibleArchError, match=r"candidates have sm_90a"):
        m.select("axpy/f32/vec4", (9, 1))


def test_select_by_full_id_checks_the_arch() -> None:
    m = multi_arch_manifest(["sm_80", "sm_90a"])
    assert m.select("axpy/f32/vec4/sm_80", (8, 6)).id == "axpy/f32/vec4/sm_80"
    with pytest.raises(IncompatibleArchError):
        m.select("axpy/f32/vec4/sm_90a", (8, 0))


def test_select_ambiguous_params_name_the_missing_key() -> None:
    m = multi_arch_manifest(["sm_80"], dtypes=("f32", "f64"))
    with pytest.raises(BadArgumentError, match=r"^select\('axpy'\) is ambiguous: 2 parameter sets match; pass dtype"):
        m.select("axpy", (8, 0))
    assert m.select("axpy", (8, 0), dtype="f64").params["dtype"] == "f64"


def test_unknown_kernel_and_family() -> None:
    m = multi_arch_manifest(["sm_80"])
    with pytest.raises(KernelNotFoundError, match=r"^no kernel 'gemm/x' in manifest multi\.json"):
        m.by_id("gemm/x")
    with pytest.raises(KernelNotFoundError, match=r"^no kernel matches gemm dtype='f32'"):
        m.select("gemm", (9, 0), dtype="f32")
    assert m.find("axpy", dtype="f32") == [m.by_id("axpy/f32/vec4/sm_80")]
    assert m.find("axpy", dtype="bf16") == []


# -- Digest ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, message",
    [
        ("sha256:" + "a" * 63, "invalid digest length: 63, expected 64"),
        ("sha256:" + "a" * 65, "invalid digest length: 65, expected 64"),
        ("sha256:" + "A" * 64, "invalid digest character 'A' at position 0: expected lowercase hex"),
        ("sha256:" + "a" * 63 + "\0", "invalid digest character '\\x00' at position 63"),
        ("sha256:../" + "a" * 61, "invalid digest character '.' at position 0"),
        ("SHA256:" + "a" * 64, "invalid digest 'SHA256:"),
        ("a" * 64, "invalid digest 'aaaa"),
        (b"sha256:" + b"a" * 64, "invalid digest: expected a string"),
        (None, "invalid digest: expected a string"),
    ],
)
def test_digest_parse_rejects_malformed_input(text: Any, message: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        Digest.parse(text)
    assert str(info.value).startswith(message), str(info.value)


def test_digest_value_semantics() -> None:
    d = Digest.parse("sha256:" + HEX)
    assert d.hex == HEX and str(d) == "sha256:" + HEX and d == Digest.of(DATA)
    assert Digest.parse(d) is d and hash(d) == hash(Digest(HEX))
    assert Digest.of(b"").is_empty_blob and not d.is_empty_blob
    with pytest.raises(BadArgumentError):
        Digest("x" * 64)


def test_parsers_fed_random_input_raise_only_typed_errors() -> None:
    rng = random.Random(1234)
    base = json.dumps(doc_with()).encode()
    alphabet = b'{}[]":,0123456789abcdefsha:\\ \n\x00\xff-.'
    for _ in range(1500):
        raw = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            pos = rng.randrange(len(raw))
            op = rng.randrange(3)
            if op == 0:
                raw[pos] = rng.choice(alphabet)
            elif op == 1:
                del raw[pos]
            else:
                raw.insert(pos, rng.choice(alphabet))
        try:
            Manifest.from_bytes(bytes(raw), source="fuzz")
        except CubinstoreError:
            pass
        text = "sha256:" + "".join(rng.choice("0123456789abcdefG/.\0 ") for _ in range(rng.randrange(60, 68)))
        try:
            Digest.parse(text)
        except CubinstoreError:
            pass
    # The unmodified document still parses: the loop above exercised real mutations.
    assert Manifest.from_bytes(base).kernels


def test_deep_copy_of_doc_is_not_shared() -> None:
    doc = doc_with()
    m = parse(copy.deepcopy(doc))
    doc["kernels"][0]["params"]["vec"] = 8
    assert m.kernels[0].params["vec"] == 4


# -- JIT templates ----------------------------------------------------------------------------------

def _template(family: str = "axpy", **changes: Any) -> dict[str, Any]:
    doc = {
        "schema": "cubinstore/jit-family/v1", "family": family, "grid_keys": ["dtype", "vec"],
        "source": "kernels/axpy/axpy.cu", "bundle": {"digest": "sha256:" + "ef" * 32, "size": 1234},
        "defines": ["DTYPE_{dtype}", "VEC={vec}"], "copts": [], "includes": [],
        "entries": {"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]}, "archs": ["sm_90a"], "package": "kernels/axpy",
    }
    doc.update(changes)
    return doc


def test_a_family_jit_template_is_read_and_its_bundle_is_in_the_closure() -> None:
    m = Manifest.build([good_kernel()], jit_templates={"axpy": _template()})
    assert set(m.jit_templates) == {"axpy"} and m.jit_templates["axpy"].grid_keys == ("dtype", "vec")
    assert (Digest("ef" * 32), 1234) in m.blobs and (Digest(HEX), len(DATA)) in m.blobs
    assert Manifest.from_bytes(m.raw).jit_templates["axpy"] == m.jit_templates["axpy"]


@pytest.mark.parametrize("families, message", [
    ({"gemm": {"jit": _template("gemm")}}, "families.gemm: names no family of the manifest's kernels (axpy)"),
    ({"axpy": {"jit": _template("gemm")}}, "families.axpy.jit.family: expected 'axpy', got 'gemm'"),
    ({"axpy": {"aot": 1}}, "families.axpy: expected {\"jit\": <template>}"),
    ({"axpy": {"jit": _template(bundle={"digest": "sha256:xyz", "size": 1})}}, "families.axpy.jit: bundle.digest: invalid digest"),
    ([], "families: expected an object of family -> {jit}"),
])
def test_malformed_jit_templates_are_rejected_naming_the_field(families: Any, message: str) -> None:
    doc = {"schema": "cubinstore/manifest/v2", "kernels": [Manifest.build([good_kernel()]).kernels[0].to_json()],
           "families": families}
    with pytest.raises(ManifestError) as info:
        Manifest.from_bytes(dumps_canonical(doc), source="m.json")
    assert str(info.value).startswith("invalid manifest m.json: " + message), str(info.value)


def test_v1_manifests_have_no_families_section() -> None:
    doc = doc_with()
    doc["families"] = {}
    with pytest.raises(ManifestError, match=r"^invalid manifest m\.json: top level: unknown key 'families'; allowed keys: kernels, schema"):
        parse(doc)


# -- entry tables cut from the text ---------------------------------------------------------------
# A canonical manifest whose kernels repeat their entry tables has each distinct table parsed and
# checked once (manifest._cut_entries). These documents take that path; each edit must get the
# answer the full checker gives.

def _shared_tables_doc() -> dict[str, Any]:
    entry = {"name": "ns::gemm<true>", "params": ["u32", "tensormap", "struct:12:4"], "offsets": [0, 112, 240],
             "launch": {"block": [384, 1, 1], "shared_mem": 1024, "grid": ["min(sm_count, cdiv(args[0], 128))"]}}
    kernels = []
    for i in range(8):
        arch = "sm_80" if i >= 6 else "sm_90a"
        body = dict(entry, offsets=[0, 32, 160]) if arch == "sm_80" else entry
        kernels.append({"id": f"tgemm/bf16/bm{64 * (i + 1)}/{arch}", "family": "tgemm",
                        "params": {"dtype": "bf16", "bm": 64 * (i + 1)}, "arch": arch,
                        "digest": "sha256:" + hashlib.sha256(bytes([i])).hexdigest(), "size": 100 + i,
                        "target": f"//kernels/tgemm:t{i}", "entries": {"_Z4gemm": copy.deepcopy(body)}})
    kernels.append({**good_kernel(), "entries": {
        "axpy_f32": {"name": "axpy_f32", "params": ["i32", "f32", "ptr", "ptr"], "offsets": [0, 4, 8, 16]}}})
    return {"schema": "cubinstore/manifest/v2", "kernels": kernels, "families": {"axpy": {"jit": _template()}}}


def _text(doc: Any) -> str:
    return dumps_canonical(doc).decode()


def _answer(text: str) -> Any:
    return outcome(text.encode())


@pytest.fixture
def full_checker() -> Any:
    """_answer with the fast path off."""
    return lambda text: full_checker_of(text.encode())


def test_repeated_entry_tables_are_parsed_once_and_give_the_full_checkers_specs(full_checker: Any) -> None:
    for families in (True, False):
        doc = _shared_tables_doc()
        if not families:
            del doc["families"]
        text = _text(doc)
        cut = fast._cut_entries(text)
        assert cut is not None and len(cut[1]) == 9 and len(cut[2]) == 3  # 9 kernels, 3 distinct tables
        m = Manifest.from_bytes(text.encode())
        objs, by_id = m._index._objs, m._index.by_id
        assert objs is not None
        assert objs[by_id["tgemm/bf16/bm64/sm_90a"]]["entries"] is objs[by_id["tgemm/bf16/bm128/sm_90a"]]["entries"]
        assert _answer(text) == full_checker(text)
        assert m.select("tgemm", (8, 0), dtype="bf16", bm=448).entry("ns::gemm<true>").offsets == (0, 32, 160)
    # Canonical kernels, the families section last: its template's entries are past the kernels'.
    doc = _shared_tables_doc()
    compact = {"sort_keys": True, "separators": (",", ":")}
    text = (f'{{"kernels":{json.dumps(doc["kernels"], **compact)},"schema":"{doc["schema"]}",'
            f'"families":{json.dumps(doc["families"], **compact)}}}')
    assert _answer(text) == full_checker(text) and _answer(text)[0] == "ok"


def _every_field(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    return [path, *(p for key, value in children for p in _every_field(value, (*path, key)))]


def test_each_field_changed_gets_the_full_checkers_answer(full_checker: Any) -> None:
    base = _shared_tables_doc()
    values: list[Any] = [0, 1, True, None, "x", "a:b", [], {}, {"a": 1}, [0, 4, 8, 16], "struct:12:4"]
    rng = random.Random(5)
    for path in _every_field(base)[1:]:
        for value in rng.sample(values, 3):
            doc = copy.deepcopy(base)
            node = doc
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            text = _text(doc)
            assert _answer(text) == full_checker(text), (path, value)


_SYMBOL = '"_Z4gemm":{'
_TABLE_EDITS = [
    ('"entries":{' + _SYMBOL, '"entries":{"family":{"name":"f","offsets":[],"params":[]},' + _SYMBOL),
    ('"entries":{' + _SYMBOL, '"entries":{"entries":{"name":"e","offsets":[],"params":[]},' + _SYMBOL),
    ('"entries":{' + _SYMBOL, '"entries":{' + _SYMBOL + '"name":"dup",'),        # a repeated key in a table
    ('"entries":{' + _SYMBOL, '"entries":{"_Z4gemm":{},' + _SYMBOL),              # a repeated symbol
    ('"entries":{' + _SYMBOL, '"entries": {' + _SYMBOL),
    (',"family":"tgemm"', ',"entries":{},"family":"tgemm"'),                        # two entries in a kernel
    (',"family":"tgemm"', ',"family":"tgemm","family":"tgemm"'),
    (',"family":"tgemm"', ' ,"family":"tgemm"'),
    (',"family":"tgemm"', ',"extra":1,"family":"tgemm"'),                  # more than the table before "family"
    ('"params":{"bm":64,', '"params":{"bm":64,"entries":1,'),
    ('"offsets":[0,112,240]', '"offsets":[0,112,true]'),
    ('"offsets":[0,112,240]', '"offsets":[0,112,240.0]'),
    ('"offsets":[0,112,240]', '"offsets":[0,112,[240]]'),
    ('"offsets":[0,112,240]', '"offsets":[0,112,240'),
    ('"name":"ns::gemm<true>"', '"name":"ns::gemm<{true}>"'),
    ('"name":"ns::gemm<true>"', '"name":"ns::gemm\t<true>"'),
    ('"grid":["min(sm_count, cdiv(args[0], 128))"]', '"grid":["cdiv(args[0], 128) # a: b"]'),
    ('"shared_mem":1024', '"shared_mem":1024,"shared_mem":0'),
    ('{"families":', '{"kernels":[],"families":'),
    ('"families":{"axpy":{"jit":{', '"families":{"axpy":{"jit":{"entries":{},'),
    ('"kernels":[', '"entries":{"_Z4gemm":{}},"kernels":['),
    ('"offsets":[0,32,160]', '"offsets":[0,112,240]'),                    # an sm_80 kernel with an sm_90a table
]


@pytest.mark.parametrize("old, new", _TABLE_EDITS)
@pytest.mark.parametrize("where", ["first", "last"])
def test_text_edits_around_cut_tables_get_the_full_checkers_answer(full_checker: Any, old: str, new: str,
                                                                   where: str) -> None:
    text = _text(_shared_tables_doc())
    assert old in text
    at = text.index(old) if where == "first" else text.rindex(old)
    edited = text[:at] + new + text[at + len(old):]
    assert _answer(edited) == full_checker(edited)
