"""A manifest is checked in bounded, polynomial work, and what it carries cannot fail later.

The id-order check (every id of a family renders its params in one order) is a matching of id
positions to param keys: its work is counted (``manifest.order_steps``) and must grow like a
polynomial in the number of params, never like a search over orders. Launch rules are checked
for arity when the manifest is opened, and evaluating one raises only ``BadArgumentError``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from typing import Any

import pytest

from cubinstore import manifest as manifest_module
from cubinstore.errors import BadArgumentError, ManifestError
from cubinstore.internals import abi as _abi, geometry
from cubinstore.manifest import Manifest, dumps_canonical
from helpers.manifest_paths import full_checker as full_checker_of, outcome

pytestmark = pytest.mark.usefixtures("clean_env")

HEX = hashlib.sha256(b"a cubin").hexdigest()
ENTRY = {"k": {"name": "k", "params": ["u32"], "offsets": [0]}}


def kernel(family: str, params: dict[str, Any], order: list[str] | None = None, arch: str = "sm_90a",
           entries: dict[str, Any] | None = None) -> dict[str, Any]:
    """A kernel whose id renders ``params`` in ``order`` (default: their own), as ``kernel_id`` does."""
    in_order = {k: params[k] for k in (params if order is None else order)}
    return {"id": _abi.kernel_id(family, in_order, arch), "family": family, "params": params, "arch": arch,
            "digest": f"sha256:{HEX}", "size": 7, "entries": entries or ENTRY, "target": f"//kernels/{family}:k"}


def hostile(n: int, *, refuse: bool = True) -> bytes:
    """Three kernels of ``n`` string params whose id orders contradict only at the last two positions.

    The first renders every param as ``x`` (any order fits); the second puts p00 and p01 at the last
    two positions; the third puts p00 and p05 there (contradicting: both would need p00), or, with
    ``refuse=False``, p00 and p01 again. A search over orders tries about (n-3)! of them to refuse it."""
    keys = [f"p{i:02d}" for i in range(n)]
    last = keys[5] if refuse else keys[1]
    kernels = [
        kernel("f", dict.fromkeys(keys, "x")),
        kernel("f", {k: "a" if k in keys[:2] else "b" for k in keys}, keys[2:] + keys[:2]),
        kernel("f", {k: "c" if k in (keys[0], last) else "d" for k in keys},
               [k for k in keys if k not in (keys[0], last)] + [keys[0], last]),
    ]
    return dumps_canonical({"schema": manifest_module.SCHEMA, "kernels": kernels})


def steps_to_open(raw: bytes) -> tuple[str, int]:
    """("ok" or the error's message, the id-order steps opening ``raw`` took)."""
    before = manifest_module.order_steps
    try:
        Manifest.from_bytes(raw, source="m.json")
        answer = "ok"
    except ManifestError as exc:
        answer = str(exc)
    return answer, manifest_module.order_steps - before


@pytest.fixture
def full_checker() -> Any:
    return full_checker_of


# -- 1. the id-order check is a matching ------------------------------------------------------------

def test_the_13_param_manifest_that_took_a_minute_is_refused_in_bounded_work() -> None:
    steps = manifest_module.order_steps  # the counter exists before anything is opened
    raw = hostile(13)
    assert len(raw) < 1300 and steps >= 0
    answer, steps = steps_to_open(raw)
    assert answer.startswith("invalid manifest m.json: kernels[1] (id 'f/d/d/d/d/d/d/d/d/d/d/d/c/c/sm_90a').id: "
                             "renders the params of family 'f' in another order than kernels[0] "
                             "(id 'f/b/b/b/b/b/b/b/b/b/b/b/a/a/sm_90a'); ids follow the grid's order")
    assert 0 < steps <= 13**3  # a search over orders takes millions


def test_id_order_work_grows_polynomially_with_the_number_of_params() -> None:
    counted = {}
    for n in (16, 32):
        for refuse in (True, False):
            answer, steps = steps_to_open(hostile(n, refuse=refuse))
            assert (answer == "ok") is not refuse, answer
            assert 0 < steps <= n**3
            counted[n, refuse] = steps
    for refuse in (True, False):
        assert counted[32, refuse] <= 8 * counted[16, refuse], counted  # at most cubic: x8 per doubling


def test_the_widest_point_allowed_is_checked_within_its_cubic_bound() -> None:
    n = manifest_module.MAX_POINT_PARAMS
    for refuse in (True, False):
        answer, steps = steps_to_open(hostile(n, refuse=refuse))
        assert (answer == "ok") is not refuse
        assert steps <= n**3


def test_a_point_with_more_params_than_the_bound_is_refused_naming_the_bound(full_checker: Any) -> None:
    n = manifest_module.MAX_POINT_PARAMS + 1
    keys = [f"p{i:02d}" for i in range(n)]
    raw = dumps_canonical({"schema": manifest_module.SCHEMA,
                           "kernels": [kernel("f", {k: f"v{i}" for i, k in enumerate(keys)})]})
    with pytest.raises(ManifestError, match=rf"kernels\[0\] \(id 'f/v0/.*\)\.params: expected at most "
                                            rf"{n - 1} parameters, got {n}$"):
        Manifest.from_bytes(raw)
    assert outcome(raw) == full_checker(raw)  # the fast path declines it too


def _brute_force_accepts(kernels: list[dict[str, Any]]) -> bool:
    """Whether one order of the family's keys renders every id, and the ids differ: the old search, on few params."""
    keys = list(kernels[0]["params"])
    if len({k["id"] for k in kernels}) != len(kernels):
        return False  # an int and a word rendered alike: one id for two kernels
    return any(all(k["id"].split("/")[1:-1] == [_abi.render_param(key, k["params"][key]) for key in order]
                   for k in kernels)
               for order in itertools.permutations(keys))


def _random_family(rng: random.Random) -> list[dict[str, Any]]:
    n = rng.randrange(1, 6)
    keys = [f"p{i}" for i in range(n)]
    values: list[Any] = ["a", "b", "p00", 0, 1]  # "p00" renders like key p0 with 0: collisions on purpose
    order = keys[:]
    rng.shuffle(order)
    points: dict[tuple[Any, ...], dict[str, Any]] = {}
    for _ in range(rng.randrange(1, 6)):
        params = {k: rng.choice(values) for k in keys}
        points.setdefault(tuple(params.items()), params)
    kernels = []
    for params in points.values():
        own = order if rng.random() < 0.6 else rng.sample(keys, n)
        kernels.append(kernel("f", params, own))
    return kernels


def test_the_matching_accepts_exactly_what_a_search_over_orders_accepts(full_checker: Any) -> None:
    rng = random.Random(27)
    seen = {True: 0, False: 0}
    for _ in range(400):
        kernels = _random_family(rng)
        raw = json.dumps({"schema": manifest_module.SCHEMA, "kernels": kernels}).encode()
        answer, _ = steps_to_open(raw)
        expected = _brute_force_accepts(kernels)
        assert (answer == "ok") is expected, (answer, kernels)
        if not expected:  # two orders of one family (or two of its ids alike only by their orders)
            assert "in another order than kernels[" in answer or ": duplicate id 'f/" in answer, answer
        seen[expected] += 1
        # Canonical order too, so the fast path decides where the first id's order is unambiguous.
        canonical = dumps_canonical({"schema": manifest_module.SCHEMA, "kernels": kernels})
        assert outcome(canonical) == full_checker(canonical)
    assert min(seen.values()) > 50  # both answers were exercised


@pytest.mark.parametrize("refuse", [True, False])
def test_fast_path_and_full_checker_agree_on_the_hostile_documents(full_checker: Any, refuse: bool) -> None:
    for n in (13, 32):
        raw = hostile(n, refuse=refuse)
        assert steps_to_open(raw)[1] <= n**3
        assert outcome(raw) == full_checker(raw)
        # With a first kernel of distinct values, the fast path knows the order and decides alone.
        doc = json.loads(raw)
        keys = [f"p{i:02d}" for i in range(n)]
        order = keys[2:] + keys[:2]  # the order the other ids imply: p00 and p01 last
        first = kernel("f", {k: f"A{i}" for i, k in enumerate(keys)}, order)
        doc["kernels"].insert(0, first)
        raw = dumps_canonical(doc)
        assert outcome(raw) == full_checker(raw)
        assert (outcome(raw)[0] == "ok") is not refuse


# -- 2. launch rules: arity at open, typed errors at launch ---------------------------------------------

V2 = {"_Z4gemm": {"name": "ns::gemm<128>", "params": ["u32", "u32"], "offsets": [0, 4],
                  "launch": {"block": [128], "shared_mem": 0, "grid": ["cdiv(args[0], 128)"]}}}


def _with_rule(rule: str) -> bytes:
    entries = json.loads(json.dumps(V2))
    entries["_Z4gemm"]["launch"]["grid"] = [rule]
    k = kernel("gemm", {"bm": 128}, entries=entries)
    return dumps_canonical({"schema": manifest_module.SCHEMA, "kernels": [k]})


@pytest.mark.parametrize("rule, why", [
    ("max(args[0])", "max takes at least 2 arguments, got 1"),
    ("min(sm_count)", "min takes at least 2 arguments, got 1"),
    ("cdiv(args[0])", "cdiv takes exactly 2 arguments, got 1"),
    ("cdiv(args[0], 128, 2)", "cdiv takes exactly 2 arguments, got 3"),
    ("min(sm_count, cdiv(args[1]))", "cdiv takes exactly 2 arguments, got 1 in 'cdiv(args[1])'"),
    ("max()", "max takes at least 2 arguments, got 0"),
])
def test_a_launch_rule_with_a_wrong_argument_count_is_refused_at_open(full_checker: Any, rule: str, why: str) -> None:
    raw = _with_rule(rule)
    with pytest.raises(ManifestError) as info:
        Manifest.from_bytes(raw, source="m.json")
    assert str(info.value) == (f"invalid manifest m.json: kernels[0] (id 'gemm/bm128/sm_90a').entries._Z4gemm.launch"
                               f".grid[0]: launch rule {rule!r}: {why}")
    assert outcome(raw) == full_checker(raw)
    with pytest.raises(BadArgumentError, match=f"^launch rule {rule!r}: {why}$".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        geometry.check_rule(rule)


def test_rules_of_the_right_arity_still_open_and_evaluate() -> None:
    m = Manifest.from_bytes(_with_rule("max(1, min(sm_count, cdiv(args[0], 128), 7))"))
    launch = m.kernels[0].entry("_Z4gemm").launch
    assert launch is not None and launch.grid_for([1000, 0], 132) == (7, 1, 1)


@pytest.mark.parametrize("rule, kwargs, why", [
    ("cdiv(args[0])", {"args": [1]}, "cdiv takes exactly 2 arguments, got 1"),
    ("max(args[0])", {"args": [1]}, "max takes at least 2 arguments, got 1"),
    ("args[0] * args[0]", {"args": [10**5000]}, "args[0] is an int of 16610 bits, which does not fit in 64 bits"),
    ("args[0] + 1", {"args": [2**64]}, "args[0] is 18446744073709551616, which does not fit in 64 bits"),
    ("sm_count * 2", {"sm_count": 2**70}, "sm_count is 1180591620717411303424, which does not fit in 64 bits"),
    ("sm_count * 2", {"sm_count": 1.5}, "sm_count is float, expected an int"),
    ("9" * 40 + " * 2", {}, "a constant of 133 bits does not fit in 64 bits"),
])
def test_evaluating_a_rule_raises_only_bad_argument_errors(rule: str, kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        geometry.eval_rule(rule, **kwargs)
    assert str(info.value) == f"launch rule {rule!r}: {why}"


def test_a_launch_geometry_never_leaks_a_type_error_for_huge_arguments() -> None:
    launch = geometry.LaunchGeometry.from_json({"block": [128], "grid": ["cdiv(args[0], 128)"]}, "g")
    assert launch.grid_for([1024], None) == (8, 1, 1)
    with pytest.raises(BadArgumentError, match=r"^launch rule 'cdiv\(args\[0\], 128\)': args\[0\] is an int of "):
        launch.grid_for([1 << 5000], None)
