"""The manifest's fast path: it accepts exactly what the full checker accepts, and stays linear.

``Manifest.from_bytes`` validates canonical v2 documents column by column and builds specs
lazily; anything it is unsure of goes to ``_Checker``. These tests feed both paths the same
mutated documents and compare the outcome (same specs, or the same error), and count the
work done at N and 2N kernels (never wall-clock time).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from helpers.manifest_paths import full_checker, outcome
from helpers.scale import assert_linear, count_work

from cubinstore import Manifest, ManifestError
from cubinstore import manifest as manifest_module

pytestmark = pytest.mark.usefixtures("clean_env")


def _digest(i: int) -> str:
    return "sha256:" + hashlib.sha256(str(i).encode()).hexdigest()


def _kernel(family: str, i: int, arch: str = "sm_90a", **extra: Any) -> dict[str, Any]:
    params = {"bm": 64 * (i % 4 + 1), "dtype": ["bf16", "f32"][i % 2], "stages": i}
    kid = f"{family}/bm{params['bm']}/{params['dtype']}/stages{i}/{arch}"
    entry = {"name": f"ns::k<{i}, true>", "params": ["u32", "tensormap", "struct:12:4"], "offsets": [0, 112, 240],
             "launch": {"block": [384, 1, 1], "shared_mem": 1024, "grid": ["min(sm_count, cdiv(args[0], 128))"]}}
    if arch == "sm_80":
        entry["offsets"] = [0, 32, 160]
    doc = {"id": kid, "family": family, "params": params, "arch": arch, "digest": _digest(i), "size": 1000 + i,
           "entries": {f"_Z1k{i}": entry}, "target": f"//kernels/{family}:t{i}_{arch}"}
    doc.update(extra)
    return doc


def _doc() -> dict[str, Any]:
    kernels = [_kernel("gemm", i) for i in range(6)] + [_kernel("gemm", i, "sm_80") for i in range(3)]
    plain = {"id": "axpy/f32/sm_90", "family": "axpy", "params": {"dtype": "f32"}, "arch": "sm_90",
             "digest": _digest(99), "size": 77, "target": "//k:axpy",
             "entries": {"axpy": {"name": "axpy", "params": ["i32", "f32", "ptr"], "offsets": [0, 4, 8]},
                         "axpy2": {"name": "::ns::axpy2", "params": [], "offsets": [],
                                   "launch": {"block": 128, "cluster": [2, 1], "grid": [7, "args[0]"]}}}}
    kernels.append(plain)
    template = {
        "schema": "cubinstore/jit-family/v1", "family": "axpy", "grid_keys": ["dtype"], "source": "kernels/axpy/axpy.cu",
        "bundle": {"digest": _digest(77), "size": 1234}, "defines": ["DTYPE_{dtype}"], "copts": [], "includes": [],
        "entries": {"axpy": ["i32", "f32", "ptr"]}, "archs": ["sm_90"], "package": "kernels/axpy",
    }
    return {"schema": "cubinstore/manifest/v2", "kernels": kernels, "families": {"axpy": {"jit": template}}}


def _doc_of(families: bool) -> dict[str, Any]:
    """``_doc()``, or without its families section."""
    doc = _doc()
    if not families:
        del doc["families"]
    return doc


def _compact(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_canonical_manifest_takes_the_fast_path() -> None:
    doc = _doc()
    m = Manifest.build(doc["kernels"], jit_templates={"axpy": doc["families"]["axpy"]["jit"]})
    assert m._index._objs is not None, "the full checker ran on a canonical manifest"  # its specs: _objs None
    assert m.jit_templates["axpy"].family == "axpy" and len(m.blobs) == 8  # 6 CUBINs, axpy, the bundle
    assert len(m) == 10 and m.by_id("axpy/f32/sm_90").entry("::ns::axpy2").launch.cluster == (2, 1, 1)
    assert m.select("gemm", (9, 0), bm=128, dtype="f32", stages=1).id == "gemm/bm128/f32/stages1/sm_90a"
    assert m.select("gemm", (8, 6), bm=64, dtype="bf16", stages=0).arch == "sm_80"


def test_fast_and_full_paths_give_the_same_specs() -> None:
    raw = _compact(_doc())
    fast = outcome(raw)
    assert fast[0] == "ok" and fast == full_checker(raw)
    m = Manifest.from_bytes(raw)
    assert m._index._objs is not None, "expected the fast path"


# Values a field may be mutated to: each wrong in some place, right in others.
_VALUES: list[Any] = [True, False, None, 0, 1, -1, 1.0, 2**40, "", ":x", "x", "sm_90", "f32", [], [1], [True],
                      {}, {"a": 1}, "sha256:" + "0" * 64, "//k:t", "i32", "struct:12:4", 384, [384, 1, 1], "min(1,2)"]


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize("families", [True, False])
def test_every_single_field_mutation_gets_the_same_answer_from_both_paths(families: bool) -> None:
    slow = full_checker
    doc = _doc_of(families)
    rng = random.Random(9)
    cases = 0
    for path in _paths(doc):
        for value in [*rng.sample(_VALUES, 6), _DELETE]:
            if value is _DELETE and not path:
                continue
            raw = _compact(_set(doc, path, value))
            assert outcome(raw) == slow(raw), (path, value)
            cases += 1
    assert cases > 1000


@pytest.mark.parametrize("families", [True, False])
def test_random_multi_field_mutations_get_the_same_answer(families: bool) -> None:
    slow = full_checker
    base = _doc_of(families)
    paths = _paths(base)
    rng = random.Random(23)
    for _ in range(300):
        doc = base
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(paths)
            try:
                doc = _set(doc, path, rng.choice(_VALUES))
            except (KeyError, IndexError, TypeError):
                continue
        raw = _compact(doc)
        assert outcome(raw) == slow(raw)


@pytest.mark.parametrize("where, extra", [
    ('{', '"schema":"cubinstore/manifest/v2",'),
    ('"kernels":[{', '"size":5,'),
    ('"kernels":[{', '"id":"gemm/x",'),
    ('"params":{', '"bm":64,'),
    ('"entries":{', '"_Z1k0":{"name":"y","params":[],"offsets":[]},'),
    ('"launch":{', '"block":[1],'),
    ('"launch":{', '"grid":[1],'),
    ('"_Z1k0":{', '"name":"::a",'),   # a repeated key whose value starts with ':'
    ('"families":{', '"axpy":{"jit":1},'),
    ('"bundle":{', '"size":1,'),
])
def test_a_repeated_key_anywhere_is_refused_by_both_paths(where: str, extra: str) -> None:
    text = _compact(_doc()).decode()
    assert where in text
    raw = text.replace(where, where + extra, 1).encode()
    expected = full_checker(raw)
    assert expected[0] == "error" and "duplicate key" in expected[2]
    assert outcome(raw) == expected


@pytest.mark.parametrize("edit", [
    lambda t: t.replace('"size":', '"size" :', 1),          # whitespace between a key and its colon
    lambda t: t.replace('"size":', '"size"\n:', 1).replace('"kernels":[{', '"kernels":[{"size":5,', 1),
    lambda t: t.replace('"f32"', '"f\\u0033\\u0032"', 1),   # an escape: the slow path decides
    lambda t: t.replace('"name":"axpy"', '"name":"a\\"b"', 1),
    lambda t: t.replace('"size":77', '"size":77.0', 1),
    lambda t: t.replace('"size":77', '"size":NaN', 1),
    lambda t: t.replace('"size":77', '"size":' + "9" * 5000, 1),
    lambda t: json.dumps(json.loads(t), indent=1),           # pretty-printed: still valid
    lambda t: json.dumps(json.loads(t)),                     # default separators
])
def test_text_level_edits_get_the_same_answer(edit: Callable[[str], str]) -> None:
    raw = edit(_compact(_doc()).decode()).encode()
    assert outcome(raw) == full_checker(raw)


@pytest.mark.parametrize("edit", [
    lambda t: t.replace('"block":128', '"block":{"x":1}', 1),          # an object inside a launch object
    lambda t: t.replace('"block":128', '"block":[1025]', 1),           # one bad geometry among repeats
    lambda t: t.replace('"entries":{"axpy":{', '"entries":{"axpy":{"launch":{"block":[2]},', 1),  # a repeated key
    lambda t: t.replace('"launch":{', '"launch": {', 1),                # not the text the count expects
    lambda t: t.replace('"families":{"axpy":{"jit":{', '"families":{"axpy":{"jit":{"launch":{"block":[1]},', 1),
])
def test_launch_objects_checked_from_the_text_get_the_same_answer(edit: Callable[[str], str]) -> None:
    text = _compact(_doc_of(True)).decode()
    raw = edit(text).encode()
    assert raw != text.encode()
    assert outcome(raw) == full_checker(raw)


def test_repeated_launch_objects_are_checked_once_each() -> None:
    checked: list[int] = []
    from cubinstore.manifest import fast

    raw = _compact(_doc())
    fast.check(raw.decode(), launches_ok=lambda launches: checked.append(len(launches)) or fast._launches_ok(launches))
    assert checked == [2]  # 9 copies of one geometry and another: 2 objects
    m = Manifest.from_bytes(raw)
    assert m._index._objs is not None
    assert m.by_id("axpy/f32/sm_90").entry("::ns::axpy2").launch.cluster == (2, 1, 1)


def test_ids_in_another_param_order_and_ambiguous_renderings_agree() -> None:
    slow = full_checker
    doc = _doc()
    # One kernel of the family renders its params in another order: refused either way.
    bad = _set(doc, ("kernels", 3, "id"), "gemm/f32/bm256/stages3/sm_90a")
    # Two params that render the same segment ("x"): only the full checker's matching decides.
    twin = {"id": "t/x/x/sm_90a", "family": "t", "params": {"a": "x", "b": "x"}, "arch": "sm_90a",
            "digest": _digest(50), "size": 5, "target": "//k:t",
            "entries": {"k": {"name": "k", "params": [], "offsets": []}}}
    other = dict(twin, id="t/x/y/sm_90a", params={"a": "x", "b": "y"}, digest=_digest(51))
    # An int param and a string param that render alike, in two archs.
    clash = [dict(twin, id="c/p4/sm_90a", family="c", params={"p": 4}, digest=_digest(52)),
             dict(twin, id="c/p4/sm_90", family="c", params={"p": "p4"}, arch="sm_90", digest=_digest(53))]
    for d in (bad, {"schema": doc["schema"], "kernels": [twin, other]},
              {"schema": doc["schema"], "kernels": [*doc["kernels"], *clash]}):
        raw = _compact(d)
        assert outcome(raw) == slow(raw)
    m = Manifest.from_bytes(_compact({"schema": doc["schema"], "kernels": clash}))
    assert m.select("c", (9, 0), p=4).id == "c/p4/sm_90a"
    assert m.select("c", (9, 0), p="p4").id == "c/p4/sm_90"


# -- linear in N ----------------------------------------------------------------------------------

def big_manifest(n: int, families: int = 3) -> bytes:
    kernels = []
    for i in range(n):
        family = f"f{i % families}"
        kernels.append({
            "id": f"{family}/bm{i % 50}/bn{i // 50}/sm_90a", "family": family, "params": {"bm": i % 50, "bn": i // 50},
            "arch": "sm_90a", "digest": _digest(i), "size": 1000 + i, "target": f"//k:t{i}",
            "entries": {f"_Zk{i}": {"name": f"ns::k<{i}>", "params": ["u32", "ptr"], "offsets": [0, 8],
                                    "launch": {"block": [128, 1, 1], "shared_mem": 0, "grid": ["cdiv(args[0], 128)"]}}}})
    return manifest_module.dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels})


def test_open_is_linear_in_the_number_of_kernels() -> None:
    assert_linear(lambda n: count_work(lambda: Manifest.from_bytes(big_manifest(n))))


def test_every_spec_and_the_closure_are_built_in_linear_work() -> None:
    def work(n: int) -> int:
        m = Manifest.from_bytes(big_manifest(n))
        return count_work(lambda: (m.kernels, m.blobs, m.archs, [m.ids_of(d) for d, _ in m.blobs]))
    assert_linear(work)


def test_a_lookup_costs_the_same_at_n_and_2n() -> None:
    def work(n: int) -> int:
        m = Manifest.from_bytes(big_manifest(n))
        m.select("f0", (9, 0), bm=0, bn=0)  # its spec built
        return count_work(lambda: [m.select("f0", (9, 0), bm=0, bn=0) for _ in range(50)]
                          + [m.by_id("f1/bm1/bn0/sm_90a") for _ in range(50)])
    small, large = work(300), work(600)
    assert large <= small * 1.05, (small, large)


def test_a_bad_manifest_still_names_its_field_at_scale() -> None:
    raw = big_manifest(300).replace(b'"size":1150', b'"size":-1', 1)
    with pytest.raises(ManifestError, match=r"^invalid manifest m\.json: kernels\[\d+\] \(id 'f\d/bm\d+/bn\d+/sm_90a'\)\.size: "
                                            r"expected a positive integer \(bytes\), got -1"):
        Manifest.from_bytes(raw, source="m.json")


def test_a_big_open_leaves_nothing_young_for_the_collector_and_respects_a_freeze(tmp_path) -> None:
    # In a fresh interpreter: in this one, a thread another test left (a test server's keep-alive
    # handler) may free a frozen object at any moment, which would move the freeze count.
    import subprocess
    import sys
    from pathlib import Path

    raw = big_manifest(4000)
    assert len(raw) >= manifest_module._AGE_AFTER_BYTES
    (tmp_path / "m.json").write_bytes(raw)
    code = """
import gc, sys
from cubinstore import Manifest
raw = open(sys.argv[1], "rb").read()
m = Manifest.from_bytes(raw)
assert gc.isenabled() and gc.get_count()[0] < 700, gc.get_count()  # the document was aged, not left in generation 0
gc.freeze()  # an application's own freeze (a pre-fork server) is never undone
try:
    frozen = gc.get_freeze_count()
    Manifest.from_bytes(raw)
    assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)
finally:
    gc.unfreeze()
assert len(m.kernels) == 4000
"""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.json")], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
