"""The fast path accepts exactly what the full checker accepts: one corpus, both validators.

``cubinstore.manifest.fast.check`` (canonical v2 documents, column by column) and
``cubinstore.manifest.schema.check`` (any document, field by field) are called directly on the
same corpus of valid and invalid documents, with no monkeypatching. The fast path may decline
any document (then the checker decides), but whatever it accepts the checker accepts too, with
the same kernels, index and templates; and it does accept the canonical documents, so the
comparison is never vacuous. ``Manifest.from_bytes`` then gives, for every document, what the
checker alone gives: the same specs, or the same error.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cubinstore.errors import CubinstoreError, ManifestError
from cubinstore.manifest import SCHEMA, SCHEMA_V1, Manifest, dumps_canonical, fast, schema

pytestmark = pytest.mark.usefixtures("clean_env")

SOURCE = "m.json"


def _digest(i: int) -> str:
    return "sha256:" + hashlib.sha256(str(i).encode()).hexdigest()


def _gemm(i: int, arch: str = "sm_90a") -> dict[str, Any]:
    params = {"bm": 64 * (i % 4 + 1), "dtype": ["bf16", "f32"][i % 2], "stages": i}
    entry = {"name": "ns::gemm<true>", "params": ["u32", "tensormap", "struct:12:4"],
             "offsets": [0, 32, 160] if arch == "sm_80" else [0, 112, 240],
             "launch": {"block": [384, 1, 1], "shared_mem": 1024, "grid": ["min(sm_count, cdiv(args[0], 128))"]}}
    return {"id": f"gemm/bm{params['bm']}/{params['dtype']}/stages{i}/{arch}", "family": "gemm", "params": params,
            "arch": arch, "digest": _digest(i), "size": 1000 + i, "entries": {"_Z4gemm": entry},
            "target": f"//kernels/gemm:g{i}_{arch}"}


def _axpy() -> dict[str, Any]:
    return {"id": "axpy/f32/sm_90", "family": "axpy", "params": {"dtype": "f32"}, "arch": "sm_90",
            "digest": _digest(99), "size": 77, "target": "//k:axpy",
            "entries": {"axpy": {"name": "axpy", "params": ["i32", "f32", "ptr"], "offsets": [0, 4, 8]},
                        "axpy2": {"name": "::ns::axpy2", "params": [], "offsets": [],
                                  "launch": {"block": 128, "cluster": [2, 1], "grid": [7, "args[0]"]}}}}


def _template() -> dict[str, Any]:
    return {"schema": "cubinstore/jit-family/v1", "family": "axpy", "grid_keys": ["dtype"],
            "source": "kernels/axpy/axpy.cu", "bundle": {"digest": _digest(77), "size": 1234},
            "defines": ["DTYPE_{dtype}"], "copts": [], "includes": [], "entries": {"axpy": ["i32", "f32", "ptr"]},
            "archs": ["sm_90"], "package": "kernels/axpy"}


def _facts(kernel: dict[str, Any], toolkit: str = "13.0.88", driver: int = 13000) -> dict[str, Any]:
    """``kernel`` with the toolkit that built it and the oldest driver that loads it (issue 31)."""
    return dict(kernel, toolkit=toolkit, min_driver=driver)


def _ptx(i: int, arch: str = "compute_90") -> dict[str, Any]:
    """The PTX of gemm point ``i`` (a kernel of arch ``compute_...``, its toolkit facts required)."""
    kernel = _facts(_gemm(i), driver=13000)
    return dict(kernel, id=kernel["id"].rsplit("/", 1)[0] + "/" + arch, arch=arch, digest=_digest(200 + i),
                target=f"//kernels/gemm:g{i}_{arch}")


def _valid_docs() -> dict[str, dict[str, Any]]:
    """Valid v2 documents of several shapes: each is accepted by the checker, and canonical."""
    gemm = [_gemm(i) for i in range(6)] + [_gemm(i, "sm_80") for i in range(3)]  # several archs of one point
    with_facts = [_facts(k) for k in gemm]
    twin = {"id": "t/x/y/sm_90a", "family": "t", "params": {"a": "x", "b": "y"}, "arch": "sm_90a",
            "digest": _digest(50), "size": 5, "target": "//k:t", "entries": {"k": {"name": "k", "params": [], "offsets": []}}}
    return {
        "one kernel": {"schema": SCHEMA, "kernels": [_axpy()]},
        "shared entry tables": {"schema": SCHEMA, "kernels": gemm},
        "two families": {"schema": SCHEMA, "kernels": [*gemm, _axpy(), twin]},
        "a families section": {"schema": SCHEMA, "kernels": [*gemm, _axpy()], "families": {"axpy": {"jit": _template()}}},
        "one digest, two ids": {"schema": SCHEMA, "kernels": [_axpy(), dict(_axpy(), id="axpy/f64/sm_90",
                                                                            params={"dtype": "f64"})]},
        "toolkit facts": {"schema": SCHEMA, "kernels": [*with_facts, _facts(_axpy(), "12.8", 12000)]},
        "PTX beside CUBINs": {"schema": SCHEMA, "kernels": [*with_facts, *(_ptx(i) for i in range(4)), _ptx(5, "compute_90a")]},
    }


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


_DELETE = object()


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


# Values a field may be set to: each wrong in some place, right in others.
_VALUES: list[Any] = [True, None, 0, 1, -1, 1.0, 2**40, "", ":x", "x", "sm_90", "sm_80", "f32", [], [1], {},
                      {"a": 1}, "sha256:" + "0" * 64, _digest(3), "//k:t", "i32", "struct:12:4", [384, 1, 1],
                      "min(1,2)", "gemm/bm64/bf16/stages0/sm_80", "13.0.88", 13000, "compute_90", _DELETE]

# Text edits: duplicate keys, escapes, numbers no field holds, other spacing (valid or not).
_EDITS: list[Callable[[str], str]] = [
    lambda t: t.replace('"size":', '"size":5,"size":', 1),
    lambda t: t.replace('"launch":{', '"launch":{"block":[1],', 1),
    lambda t: t.replace('"name":"axpy"', '"name":"a\\"b"', 1),
    lambda t: t.replace('"f32"', '"f\\u0033\\u0032"', 1),
    lambda t: t.replace('"size":77', '"size":77.0', 1),
    lambda t: t.replace('"size":77', '"size":NaN', 1),
    lambda t: t.replace('"size":', '"size" :', 1),
    lambda t: t.replace('"launch":{', '"launch": {', 1),
    lambda t: json.dumps(json.loads(t), indent=1),
    lambda t: json.dumps(json.loads(t)),
    lambda t: t[:-1],
    lambda t: "[" + t + "]",
]


def _v1(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as a v1 document (entries are lists of types): valid, and the fast path's to decline."""
    doc = copy.deepcopy(doc)
    doc.pop("families", None)
    doc["schema"] = SCHEMA_V1
    for k in doc["kernels"]:
        k["entries"] = {s: e["params"] for s, e in k["entries"].items()}
    return doc


def corpus() -> Iterator[tuple[str, str]]:
    """(what, text) for the valid documents, every single-field mutation of one, random multi-field
    mutations of each, text edits of each, and v1 forms."""
    rng = random.Random(28)
    valid = _valid_docs()
    for name, doc in valid.items():
        text = dumps_canonical(doc).decode()
        yield name, text
        for edit_no, edit in enumerate(_EDITS):
            yield f"{name}: text edit {edit_no}", edit(text)
        yield f"{name}: v1", json.dumps(_v1(doc))
        paths = _paths(doc)
        for _ in range(60):
            mutated = doc
            for _ in range(rng.randint(1, 3)):
                try:
                    mutated = _set(mutated, rng.choice(paths), rng.choice(_VALUES))
                except (KeyError, IndexError, TypeError):
                    continue
            yield f"{name}: random mutation", _text(mutated)
    doc = valid["a families section"]
    for path in _paths(doc):
        for value in rng.sample(_VALUES, 4):
            if path or value is not _DELETE:
                yield f"set {path} to {value!r}", _text(_set(doc, path, value))


def _text(doc: Any) -> str:
    """``doc`` as the build writes it (canonical), or compact JSON where it is no object."""
    return dumps_canonical(doc).decode() if isinstance(doc, dict) else json.dumps(doc, separators=(",", ":"))


def _specs_json(specs: Any) -> list[Any]:
    return [(k.to_json(), dict(k.entry_specs)) for k in specs]


def _fast(text: str) -> tuple[Any, ...] | None:
    """What the fast path accepts (kernels as specs), or None where it declines (any exception)."""
    try:
        objs, by_id, by_stem, _orders, templates = fast.check(text)
    except Exception:  # noqa: BLE001 - from_bytes takes any exception of the fast path as "unsure"
        return None
    launches: dict[str, Any] = {}
    return SCHEMA, _specs_json(fast.spec_from_obj(o, launches) for o in objs), by_id, by_stem, templates


def _checker(text: str) -> tuple[Any, ...] | str:
    """What the full checker accepts (as ``_fast`` gives it), or its error."""
    try:
        version, specs, by_id, by_stem, templates = schema.check(text, SOURCE)
    except ManifestError as exc:
        return str(exc)
    return version, _specs_json(specs), by_id, by_stem, templates


def _opened(text: str) -> tuple[Any, ...] | str:
    """What ``Manifest.from_bytes`` gives (both paths, as a caller sees them), in ``_checker``'s form."""
    try:
        m = Manifest.from_bytes(text.encode(), source=SOURCE)
    except CubinstoreError as exc:
        return str(exc)
    index = m._index
    return m.schema, _specs_json(m.kernels), index.by_id, index.by_stem, dict(m.jit_templates)


def test_the_fast_path_accepts_only_what_the_checker_accepts_with_the_same_result() -> None:
    counts = {"fast accepted": 0, "fast declined, checker accepted": 0, "checker refused": 0}
    for what, text in corpus():
        by_fast, by_checker = _fast(text), _checker(text)
        if by_fast is not None:
            assert by_fast == by_checker, f"{what}: the fast path accepted {'an invalid' if isinstance(by_checker, str) else 'a'} document differently: {by_checker}"
            counts["fast accepted"] += 1
        elif isinstance(by_checker, str):
            counts["checker refused"] += 1
        else:
            counts["fast declined, checker accepted"] += 1
        assert _opened(text) == by_checker, what
    # Every kind of outcome was exercised, most of all the refusals.
    assert counts["fast accepted"] >= 20 and counts["fast declined, checker accepted"] >= 10, counts
    assert counts["checker refused"] >= 300, counts


@pytest.mark.parametrize("name", sorted(_valid_docs()))
def test_the_fast_path_accepts_every_canonical_valid_document(name: str) -> None:
    text = dumps_canonical(_valid_docs()[name]).decode()
    by_fast = _fast(text)
    assert by_fast is not None, f"the fast path declined the canonical document {name!r}"
    assert by_fast == _checker(text)
    m = Manifest.from_bytes(text.encode())
    assert m._index._objs is not None  # opened through the fast path, its specs built on first use


LAZY_FIELDS = ("family", "params", "entries", "target", "entry_specs", "_names")


def test_a_fast_path_specs_entry_specs_are_built_at_first_use_as_the_checker_builds_them() -> None:
    text = dumps_canonical(_valid_docs()["two families"])
    slow = {k.id: k for k in Manifest.from_bytes(text, fast=False)}
    opened = Manifest.from_bytes(text)
    fast_specs = [opened.by_id(kid) for kid in slow]  # one at a time, as selections build them
    for spec in fast_specs:
        # A selection builds what a load reads; entry specs wait for a launch, a layout check or a name.
        assert not set(LAZY_FIELDS) & set(vars(spec))
        assert spec.symbols == slow[spec.id].symbols == tuple(slow[spec.id].entries)
        assert dict(spec.entries) == dict(slow[spec.id].entries) and spec.entries is spec.entries
        assert spec.toolkit == slow[spec.id].toolkit and spec.min_driver == slow[spec.id].min_driver
    for spec in fast_specs:
        symbol, entry = next(iter(slow[spec.id].entry_specs.items()))
        assert spec.entry(entry.name) == entry and spec.entry(symbol) == entry  # by readable name and symbol
        assert dict(spec.entry_specs) == dict(slow[spec.id].entry_specs) and "entry_specs" in vars(spec)
        assert spec.entry_specs is spec.entry_specs  # built once
    with pytest.raises(AttributeError, match="^'KernelSpec' object has no attribute 'entry_spec'$"):
        fast_specs[0].entry_spec  # noqa: B018 - a typo is still an AttributeError


def test_a_fast_path_specs_other_fields_are_filled_at_first_use_as_the_checker_fills_them() -> None:
    text = dumps_canonical(_valid_docs()["two families"])
    slow = {k.id: k for k in Manifest.from_bytes(text, fast=False)}
    opened = Manifest.from_bytes(text)
    fast_specs = [opened.by_id(kid) for kid in slow]
    for spec in fast_specs:
        want = slow[spec.id]
        assert (spec.family, spec.target) == (want.family, want.target) and "family" in vars(spec)
        assert dict(spec.params) == dict(want.params) and spec.params is spec.params  # filled once
        with pytest.raises(TypeError):
            spec.params["bm"] = 1  # type: ignore[index] - read-only, as the checker's
        assert spec == want and spec.to_json() == want.to_json()


def test_threads_that_race_to_fill_a_fast_path_specs_fields_all_get_the_same_objects() -> None:
    text = dumps_canonical(_valid_docs()["two families"])
    slow = {k.id: k for k in Manifest.from_bytes(text, fast=False)}
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: the fills interleave
    try:
        for _ in range(20):
            opened = Manifest.from_bytes(text)
            specs = [opened.by_id(kid) for kid in slow]
            start = threading.Barrier(4)

            def read(got: list[Any]) -> None:
                start.wait()
                for spec in specs:
                    got.append([getattr(spec, name) for name in LAZY_FIELDS])

            results: list[list[Any]] = [[] for _ in range(4)]
            threads = [threading.Thread(target=read, args=(got,)) for got in results]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i, spec in enumerate(specs):
                first = results[0][i]
                assert all(got[i][k] is first[k] for got in results for k in range(len(LAZY_FIELDS)))
                assert dict(spec.entry_specs) == dict(slow[spec.id].entry_specs) and spec == slow[spec.id]
                assert all(spec.entry(e.name) is e for e in spec.entry_specs.values())  # one pair, not two
    finally:
        sys.setswitchinterval(before)


def test_a_walk_of_every_kernel_builds_each_spec_whole_but_its_entry_specs() -> None:
    text = dumps_canonical(_valid_docs()["two families"])
    slow = {k.id: k for k in Manifest.from_bytes(text, fast=False)}
    walked = list(Manifest.from_bytes(text))  # ls, verify, pack: every field of every kernel read
    assert [k.id for k in walked] == list(slow)
    for spec in walked:
        assert set(LAZY_FIELDS) & set(vars(spec)) == {"family", "params", "entries", "target"}
        assert spec == slow[spec.id] and spec.to_json() == slow[spec.id].to_json()
        assert dict(spec.entries) == dict(slow[spec.id].entries) and spec.symbols == slow[spec.id].symbols


def test_a_v1_document_is_declined_by_the_fast_path_and_decided_by_the_checker() -> None:
    doc = _v1(_valid_docs()["two families"])
    with pytest.raises(fast.Slow):
        fast.check(json.dumps(doc))
    version, specs, *_ = schema.check(json.dumps(doc), SOURCE)
    assert version == SCHEMA_V1 and len(specs) == len(doc["kernels"])
    assert Manifest.from_bytes(json.dumps(doc).encode()).schema == SCHEMA_V1
