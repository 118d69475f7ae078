"""The manifest schema (``cubinstore/manifest/v2``, and ``v1`` read only) and its full checker.

``Checker`` validates every field of any document and alone words the errors (``invalid
manifest <source>: <field>: expected X, got Y``); ``check`` runs it over a whole document. The
fast path (``cubinstore.manifest.fast``) accepts a subset of what this accepts, and sends the
rest here. The facts fields are checked against (parameter types, the layout rule, the arch
grammar, ids, limits) live in ``cubinstore._core.abi``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from cubinstore._core.cxxnames import MAX_NAME_CHARS
from cubinstore._core import abi as _abi
from cubinstore._core.abi import (
    IDENT_RE,
    MAX_BLOB_SIZE,
    MAX_POINT_PARAMS,
    WORD_RE,
    Arch,
    DuplicateKeyError,
    kernel_id,
    no_duplicate_keys,
    reject_constant,
    render_param,
)
from cubinstore._core.digest import Digest
from cubinstore._core.geometry import LaunchGeometry
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, ManifestError
from cubinstore.manifest.ptx import PtxArch, is_ptx, layout_arch
from cubinstore.manifest.spec import EntrySpec, KernelSpec, ParamValue
from cubinstore.manifest.toolkit import MIN_DRIVER_RANGE, TOOLKIT_RE

__all__ = ["PARAM_TYPES", "SCHEMA", "SCHEMA_V1", "Checker", "check", "jit_templates", "upgrade_v1_entries"]

SCHEMA = "cubinstore/manifest/v2"
SCHEMA_V1 = "cubinstore/manifest/v1"
SCHEMAS = (SCHEMA, SCHEMA_V1)
#: The scalar parameter type names (``struct:<size>:<align>`` is allowed too).
PARAM_TYPES = frozenset(_abi.SCALAR_TYPES)

TOP_KEYS = frozenset({"schema", "kernels"})
# v2 only, optional: family -> {"jit": <cubinstore/jit-family/v1 template>} for points no release has.
FAMILIES_KEY = "families"
KERNEL_FIELDS = ("id", "family", "params", "arch", "digest", "size", "entries", "target")
# v2 only, optional, both or neither (required of PTX): which toolkit built the kernel, which driver loads it.
TOOLKIT_FIELDS = ("toolkit", "min_driver")
KERNEL_KEYS = frozenset(KERNEL_FIELDS + TOOLKIT_FIELDS)
ENTRY_KEYS = frozenset({"name", "params", "offsets", "launch"})
LABEL_RE = re.compile(r"//[A-Za-z0-9_.+/-]*(?::[A-Za-z0-9_.+/=,@~-]+)?", re.ASCII)
# A readable C++ name: printable ASCII, e.g. "ns::gemm<ns::bf16, 128, 256>".
MAX_READABLE_CHARS = MAX_NAME_CHARS  # cubinstore._core.cxxnames: the JIT's entries obey it too
_READABLE_RE = re.compile(rf"[ -~]{{1,{MAX_READABLE_CHARS}}}", re.ASCII)


class Checker:
    """Builds ``invalid manifest <source>: <field>: expected X, got Y`` errors."""

    def __init__(self, source: str, schema: str = SCHEMA) -> None:
        self.source = source
        self.schema = schema

    def fail(self, where: str, message: str) -> ManifestError:
        return ManifestError(f"invalid manifest {self.source}: {where}: {message}")

    def kernel(self, index: int, obj: object) -> KernelSpec:
        where = f"kernels[{index}]"
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {type(obj).__name__}")
        kid = obj.get("id")
        if isinstance(kid, str):
            where = f"kernels[{index}] (id {show(kid)})"
        allowed = KERNEL_KEYS if self.schema == SCHEMA else frozenset(KERNEL_FIELDS)
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise self.fail(where, f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(allowed))}")
        missing = sorted(set(KERNEL_FIELDS) - set(obj))
        if missing:
            raise self.fail(where, f"missing key {show(missing[0])}")

        family = obj["family"]
        if not isinstance(family, str) or not WORD_RE.fullmatch(family):
            raise self.fail(f"{where}.family", f"expected a name like 'axpy' ([A-Za-z0-9_.+-]), got {show(family)}")

        params = obj["params"]
        if not isinstance(params, dict):
            raise self.fail(f"{where}.params", f"expected an object, got {type(params).__name__}")
        if len(params) > MAX_POINT_PARAMS:
            raise self.fail(f"{where}.params", f"expected at most {MAX_POINT_PARAMS} parameters, got {len(params)}")
        for key, value in params.items():
            if not IDENT_RE.fullmatch(key):
                raise self.fail(f"{where}.params", f"expected identifier keys, got {show(key)}")
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise self.fail(f"{where}.params.{key}", f"expected a string or an integer, got {show(value)}")
            if isinstance(value, str) and not WORD_RE.fullmatch(value):
                raise self.fail(f"{where}.params.{key}", f"expected a value like 'f32' ([A-Za-z0-9_.+-]), got {show(value)}")

        arch = obj["arch"]
        try:
            PtxArch.parse(arch) if self.schema == SCHEMA and isinstance(arch, str) and is_ptx(arch) else Arch.parse(arch)
        except (BadArgumentError, TypeError):  # TypeError: an unhashable value (Arch.parse is cached)
            raise self.fail(f"{where}.arch", "expected 'sm_<digits>' with optional 'a' or 'f' (e.g. 'sm_90a'), or "
                            f"'compute_<digits>' likewise for PTX (v2), got {show(arch)}") from None

        if not isinstance(kid, str):
            raise self.fail(f"{where}.id", f"expected a string, got {show(kid)}")
        self._check_id(f"{where}.id", kid, family, params, arch)

        raw_digest = obj["digest"]
        try:
            digest = Digest.parse(raw_digest)
        except BadArgumentError as exc:
            raise self.fail(f"{where}.digest", str(exc)) from None
        if digest.is_empty_blob:
            raise self.fail(f"{where}.digest", f"{digest} is the digest of zero bytes, which is not a CUBIN")

        size = obj["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise self.fail(f"{where}.size", f"expected a positive integer (bytes), got {show(size)}")
        if size > MAX_BLOB_SIZE:
            raise self.fail(f"{where}.size", f"expected at most {MAX_BLOB_SIZE} bytes, got {size}")

        entries = obj["entries"]
        if not isinstance(entries, dict) or not entries:
            raise self.fail(f"{where}.entries", f"expected a non-empty object of entry name -> parameter types, got {show(entries)}")
        toolkit, driver = self._toolkit(where, obj, arch)
        parsed_arch = layout_arch(arch)
        specs: dict[str, EntrySpec] = {}
        names: dict[str, str] = {}
        for name, value in entries.items():
            if not IDENT_RE.fullmatch(name):
                raise self.fail(f"{where}.entries", f"expected C identifiers as entry names, got {show(name)}")
            entry = self._entry(f"{where}.entries.{name}", name, value, parsed_arch)
            if entry.name in names and names[entry.name] != name:
                raise self.fail(f"{where}.entries.{name}.name", f"{show(entry.name)} also names entry {show(names[entry.name])}")
            names[entry.name] = name
            specs[name] = entry

        target = obj["target"]
        if (
            not isinstance(target, str)
            or not LABEL_RE.fullmatch(target)
            or ".." in target.replace(":", "/").split("/")
        ):
            raise self.fail(f"{where}.target", f"expected a Bazel label like '//pkg:name', got {show(target)}")

        return KernelSpec(
            id=kid, family=family, params=params, arch=arch, digest=digest, size=size,
            entries={n: e.types for n, e in specs.items()}, target=target, entry_specs=specs,
            toolkit=toolkit, min_driver=driver,
        )

    def _toolkit(self, where: str, obj: dict[str, Any], arch: str) -> tuple[str | None, int | None]:
        """The kernel's (toolkit, min_driver): both or neither, and both for PTX, whose driver must
        compile it. A kernel without them (a manifest from before they existed) is loaded unchecked."""
        present = [k for k in TOOLKIT_FIELDS if k in obj]
        if not present:
            if is_ptx(arch):
                raise self.fail(where, f"missing key 'toolkit': PTX ({arch}) must name the toolkit that wrote it")
            return None, None
        if len(present) == 1:
            other = next(k for k in TOOLKIT_FIELDS if k not in obj)
            raise self.fail(where, f"missing key {show(other)}: 'toolkit' and 'min_driver' come together")
        toolkit, driver = obj["toolkit"], obj["min_driver"]
        if not isinstance(toolkit, str) or not TOOLKIT_RE.fullmatch(toolkit):
            raise self.fail(f"{where}.toolkit", f"expected a CUDA toolkit version like '13.0.88', got {show(toolkit)}")
        low, high = MIN_DRIVER_RANGE
        if isinstance(driver, bool) or not isinstance(driver, int) or not low <= driver <= high:
            raise self.fail(f"{where}.min_driver", f"expected a driver version as cuDriverGetVersion reports it "
                            f"(an integer in [{low}, {high}], e.g. 13000 for CUDA 13.0), got {show(driver)}")
        return toolkit, driver

    def _entry(self, where: str, symbol: str, value: object, arch: Arch) -> EntrySpec:
        """One entry: a v1 list of types, or a v2 object with name, params, offsets, launch."""
        if self.schema == SCHEMA_V1:
            if not isinstance(value, list):
                raise self.fail(where, f"expected a list of parameter types, got {show(value)}")
            return EntrySpec(symbol, symbol, self._types(where, value), None, None)
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object with name, params and offsets, got {show(value)}")
        unknown = sorted(set(value) - ENTRY_KEYS)
        if unknown:
            raise self.fail(where, f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(ENTRY_KEYS))}")
        for key in ("name", "params", "offsets"):
            if key not in value:
                raise self.fail(where, f"missing key {show(key)}")
        name = value["name"]
        if not isinstance(name, str) or not _READABLE_RE.fullmatch(name):
            raise self.fail(f"{where}.name", f"expected a readable name (printable ASCII, 1..{MAX_READABLE_CHARS}), got {show(name)}")
        if not isinstance(value["params"], list):
            raise self.fail(f"{where}.params", f"expected a list of parameter types, got {show(value['params'])}")
        types = self._types(f"{where}.params", value["params"])
        offsets = value["offsets"]
        if (not isinstance(offsets, list) or len(offsets) != len(types)
                or any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in offsets)):
            raise self.fail(f"{where}.offsets", f"expected {len(types)} non-negative integers, got {show(offsets)}")
        if arch.major in _abi.PARAM_BANK_OFFSET:
            rule = _abi.param_layout([_abi.param_type(t) for t in types], arch)
            if tuple(offsets) != rule:
                raise self.fail(f"{where}.offsets", f"expected {list(rule)} (the layout {arch} gives these types), got {offsets}")
        launch = None
        if value.get("launch") is not None:
            try:
                launch = LaunchGeometry.from_json(value["launch"], f"{where}.launch")
            except BadArgumentError as exc:
                raise ManifestError(f"invalid manifest {self.source}: {exc}") from None
        return EntrySpec(symbol, name, types, tuple(offsets), launch)

    def _types(self, where: str, types: list[Any]) -> tuple[str, ...]:
        if len(types) > _abi.MAX_PARAMS:
            raise self.fail(where, f"expected at most {_abi.MAX_PARAMS} parameters, got {len(types)}")
        for pos, type_ in enumerate(types):
            try:
                _abi.param_type(type_)
            except (BadArgumentError, TypeError):  # TypeError: an unhashable value (param_type is cached)
                raise self.fail(f"{where}[{pos}]", f"expected one of {_abi.type_grammar()}, got {show(type_)}") from None
        return tuple(types)

    def _check_id(self, where: str, kid: str, family: str, params: Mapping[str, ParamValue], arch: str) -> None:
        parts = kid.split("/")
        rendered = sorted(render_param(k, v) for k, v in params.items())
        if (
            len(parts) != len(params) + 2
            or parts[0] != family
            or parts[-1] != arch
            or sorted(parts[1:-1]) != rendered
        ):
            expected = kernel_id(family, params, arch)
            raise self.fail(where, f"expected '<family>/<param values>/<arch>' consistent with family, params and arch (e.g. {show(expected)}), got {show(kid)}")

    def identities(self, specs: tuple[KernelSpec, ...]) -> None:
        """Identity is (family, params, arch): one kernel each, and one id order per family.

        Canonical JSON sorts ``params``, so the grid's order survives only in the ids: every
        id of a family must render its params in one order, or two spellings of one kernel
        could both be accepted and ``select`` would pick one silently.
        """
        seen: dict[tuple[Any, ...], int] = {}
        orders: dict[str, _IdOrder] = {}
        for i, spec in enumerate(specs):
            identity = (spec.family, tuple(sorted(spec.params.items())), spec.arch)
            if identity in seen:
                first = specs[seen[identity]]
                raise self.fail(
                    f"kernels[{i}] (id {show(spec.id)})",
                    f"same family, params and arch as kernels[{seen[identity]}] (id {show(first.id)})",
                )
            seen[identity] = i
            order = orders.get(spec.family)
            if order is None:
                order = orders[spec.family] = _IdOrder(spec.params, i)
            if set(spec.params) != set(order.keys):
                raise self.fail(
                    f"kernels[{i}] (id {show(spec.id)}).params",
                    f"expected the keys of family {show(spec.family)} ({', '.join(sorted(order.keys))}), "
                    f"got {', '.join(sorted(spec.params))}",
                )
            if not order.narrow(spec.params, spec.id.split("/")[1:-1]):
                first_index = order.first_index
                raise self.fail(
                    f"kernels[{i}] (id {show(spec.id)}).id",
                    f"renders the params of family {show(spec.family)} in another order than kernels[{first_index}] "
                    f"(id {show(specs[first_index].id)}); ids follow the grid's order",
                )


def upgrade_v1_entries(obj: dict[str, Any]) -> dict[str, Any]:
    entries = obj.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(v, list) for v in entries.values()):
        return obj
    try:
        arch = layout_arch(obj.get("arch"))  # type: ignore[arg-type]  # a bad value raises BadArgumentError
        obj["entries"] = {
            name: {"name": name, "params": types,
                   "offsets": list(_abi.param_layout([_abi.param_type(t) for t in types], arch))}
            for name, types in entries.items()
        }
    except BadArgumentError:
        pass  # left as is: validation names the bad field
    return obj


def jit_templates(check: Checker, families: object, kernel_families: set[str]) -> dict[str, Any]:
    """The ``families`` section: each family's JIT template, validated (``cubinstore.manifest.family``)."""
    if not isinstance(families, dict):
        raise check.fail(FAMILIES_KEY, f"expected an object of family -> {{jit}}, got {show(families)}")
    if not families:
        return {}
    from cubinstore.manifest.family import FamilyTemplate  # its allow-list compiles regexes: only when present

    out = {}
    for family, section in families.items():
        where = f"{FAMILIES_KEY}.{family}"
        if family not in kernel_families:
            raise check.fail(where, f"names no family of the manifest's kernels ({', '.join(sorted(kernel_families))})")
        if not isinstance(section, dict) or set(section) != {"jit"}:
            raise check.fail(where, f"expected {{\"jit\": <template>}}, got {show(section)}")
        template = FamilyTemplate.from_json(section["jit"], where=f"invalid manifest {check.source}: {where}.jit")
        if template.family != family:
            raise check.fail(f"{where}.jit.family", f"expected {show(family)}, got {show(template.family)}")
        out[family] = template
    return out


#: Augmenting steps (keys tried) the id-order check has taken in this process: its work, counted.
order_steps = 0


class _IdOrder:
    """One family's possible id orders: which param key each id position may render, and a
    matching of positions to distinct keys that those candidates allow, kept as kernels narrow them.

    Keys are bits of an int (a point has at most ``MAX_POINT_PARAMS``). A kernel only removes
    candidates, so the matching is repaired, not rebuilt: each position that lost its key gets
    one augmenting path (Kuhn's), at most P keys tried; a family removes at most P*P candidates,
    so its whole check tries at most P**3 keys, where a search over orders would try P! of them.
    """

    def __init__(self, params: Mapping[str, ParamValue], first_index: int) -> None:
        self.keys = tuple(params)
        self.first_index = first_index
        self.bit = {k: 1 << n for n, k in enumerate(self.keys)}
        self.candidates = [(1 << len(self.keys)) - 1] * len(self.keys)
        self.key_of = [-1] * len(self.keys)  # position -> matched key number
        self.position_of = [-1] * len(self.keys)  # key number -> matched position

    def narrow(self, params: Mapping[str, ParamValue], segments: list[str]) -> bool:
        """Keep only the orders that ``segments`` (one id's, keys checked) also render; whether any is left."""
        fits: dict[str, int] = {}
        for key, value in params.items():
            segment = render_param(key, value)
            fits[segment] = fits.get(segment, 0) | self.bit[key]
        shrank = False
        for pos, segment in enumerate(segments):
            before = self.candidates[pos]
            after = before & fits.get(segment, 0)
            if after != before:
                shrank = True
                self.candidates[pos] = after
                key = self.key_of[pos]
                if key >= 0 and not after >> key & 1:
                    self.key_of[pos] = self.position_of[key] = -1
        # Untouched candidates are every key at every position: any order fits, no matching needed yet.
        return not shrank or all(self.key_of[pos] >= 0 or self._augment(pos) for pos in range(len(segments)))

    def _augment(self, start: int) -> bool:
        """Match position ``start`` along one augmenting path; False when there is none (Berge: then no
        matching covers every position, so no order renders every id seen)."""
        global order_steps
        tried = 0  # keys this search has tried: each at most once, so at most P steps
        steps = 0
        # Depth-first, iteratively: (position, keys left to try) frames; a key's owner is the next frame.
        stack = [(start, self.candidates[start])]
        path: list[int] = []  # the key tried at each frame
        while stack:
            pos, left = stack[-1]
            left &= ~tried
            if not left:
                stack.pop()
                if path:
                    path.pop()
                continue
            low = left & -left
            tried |= low
            steps += 1
            stack[-1] = (pos, left & ~low)
            key = low.bit_length() - 1
            owner = self.position_of[key]
            path.append(key)
            if owner < 0:  # a free key: flip the path
                for (p, _), k in zip(stack, path):
                    self.key_of[p], self.position_of[k] = k, p
                order_steps += steps
                return True
            stack.append((owner, self.candidates[owner]))
        order_steps += steps
        return False


def check(text: str, source: str) -> tuple[str, tuple[KernelSpec, ...], dict[str, int], dict[str, tuple[int, ...]], dict[str, Any]]:
    """Parse and validate a whole document (v2 or v1), any key order or spacing: ``(schema, specs,
    by_id, by_stem, templates)``, where ``by_id`` maps each id and ``by_stem`` each id without its
    arch to kernel positions. Raises ``ManifestError`` naming ``source`` and the first bad field."""
    check = Checker(source)
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=reject_constant)
    except DuplicateKeyError as exc:
        raise check.fail("file", f"duplicate key {show(exc.args[0])}") from None
    except json.JSONDecodeError as exc:
        raise check.fail("file", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise check.fail("file", "JSON nested too deeply") from None
    except ValueError as exc:  # NaN/Infinity, integers too long to convert
        raise check.fail("file", f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise check.fail("top level", f"expected an object, got {type(doc).__name__}")
    schema = doc.get("schema")
    allowed = TOP_KEYS | ({FAMILIES_KEY} if schema == SCHEMA else set())
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise check.fail("top level", f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(allowed))}")
    if schema not in SCHEMAS:
        raise check.fail("schema", f"expected {SCHEMA!r} or {SCHEMA_V1!r}, got {show(schema)}")
    check.schema = schema
    kernels = doc.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        raise check.fail("kernels", f"expected a non-empty list, got {show(kernels)}")
    specs = tuple(check.kernel(i, k) for i, k in enumerate(kernels))
    by_id: dict[str, int] = {}
    by_stem: dict[str, list[int]] = {}
    sizes: dict[Digest, tuple[int, str]] = {}
    for i, spec in enumerate(specs):
        if spec.id in by_id:
            raise check.fail(f"kernels[{i}].id", f"duplicate id {show(spec.id)}")
        by_id[spec.id] = i
        by_stem.setdefault(spec.id.rsplit("/", 1)[0], []).append(i)
        seen = sizes.setdefault(spec.digest, (spec.size, spec.id))
        if seen[0] != spec.size:
            raise check.fail(
                f"kernels[{i}] (id {show(spec.id)}).size",
                f"{spec.digest} has size {seen[0]} in kernel {show(seen[1])}, got {spec.size}",
            )
    check.identities(specs)
    templates = jit_templates(check, doc.get(FAMILIES_KEY, {}), {s.family for s in specs})
    return schema, specs, by_id, {s: tuple(v) for s, v in by_stem.items()}, templates
