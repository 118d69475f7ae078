"""The manifest's fast path: opening a release of tens of thousands of kernels costs about one
``json.loads``.

Canonical v2 manifests (what the build and ``Manifest.build`` write) are validated here with few
Python calls per kernel and memoised checks, an entry table that repeats is parsed and checked
once, and their KernelSpecs are built only when asked for (``spec_from_obj``). The fast path only
ever *accepts*: whatever it is unsure of (v1, an ambiguous id order, any bad field) raises
``Slow`` and goes to the full checker (``cubinstore.manifest.schema``), which alone words the
errors, so both paths accept exactly the same documents (tests/manifest/test_manifest_fast_path.py).
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections.abc import Callable
from typing import Any

from cubinstore._core import abi as _abi
from cubinstore._core.abi import IDENT_RE, MAX_BLOB_SIZE, MAX_POINT_PARAMS, WORD_RE, Arch, render_param
from cubinstore._core.digest import EMPTY_SHA256_HEX
from cubinstore._core.geometry import (
    MAX_BLOCK_DIM,
    MAX_CLUSTER_DIM,
    MAX_GRID_DIM,
    MAX_SHARED_MEM,
    check_rule,
)
from cubinstore.errors import BadArgumentError
from cubinstore.manifest.schema import (
    ENTRY_KEYS,
    FAMILIES_KEY,
    KERNEL_FIELDS,
    KERNEL_KEYS,
    LABEL_RE,
    MAX_READABLE_CHARS,
    SCHEMA,
    TOOLKIT_FIELDS,
    TOP_KEYS,
    Checker,
    jit_templates,
)
from cubinstore.manifest.ptx import is_ptx, layout_arch
from cubinstore.manifest.spec import KernelSpec
from cubinstore.manifest.toolkit import MIN_DRIVER_RANGE, TOOLKIT_RE

__all__ = ["Slow", "check", "spec_from_obj"]


class Slow(Exception):
    """The fast path declines this document; the full checker decides."""


def _decline(_text: str) -> Any:
    raise Slow  # a float or NaN anywhere: no valid v2 field holds one


_EMPTY_DIGEST = "sha256:" + EMPTY_SHA256_HEX
_ENTRY_KEYS_3 = frozenset({"name", "params", "offsets"})
_chain = itertools.chain.from_iterable
# Whole columns joined by newlines (no pattern below matches one), checked in one regex call.
_DIGESTS_RE = re.compile(r"(?:sha256:[0-9a-f]{64}\n)+", re.ASCII)
_IDENTS_RE = re.compile(rf"(?:{IDENT_RE.pattern}\n)+", re.ASCII)
_LABELS_RE = re.compile(rf"(?:{LABEL_RE.pattern}\n)+", re.ASCII)
_TOOLKITS_RE = re.compile(rf"(?:{TOOLKIT_RE.pattern}\n)+", re.ASCII)
_LAUNCH_KEYS = frozenset({"block", "shared_mem", "cluster", "grid"})
# A launch object's text, up to its first brace: a "}" closes it, a "{" is a nested object.
_LAUNCH_TEXT_RE = re.compile(r'"launch":(\{[^{}]*\}?)', re.ASCII)
_ENTRIES_KEY = '"entries":'
# In canonical key order a kernel's "family" follows its "entries", and "families" comes first.
_AFTER_ENTRIES = ',"family":'
_CUT_ENTRIES = _ENTRIES_KEY + "0" + _AFTER_ENTRIES
_FAMILIES_FIRST = '{"' + FAMILIES_KEY + '":'


def _id_order(kid: object, family: str, params: dict[str, Any], arch: str) -> tuple[str, ...]:
    """The param keys in the order the family's first id renders them, when that is unambiguous."""
    if type(kid) is not str:
        raise Slow
    parts = kid.split("/")
    if len(parts) != len(params) + 2 or parts[0] != family or parts[-1] != arch or len(params) > MAX_POINT_PARAMS:
        raise Slow
    order = []
    for segment in parts[1:-1]:
        keys = [k for k, v in params.items() if render_param(k, v) == segment]
        if len(keys) != 1 or keys[0] in order:
            raise Slow
        order.append(keys[0])
    return tuple(order)


def _rendered(key: str, column: list[Any]) -> list[str]:
    """Each value of a param column as an id renders it (``render_param``), each distinct value
    rendered once (a column repeats few values; ints and strs never collide)."""
    table = {v: render_param(key, v) for v in set(column)}
    return list(map(table.__getitem__, column))


def _dims_ok(column: list[Any], limit: int) -> None:
    """geometry._dims3 over a column: each an int or a list of 1 to 3 ints, all in [1, limit]."""
    kinds = set(map(type, column))
    if kinds == {list}:
        lists, flat = column, list(_chain(column))
    elif kinds <= {int, list}:
        lists = [v for v in column if type(v) is list]
        flat = [*_chain(lists), *(v for v in column if type(v) is int)]
    else:
        raise Slow
    if lists and not set(map(len, lists)) <= {1, 2, 3}:
        raise Slow
    if not set(map(type, flat)) <= {int} or min(flat) < 1 or max(flat) > limit:
        raise Slow


def _launches_ok(launches: list[dict[str, Any]]) -> None:
    """LaunchGeometry.from_json's rules over every launch object, column by column."""
    if not all("block" in keys and keys <= _LAUNCH_KEYS for keys in set(map(frozenset, launches))):
        raise Slow
    _dims_ok([g["block"] for g in launches], MAX_BLOCK_DIM)
    smem = [g.get("shared_mem", 0) for g in launches]
    if set(map(type, smem)) != {int} or min(smem) < 0 or max(smem) > MAX_SHARED_MEM:
        raise Slow
    clusters = [c for g in launches if (c := g.get("cluster")) is not None]
    if clusters:
        _dims_ok(clusters, MAX_CLUSTER_DIM)
    grids = [r for g in launches if (r := g.get("grid")) is not None]
    if grids:
        if set(map(type, grids)) != {list} or not set(map(len, grids)) <= {1, 2, 3}:
            raise Slow
        items = list(_chain(grids))
        if not set(map(type, items)) <= {int, str}:
            raise Slow
        numbers = [x for x in items if type(x) is int]
        if numbers and (min(numbers) < 1 or max(numbers) > MAX_GRID_DIM):
            raise Slow
        try:
            for rule in {x for x in items if type(x) is str}:
                check_rule(rule)
        except BadArgumentError:
            raise Slow from None


def _distinct_launches(text: str, count: int) -> list[dict[str, Any]]:
    """The distinct launch objects of ``count`` entry geometries, each parsed once from ``text``,
    the text of their entry tables (the whole document, or the tables cut out of it).

    A release repeats a few geometries thousands of times. With no backslash in the text (the
    caller checked), every ``"launch":`` is that key, and each entry geometry is one of them; so
    when the text has exactly ``count``, none is elsewhere (a families section), and when none
    of them holds a brace (block, grid and cluster hold lists only), the geometries parsed into
    the document are exactly the distinct texts parsed here: checking these checks every one.
    """
    found = _LAUNCH_TEXT_RE.findall(text)
    distinct = set(found)
    if len(found) != count or not all(t.endswith("}") for t in distinct):
        raise Slow  # a brace inside an object, or a launch object elsewhere: check each one
    return [json.loads(t) for t in distinct]


def _cut_entries(text: str) -> tuple[str, list[str], dict[str, Any]] | None:
    """The text with each kernel's ``"entries":`` value replaced by 0, those values' texts in
    kernel order, and each distinct text's value (parsed once); None where that does not pay, or
    a value does not end right before ``,"family":`` (another key order).

    A release repeats a few entry tables thousands of times: parsed whole, they are most of the
    parse and of the checks. With no backslash in the text (the caller checked) no string holds a
    quote, so every ``"entries":`` is that key, and a cut text that parses from its start to its
    end into one value is exactly that key's value (a prefix of a value does not parse, and a
    value does not end where more text follows). A families section first (canonical key order)
    is left whole: its templates have entries too. Past it, the caller checks that there are as
    many values as kernels: then each kernel's own are the ones cut, in order.
    """
    scan = json.JSONDecoder(parse_constant=_decline, parse_float=_decline).scan_once
    head = 0
    if text.startswith(_FAMILIES_FIRST):
        try:
            head = scan(text, len(_FAMILIES_FIRST))[1]
        except (StopIteration, ValueError, RecursionError):
            return None
    pieces = text[head:].split(_ENTRIES_KEY)
    parts = list(map(str.partition, pieces[1:], itertools.repeat(_AFTER_ENTRIES)))
    if not parts or set(map(operator.itemgetter(1), parts)) != {_AFTER_ENTRIES}:
        return None
    texts = list(map(operator.itemgetter(0), parts))
    distinct = list(dict.fromkeys(texts))
    if len(distinct) > len(texts) // 2:
        return None  # tables that rarely repeat (a symbol per kernel): parsing them apart costs more
    try:
        scanned = list(map(scan, distinct, itertools.repeat(0)))
    except (ValueError, RecursionError):
        return None
    # No value at a text's start raises StopIteration, which ends the map early: the lengths differ then too.
    if list(map(operator.itemgetter(1), scanned)) != list(map(len, distinct)):
        return None
    rest = text[:head] + _CUT_ENTRIES.join([pieces[0], *map(operator.itemgetter(2), parts)])
    return rest, texts, dict(zip(distinct, map(operator.itemgetter(0), scanned)))


def _entry_ok(types: tuple[Any, ...], offsets: tuple[int, ...], arch: Arch) -> None:
    """Checker._entry's rules for one (types, offsets) pair, as a yes/no."""
    try:
        parsed = [_abi.param_type(t) for t in types]
    except BadArgumentError:
        raise Slow from None
    if len(parsed) > _abi.MAX_PARAMS or len(offsets) != len(types):
        raise Slow
    if arch.major in _abi.PARAM_BANK_OFFSET and offsets != _abi.param_layout(parsed, arch):
        raise Slow


def _json_tokens(value: Any) -> tuple[int, int]:
    """(keys, ':' in keys and strings) anywhere in a parsed JSON value: its share of the ':' count."""
    if type(value) is dict:
        keys, colons = len(value), sum(k.count(":") for k in value)
        for item in value.values():
            k, c = _json_tokens(item)
            keys, colons = keys + k, colons + c
        return keys, colons
    if type(value) is list:
        keys = colons = 0
        for item in value:
            k, c = _json_tokens(item)
            keys, colons = keys + k, colons + c
        return keys, colons
    return 0, value.count(":") if type(value) is str else 0


def check(text: str, *, launches_ok: Callable[[list[dict[str, Any]]], None] = _launches_ok,
          ) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, tuple[int, ...]],
                     dict[str, tuple[str, ...]], dict[str, Any]]:
    """Validate a v2 document the quick way and index it; raises Slow when unsure.

    Returns ``(kernels, by_id, by_stem, orders, templates)``: the parsed kernel objects (each to
    become a spec through ``spec_from_obj``), each id's and each id-without-arch's positions, each
    family's param order in its ids, and the families section's templates.

    Checks run column by column (one C-level pass each: ``set(map(type, ...))``, one regex over
    the joined column), so the per-kernel Python work is the id rendering and little else.
    ``launches_ok`` checks the distinct launch objects (tests count what it is given).
    """
    if "\\" in text:
        raise Slow
    cut = _cut_entries(text)
    outer = text if cut is None else cut[0]
    try:
        doc = json.loads(outer, parse_constant=_decline, parse_float=_decline)
    except (ValueError, RecursionError):
        raise Slow from None
    if type(doc) is not dict or not TOP_KEYS <= doc.keys() <= TOP_KEYS | {FAMILIES_KEY} or doc["schema"] != SCHEMA:
        raise Slow
    kernels = doc["kernels"]
    if type(kernels) is not list or not kernels:
        raise Slow
    n = len(kernels)
    # Every kernel with the toolkit facts or none with them (a mix goes to the full checker).
    lengths = set(map(len, kernels))
    if set(map(type, kernels)) != {dict} or lengths not in ({len(KERNEL_FIELDS)}, {len(KERNEL_KEYS)}):
        raise Slow
    try:  # as many keys as fields, and each field there: the kernel keys exactly
        ids, families, params, archs, digests, sizes, entries, targets = (
            list(map(operator.itemgetter(key), kernels)) for key in KERNEL_FIELDS)
        toolkit_columns = [list(map(operator.itemgetter(key), kernels)) for key in TOOLKIT_FIELDS] \
            if lengths == {len(KERNEL_KEYS)} else None
    except KeyError:
        raise Slow from None

    # The entry tables to check: every kernel's, or, cut from the text, one per distinct (arch, text):
    # besides its text, only a kernel's arch decides whether its table is valid (the offsets).
    if cut is None:
        tables, table_archs, table_text, table_colons = entries, archs, text, 0
    else:
        _, texts, by_text = cut
        if len(texts) != n or set(entries) != {0}:
            raise Slow  # a cut value that is no kernel's own: it would not be put back
        for _ in map(operator.setitem, kernels, itertools.repeat("entries"), map(by_text.__getitem__, texts)):
            pass
        table_archs, table_texts = zip(*dict.fromkeys(zip(archs, texts)))
        tables = list(map(by_text.__getitem__, table_texts))
        table_text = "".join(table_texts)
        table_colons = table_text.count(":")

    if set(map(type, families)) != {str} or set(map(type, archs)) != {str} or set(map(type, params)) != {dict}:
        raise Slow
    if not all(map(WORD_RE.fullmatch, set(families))):
        raise Slow
    try:
        parsed_archs = {a: layout_arch(a) for a in set(archs)}  # the SM arch of a PTX arch: its layout rule
    except BadArgumentError:
        raise Slow from None
    if toolkit_columns is None:
        if any(map(is_ptx, parsed_archs)):
            raise Slow  # PTX must name its toolkit: the full checker says so
    else:
        toolkits, drivers = toolkit_columns
        if set(map(type, toolkits)) != {str} or not _TOOLKITS_RE.fullmatch("\n".join(set(toolkits)) + "\n"):
            raise Slow
        if (set(map(type, drivers)) != {int} or min(drivers) < MIN_DRIVER_RANGE[0]
                or max(drivers) > MIN_DRIVER_RANGE[1]):
            raise Slow
    values = list(_chain(map(dict.values, params)))
    if not set(map(type, values)) <= {int, str}:  # no bool, float, list or null
        raise Slow
    if not all(type(v) is int or WORD_RE.fullmatch(v) for v in set(values)):
        raise Slow

    # Ids: each family's first id fixes its param order; every id must render in that order
    # (then its params have the family's keys, and (family, params, arch) is unique with the id).
    first = dict(zip(reversed(families), range(n - 1, -1, -1)))
    orders = {f: _id_order(ids[i], f, params[i], archs[i]) for f, i in first.items()}
    if not all(all(map(IDENT_RE.fullmatch, params[i])) for i in first.values()):
        raise Slow
    if len(first) == 1:
        groups: dict[str, Any] = {families[0]: range(n)}
    else:
        groups = {}
        for i, f in enumerate(families):
            groups.setdefault(f, []).append(i)
    stems: list[str] = [""] * n
    for f, members in groups.items():
        order = orders[f]
        rows = params if len(groups) == 1 else [params[i] for i in members]
        if set(map(len, rows)) != {len(order)}:
            raise Slow
        columns = [_rendered(k, list(map(operator.itemgetter(k), rows))) for k in order]
        family_stems = list(map("/".join, zip(itertools.repeat(f, len(rows)), *columns)))
        family_archs = archs if len(groups) == 1 else [archs[i] for i in members]
        family_ids = ids if len(groups) == 1 else [ids[i] for i in members]
        if list(map("/".join, zip(family_stems, family_archs))) != list(family_ids):
            raise Slow
        if len(groups) == 1:
            stems = family_stems
        else:
            for i, stem in zip(members, family_stems):
                stems[i] = stem
    by_id = dict(zip(ids, range(n)))
    if len(by_id) != n:
        raise Slow  # a duplicate id

    if (set(map(type, sizes)) != {int} or min(sizes) <= 0 or max(sizes) > MAX_BLOB_SIZE
            or not _DIGESTS_RE.fullmatch("\n".join(digests) + "\n")):
        raise Slow
    distinct = set(digests)
    if _EMPTY_DIGEST in distinct or (len(distinct) != n and len(set(zip(digests, sizes))) != len(distinct)):
        raise Slow  # the empty blob, or one digest with two sizes
    labels = "\n".join(targets) + "\n"
    if not _LABELS_RE.fullmatch(labels) or (".." in labels and any(
            ".." in t.replace(":", "/").split("/") for t in targets if ".." in t)):
        raise Slow

    if set(map(type, tables)) != {dict} or not all(tables):
        raise Slow
    symbols = list(_chain(tables))
    bodies = list(_chain(map(dict.values, tables)))
    if not _IDENTS_RE.fullmatch("\n".join(symbols) + "\n") or set(map(type, bodies)) != {dict}:
        raise Slow
    if not set(map(frozenset, bodies)) <= {_ENTRY_KEYS_3, ENTRY_KEYS}:
        raise Slow
    names = [v["name"] for v in bodies]
    readable = "".join(names)  # a TypeError for a name that is not a str
    # _READABLE_RE at C speed: printable ASCII is exactly 0x20..0x7e.
    if (not (readable.isascii() and readable.isprintable()) or min(map(len, names)) < 1
            or max(map(len, names)) > MAX_READABLE_CHARS):
        raise Slow
    for e in tables:
        if len(e) > 1 and len({v["name"] for v in e.values()}) != len(e):
            raise Slow  # two entries of one kernel share a readable name
    types = [v["params"] for v in bodies]
    offsets = [v["offsets"] for v in bodies]
    launches = [v.get("launch") for v in bodies]
    if set(map(type, types)) != {list} or set(map(type, offsets)) != {list}:
        raise Slow
    flat = list(_chain(offsets))
    if flat and (not set(map(type, flat)) <= {int} or min(flat) < 0):
        raise Slow
    if not set(map(type, launches)) <= {dict, type(None)}:
        raise Slow
    geometries = [g for g in launches if g is not None]
    if geometries:
        launches_ok(_distinct_launches(table_text, len(geometries)))
    entry_archs = (table_archs if len(bodies) == len(tables)
                   else [a for a, e in zip(table_archs, tables) for _ in e])
    # Entries of one shape are checked once (offsets are ints by now; a tuple of types only
    # equals a checked tuple of strs).
    for arch, types_key, offsets_key in set(zip(entry_archs, map(tuple, types), map(tuple, offsets))):
        _entry_ok(types_key, offsets_key, parsed_archs[arch])

    # Duplicate keys: json.loads keeps the last silently. With no backslash a string's text is its
    # value, and outside strings every ':' follows a key, so a text holds more ':' than its parse
    # has keys and ':' in strings exactly when a key was repeated. Of the checked strings, ids,
    # families, params, archs and symbols hold no ':' and a digest one; one not counted here (in
    # a grid rule's comment) only sends the document to the full checker.
    keys = (len(doc) + len(kernels[0]) * n + sum(map(len, params)) + len(bodies) + sum(map(len, bodies))
            + sum(map(len, geometries)))
    colons = n + labels.count(":") + readable.count(":") + "".join(_chain(types)).count(":")
    templates: dict[str, Any] = {}
    if FAMILIES_KEY in doc:  # small and free-form: walked whole, checked by the one full checker
        family_keys, family_colons = _json_tokens(doc[FAMILIES_KEY])
        keys += family_keys
        colons += family_colons
        templates = jit_templates(Checker("<fast path>"), doc[FAMILIES_KEY], set(first))
    if outer.count(":") + table_colons != keys + colons:
        raise Slow

    by_stem = dict(zip(stems, zip(range(n))))  # stem -> (i,)
    if len(by_stem) != n:  # several archs of one point
        by_stem = {}
        for i, stem in enumerate(stems):
            by_stem[stem] = by_stem.get(stem, ()) + (i,)
    return kernels, by_id, by_stem, orders, templates


# The KernelSpec of a kernel object ``check`` accepted (no check is repeated), the classmethod itself:
# a process's first selection of each kernel calls it, and a forwarding function was one more frame.
# What a load does not read (family, params, entries, target, the entry specs) is filled when first
# asked for (issue 31: the build was about 9 us of a 72 us first load on an H100 when it filled
# everything); ``whole=True`` fills all but the entry specs now, for a walk of every kernel.
spec_from_obj = KernelSpec._checked
