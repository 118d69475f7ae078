"""The kernel manifest (schemas ``cubinstore/manifest/v2``, and ``v1`` read only): parsing,
validation, lookup, arch selection.

A manifest is untrusted input until ``Manifest.from_bytes`` has validated every field; after
that its ``KernelSpec`` values are frozen and safe to use. The facts it is checked against
(parameter types, the layout rule, the arch grammar, ids, limits) live in ``cubinstore._core.abi``.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from cubinstore._core import abi as _abi
from cubinstore._core.abi import (
    IDENT_RE,
    MAX_BLOB_SIZE,
    MAX_MANIFEST_BYTES,
    MAX_POINT_PARAMS,
    WORD_RE,
    Arch,
    DuplicateKeyError,
    dumps_canonical,
    kernel_id,
    no_duplicate_keys,
    reject_constant,
    render_param,
)
from cubinstore._core.digest import EMPTY_SHA256_HEX, Digest
from cubinstore._core.geometry import (
    MAX_BLOCK_DIM,
    MAX_CLUSTER_DIM,
    MAX_GRID_DIM,
    MAX_SHARED_MEM,
    LaunchGeometry,
    check_rule,
)
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore.errors import (
    BadArgumentError,
    IncompatibleArchError,
    KernelNotFoundError,
    ManifestError,
)

if TYPE_CHECKING:
    from cubinstore.store import Store  # an annotation only: the store is a layer above

__all__ = [
    "MAX_BLOB_SIZE",
    "MAX_MANIFEST_BYTES",
    "PARAM_TYPES",
    "SCHEMA",
    "SCHEMA_V1",
    "EntrySpec",
    "KernelSpec",
    "Manifest",
    "arch_compatible",
    "dumps_canonical",
    "kernel_id",
    "parse_arch",
]

_log = get_logger(__name__)

SCHEMA = "cubinstore/manifest/v2"
SCHEMA_V1 = "cubinstore/manifest/v1"
_SCHEMAS = (SCHEMA, SCHEMA_V1)
#: The scalar parameter type names (``struct:<size>:<align>`` is allowed too).
PARAM_TYPES = frozenset(_abi.SCALAR_TYPES)

_TOP_KEYS = frozenset({"schema", "kernels"})
# v2 only, optional: family -> {"jit": <cubinstore/jit-family/v1 template>} for points no release has.
_FAMILIES_KEY = "families"
_KERNEL_FIELDS = ("id", "family", "params", "arch", "digest", "size", "entries", "target")
_KERNEL_KEYS = frozenset(_KERNEL_FIELDS)
_ENTRY_KEYS = frozenset({"name", "params", "offsets", "launch"})
_LABEL_RE = re.compile(r"//[A-Za-z0-9_.+/-]*(?::[A-Za-z0-9_.+/=,@~-]+)?", re.ASCII)
# A readable C++ name: printable ASCII, e.g. "ns::gemm<ns::bf16, 128, 256>".
_MAX_READABLE_CHARS = 1024
_READABLE_RE = re.compile(rf"[ -~]{{1,{_MAX_READABLE_CHARS}}}", re.ASCII)

ParamValue = str | int
ComputeCapability = tuple[int, int]


def parse_arch(arch: object) -> tuple[int, int, bool]:
    """``"sm_90a"`` -> ``(9, 0, True)``: the arch grammar of ``cubinstore._core.abi.Arch``."""
    parsed = Arch.parse(arch)
    return parsed.major, parsed.minor, parsed.suffix == "a"


def _check_cc(cc: object) -> ComputeCapability:
    if type(cc) is tuple and len(cc) == 2 and type(cc[0]) is int is type(cc[1]) and cc[0] >= 0 <= cc[1]:
        return cc  # type: ignore[return-value]  # the common case, as a device reports it; the check below words the rest
    if (
        not isinstance(cc, tuple)
        or len(cc) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)
    ):
        raise BadArgumentError(f"invalid compute capability {show(cc)}: expected a tuple (major, minor) of non-negative ints")
    return cc


def arch_compatible(arch: str | Arch, cc: ComputeCapability) -> bool:
    """Whether a CUBIN built for ``arch`` loads on a GPU of compute capability ``cc``.

    ``sm_XYa`` runs only on X.Y exactly; ``sm_XYf`` and ``sm_XY`` on major X with minor >= Y.
    CUBINs never cross a major version.
    """
    parsed = arch if isinstance(arch, Arch) else Arch.parse(arch)
    return parsed.runs_on(_check_cc(cc))


_set_hex = Digest.__dict__["hex"].__set__  # the slot's setter: what Digest.__init__ fills after its check
_after_prefix = operator.itemgetter(slice(len("sha256:"), None))


def _checked_digest(text: str) -> Digest:
    """The Digest of a ``sha256:<hex>`` string the fast path's regex already matched (no second check)."""
    digest = object.__new__(Digest)
    _set_hex(digest, text[7:])
    return digest


def _checked_digests(texts: list[str]) -> list[Digest]:
    """``_checked_digest`` of each of ``texts``, at C speed (no Python call per digest: ``Manifest.blobs``
    of tens of thousands of kernels)."""
    digests = list(map(object.__new__, itertools.repeat(Digest, len(texts))))
    for _ in map(_set_hex, digests, map(_after_prefix, texts)):
        pass
    return digests


@dataclass(frozen=True)
class EntrySpec:
    """One kernel entry of a CUBIN: its symbol, readable name, parameter types and layout."""

    symbol: str  # what the driver looks up (the mangled name, or an extern "C" name)
    name: str  # the readable (demangled) name; the symbol itself for extern "C" entries
    types: tuple[str, ...]
    offsets: tuple[int, ...] | None  # None in v1 manifests: then the ABI rule gives them
    launch: LaunchGeometry | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "params": list(self.types)}
        if self.offsets is not None:
            out["offsets"] = list(self.offsets)
        if self.launch is not None:
            out["launch"] = self.launch.to_json()
        return out


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One CUBIN of a release: what it is, where its bytes are (by digest), how to call its entries.

    ``entries`` maps each entry symbol to its parameter types; ``entry_specs`` has the rest
    (readable name, offsets, launch geometry); ``entry(name)`` resolves either name.
    """

    id: str
    family: str
    params: Mapping[str, ParamValue]
    arch: str
    digest: Digest
    size: int
    entries: Mapping[str, tuple[str, ...]]
    target: str
    entry_specs: Mapping[str, EntrySpec] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Freeze the mappings so a spec shared between threads cannot change under a loader.
        specs = dict(self.entry_specs)
        for symbol, types in self.entries.items():
            specs.setdefault(symbol, EntrySpec(symbol, symbol, tuple(types), None, None))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "entries", MappingProxyType({s: e.types for s, e in specs.items()}))
        object.__setattr__(self, "entry_specs", MappingProxyType(specs))
        names = {e.name: e for e in specs.values()}
        names.update(specs)
        object.__setattr__(self, "_names", MappingProxyType(names))

    @classmethod
    def _checked(cls, obj: dict[str, Any], specs: dict[str, EntrySpec]) -> KernelSpec:
        """What ``__init__`` builds, from a kernel object the manifest's fast path checked.

        The object is the manifest's private parse, so its dicts are wrapped, not copied.
        """
        spec = object.__new__(cls)
        names = {e.name: e for e in specs.values()}
        names.update(specs)
        spec.__dict__.update(
            id=obj["id"], family=obj["family"], params=MappingProxyType(obj["params"]), arch=obj["arch"],
            digest=_checked_digest(obj["digest"]), size=obj["size"],
            entries=MappingProxyType({s: e.types for s, e in specs.items()}), target=obj["target"],
            entry_specs=MappingProxyType(specs), _names=MappingProxyType(names),
        )
        return spec

    @functools.cached_property
    def _key(self) -> tuple[Any, ...]:
        # Computed on first comparison only: opening a manifest of many kernels never needs it.
        return (self.id, self.family, tuple(sorted(self.params.items())), self.arch, self.digest, self.size,
                tuple(sorted((s, repr(e.to_json())) for s, e in self.entry_specs.items())), self.target)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelSpec) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def compute_capability(self) -> ComputeCapability:
        return Arch.parse(self.arch).compute_capability

    def entry(self, name: str) -> EntrySpec:
        """The entry whose symbol or readable name is ``name``."""
        spec = self._names.get(name)  # type: ignore[attr-defined]
        if spec is None:
            readable = ", ".join(e.name for e in self.entry_specs.values())
            raise KernelNotFoundError(f"kernel {self.id!r} has no entry {name!r}; entries: {readable}")
        return spec

    def _entry_json(self, entry: EntrySpec) -> dict[str, Any]:
        out = entry.to_json()
        if entry.offsets is None:  # read from a v1 manifest: v2 records the rule's offsets
            types = [_abi.param_type(t) for t in entry.types]
            out["offsets"] = list(_abi.param_layout(types, Arch.parse(self.arch)))
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest (v2) JSON object of this kernel."""
        return {
            "id": self.id,
            "family": self.family,
            "params": dict(self.params),
            "arch": self.arch,
            "digest": str(self.digest),
            "size": self.size,
            "entries": {s: self._entry_json(e) for s, e in self.entry_specs.items()},
            "target": self.target,
        }


class _Checker:
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
        unknown = sorted(set(obj) - _KERNEL_KEYS)
        if unknown:
            raise self.fail(where, f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(_KERNEL_KEYS))}")
        missing = sorted(_KERNEL_KEYS - set(obj))
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
            Arch.parse(arch)
        except (BadArgumentError, TypeError):  # TypeError: an unhashable value (Arch.parse is cached)
            raise self.fail(f"{where}.arch", f"expected 'sm_<digits>' with optional 'a' or 'f' (e.g. 'sm_90a'), got {show(arch)}") from None

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
        parsed_arch = Arch.parse(arch)
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
            or not _LABEL_RE.fullmatch(target)
            or ".." in target.replace(":", "/").split("/")
        ):
            raise self.fail(f"{where}.target", f"expected a Bazel label like '//pkg:name', got {show(target)}")

        return KernelSpec(
            id=kid, family=family, params=params, arch=arch, digest=digest, size=size,
            entries={n: e.types for n, e in specs.items()}, target=target, entry_specs=specs,
        )

    def _entry(self, where: str, symbol: str, value: object, arch: Arch) -> EntrySpec:
        """One entry: a v1 list of types, or a v2 object with name, params, offsets, launch."""
        if self.schema == SCHEMA_V1:
            if not isinstance(value, list):
                raise self.fail(where, f"expected a list of parameter types, got {show(value)}")
            return EntrySpec(symbol, symbol, self._types(where, value), None, None)
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object with name, params and offsets, got {show(value)}")
        unknown = sorted(set(value) - _ENTRY_KEYS)
        if unknown:
            raise self.fail(where, f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(_ENTRY_KEYS))}")
        for key in ("name", "params", "offsets"):
            if key not in value:
                raise self.fail(where, f"missing key {show(key)}")
        name = value["name"]
        if not isinstance(name, str) or not _READABLE_RE.fullmatch(name):
            raise self.fail(f"{where}.name", f"expected a readable name (printable ASCII, 1..{_MAX_READABLE_CHARS}), got {show(name)}")
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


def _upgrade_v1_entries(obj: dict[str, Any]) -> dict[str, Any]:
    entries = obj.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(v, list) for v in entries.values()):
        return obj
    try:
        arch = Arch.parse(obj.get("arch"))
        obj["entries"] = {
            name: {"name": name, "params": types,
                   "offsets": list(_abi.param_layout([_abi.param_type(t) for t in types], arch))}
            for name, types in entries.items()
        }
    except BadArgumentError:
        pass  # left as is: validation names the bad field
    return obj


def _jit_templates(check: _Checker, families: object, kernel_families: set[str]) -> dict[str, Any]:
    """The ``families`` section: each family's JIT template, validated (``cubinstore.manifest.family``)."""
    if not isinstance(families, dict):
        raise check.fail(_FAMILIES_KEY, f"expected an object of family -> {{jit}}, got {show(families)}")
    if not families:
        return {}
    from cubinstore.manifest.family import FamilyTemplate  # its allow-list compiles regexes: only when present

    out = {}
    for family, section in families.items():
        where = f"{_FAMILIES_KEY}.{family}"
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


# -- the fast path --------------------------------------------------------------------------------
# Opening a release of tens of thousands of kernels must cost about one json.loads. Canonical
# manifests (what the build and Manifest.build write) are validated here with few Python calls
# per kernel and memoised checks, an entry table that repeats is parsed and checked once, and
# their KernelSpecs are built only when asked for. The fast path only ever *accepts*: whatever
# it is unsure of (v1, an ambiguous id order, any bad field) goes to _Checker, which alone words
# the errors, so both paths accept exactly the same documents.
class _Slow(Exception):
    """The fast path declines this document; the full checker decides."""


def _decline(_text: str) -> Any:
    raise _Slow  # a float or NaN anywhere: no valid v2 field holds one


_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
_EMPTY_DIGEST = "sha256:" + EMPTY_SHA256_HEX
_ENTRY_KEYS_3 = frozenset({"name", "params", "offsets"})
_chain = itertools.chain.from_iterable
# Whole columns joined by newlines (no pattern below matches one), checked in one regex call.
_DIGESTS_RE = re.compile(r"(?:sha256:[0-9a-f]{64}\n)+", re.ASCII)
_IDENTS_RE = re.compile(rf"(?:{IDENT_RE.pattern}\n)+", re.ASCII)
_LABELS_RE = re.compile(rf"(?:{_LABEL_RE.pattern}\n)+", re.ASCII)
_LAUNCH_KEYS = frozenset({"block", "shared_mem", "cluster", "grid"})
# A launch object's text, up to its first brace: a "}" closes it, a "{" is a nested object.
_LAUNCH_TEXT_RE = re.compile(r'"launch":(\{[^{}]*\}?)', re.ASCII)
_ENTRIES_KEY = '"entries":'
# In canonical key order a kernel's "family" follows its "entries", and "families" comes first.
_AFTER_ENTRIES = ',"family":'
_CUT_ENTRIES = _ENTRIES_KEY + "0" + _AFTER_ENTRIES
_FAMILIES_FIRST = '{"' + _FAMILIES_KEY + '":'


def _id_order(kid: object, family: str, params: dict[str, Any], arch: str) -> tuple[str, ...]:
    """The param keys in the order the family's first id renders them, when that is unambiguous."""
    if type(kid) is not str:
        raise _Slow
    parts = kid.split("/")
    if len(parts) != len(params) + 2 or parts[0] != family or parts[-1] != arch or len(params) > MAX_POINT_PARAMS:
        raise _Slow
    order = []
    for segment in parts[1:-1]:
        keys = [k for k, v in params.items() if render_param(k, v) == segment]
        if len(keys) != 1 or keys[0] in order:
            raise _Slow
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
        raise _Slow
    if lists and not set(map(len, lists)) <= {1, 2, 3}:
        raise _Slow
    if not set(map(type, flat)) <= {int} or min(flat) < 1 or max(flat) > limit:
        raise _Slow


def _launches_ok(launches: list[dict[str, Any]]) -> None:
    """LaunchGeometry.from_json's rules over every launch object, column by column."""
    if not all("block" in keys and keys <= _LAUNCH_KEYS for keys in set(map(frozenset, launches))):
        raise _Slow
    _dims_ok([g["block"] for g in launches], MAX_BLOCK_DIM)
    smem = [g.get("shared_mem", 0) for g in launches]
    if set(map(type, smem)) != {int} or min(smem) < 0 or max(smem) > MAX_SHARED_MEM:
        raise _Slow
    clusters = [c for g in launches if (c := g.get("cluster")) is not None]
    if clusters:
        _dims_ok(clusters, MAX_CLUSTER_DIM)
    grids = [r for g in launches if (r := g.get("grid")) is not None]
    if grids:
        if set(map(type, grids)) != {list} or not set(map(len, grids)) <= {1, 2, 3}:
            raise _Slow
        items = list(_chain(grids))
        if not set(map(type, items)) <= {int, str}:
            raise _Slow
        numbers = [x for x in items if type(x) is int]
        if numbers and (min(numbers) < 1 or max(numbers) > MAX_GRID_DIM):
            raise _Slow
        try:
            for rule in {x for x in items if type(x) is str}:
                check_rule(rule)
        except BadArgumentError:
            raise _Slow from None


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
        raise _Slow  # a brace inside an object, or a launch object elsewhere: check each one
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
    """_Checker._entry's rules for one (types, offsets) pair, as a yes/no."""
    try:
        parsed = [_abi.param_type(t) for t in types]
    except BadArgumentError:
        raise _Slow from None
    if len(parsed) > _abi.MAX_PARAMS or len(offsets) != len(types):
        raise _Slow
    if arch.major in _abi.PARAM_BANK_OFFSET and offsets != _abi.param_layout(parsed, arch):
        raise _Slow


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


def _fast_index(text: str) -> tuple[list[dict[str, Any]], _Index, dict[str, Any]]:
    """Validate a v2 document the quick way and index it; raises _Slow when unsure.

    Checks run column by column (one C-level pass each: ``set(map(type, ...))``, one regex over
    the joined column), so the per-kernel Python work is the id rendering and little else.
    """
    if "\\" in text:
        raise _Slow
    cut = _cut_entries(text)
    outer = text if cut is None else cut[0]
    try:
        doc = json.loads(outer, parse_constant=_decline, parse_float=_decline)
    except (ValueError, RecursionError):
        raise _Slow from None
    if type(doc) is not dict or not _TOP_KEYS <= doc.keys() <= _TOP_KEYS | {_FAMILIES_KEY} or doc["schema"] != SCHEMA:
        raise _Slow
    kernels = doc["kernels"]
    if type(kernels) is not list or not kernels:
        raise _Slow
    n = len(kernels)
    if set(map(type, kernels)) != {dict} or set(map(len, kernels)) != {len(_KERNEL_FIELDS)}:
        raise _Slow
    try:  # as many keys as fields, and each field there: the kernel keys exactly
        ids, families, params, archs, digests, sizes, entries, targets = (
            list(map(operator.itemgetter(key), kernels)) for key in _KERNEL_FIELDS)
    except KeyError:
        raise _Slow from None

    # The entry tables to check: every kernel's, or, cut from the text, one per distinct (arch, text):
    # besides its text, only a kernel's arch decides whether its table is valid (the offsets).
    if cut is None:
        tables, table_archs, table_text, table_colons = entries, archs, text, 0
    else:
        _, texts, by_text = cut
        if len(texts) != n or set(entries) != {0}:
            raise _Slow  # a cut value that is no kernel's own: it would not be put back
        for _ in map(operator.setitem, kernels, itertools.repeat("entries"), map(by_text.__getitem__, texts)):
            pass
        table_archs, table_texts = zip(*dict.fromkeys(zip(archs, texts)))
        tables = list(map(by_text.__getitem__, table_texts))
        table_text = "".join(table_texts)
        table_colons = table_text.count(":")

    if set(map(type, families)) != {str} or set(map(type, archs)) != {str} or set(map(type, params)) != {dict}:
        raise _Slow
    if not all(map(WORD_RE.fullmatch, set(families))):
        raise _Slow
    try:
        parsed_archs = {a: Arch.parse(a) for a in set(archs)}
    except BadArgumentError:
        raise _Slow from None
    values = list(_chain(map(dict.values, params)))
    if not set(map(type, values)) <= {int, str}:  # no bool, float, list or null
        raise _Slow
    if not all(type(v) is int or WORD_RE.fullmatch(v) for v in set(values)):
        raise _Slow

    # Ids: each family's first id fixes its param order; every id must render in that order
    # (then its params have the family's keys, and (family, params, arch) is unique with the id).
    first = dict(zip(reversed(families), range(n - 1, -1, -1)))
    orders = {f: _id_order(ids[i], f, params[i], archs[i]) for f, i in first.items()}
    if not all(all(map(IDENT_RE.fullmatch, params[i])) for i in first.values()):
        raise _Slow
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
            raise _Slow
        columns = [_rendered(k, list(map(operator.itemgetter(k), rows))) for k in order]
        family_stems = list(map("/".join, zip(itertools.repeat(f, len(rows)), *columns)))
        family_archs = archs if len(groups) == 1 else [archs[i] for i in members]
        family_ids = ids if len(groups) == 1 else [ids[i] for i in members]
        if list(map("/".join, zip(family_stems, family_archs))) != list(family_ids):
            raise _Slow
        if len(groups) == 1:
            stems = family_stems
        else:
            for i, stem in zip(members, family_stems):
                stems[i] = stem
    by_id = dict(zip(ids, range(n)))
    if len(by_id) != n:
        raise _Slow  # a duplicate id

    if (set(map(type, sizes)) != {int} or min(sizes) <= 0 or max(sizes) > MAX_BLOB_SIZE
            or not _DIGESTS_RE.fullmatch("\n".join(digests) + "\n")):
        raise _Slow
    distinct = set(digests)
    if _EMPTY_DIGEST in distinct or (len(distinct) != n and len(set(zip(digests, sizes))) != len(distinct)):
        raise _Slow  # the empty blob, or one digest with two sizes
    labels = "\n".join(targets) + "\n"
    if not _LABELS_RE.fullmatch(labels) or (".." in labels and any(
            ".." in t.replace(":", "/").split("/") for t in targets if ".." in t)):
        raise _Slow

    if set(map(type, tables)) != {dict} or not all(tables):
        raise _Slow
    symbols = list(_chain(tables))
    bodies = list(_chain(map(dict.values, tables)))
    if not _IDENTS_RE.fullmatch("\n".join(symbols) + "\n") or set(map(type, bodies)) != {dict}:
        raise _Slow
    if not set(map(frozenset, bodies)) <= {_ENTRY_KEYS_3, _ENTRY_KEYS}:
        raise _Slow
    names = [v["name"] for v in bodies]
    readable = "".join(names)  # a TypeError for a name that is not a str
    # _READABLE_RE at C speed: printable ASCII is exactly 0x20..0x7e.
    if (not (readable.isascii() and readable.isprintable()) or min(map(len, names)) < 1
            or max(map(len, names)) > _MAX_READABLE_CHARS):
        raise _Slow
    for e in tables:
        if len(e) > 1 and len({v["name"] for v in e.values()}) != len(e):
            raise _Slow  # two entries of one kernel share a readable name
    types = [v["params"] for v in bodies]
    offsets = [v["offsets"] for v in bodies]
    launches = [v.get("launch") for v in bodies]
    if set(map(type, types)) != {list} or set(map(type, offsets)) != {list}:
        raise _Slow
    flat = list(_chain(offsets))
    if flat and (not set(map(type, flat)) <= {int} or min(flat) < 0):
        raise _Slow
    if not set(map(type, launches)) <= {dict, type(None)}:
        raise _Slow
    geometries = [g for g in launches if g is not None]
    if geometries:
        _launches_ok(_distinct_launches(table_text, len(geometries)))
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
    keys = (len(doc) + len(_KERNEL_KEYS) * n + sum(map(len, params)) + len(bodies) + sum(map(len, bodies))
            + sum(map(len, geometries)))
    colons = n + labels.count(":") + readable.count(":") + "".join(_chain(types)).count(":")
    templates: dict[str, Any] = {}
    if _FAMILIES_KEY in doc:  # small and free-form: walked whole, checked by the one full checker
        family_keys, family_colons = _json_tokens(doc[_FAMILIES_KEY])
        keys += family_keys
        colons += family_colons
        templates = _jit_templates(_Checker("<fast path>"), doc[_FAMILIES_KEY], set(first))
    if outer.count(":") + table_colons != keys + colons:
        raise _Slow

    by_stem = dict(zip(stems, zip(range(n))))  # stem -> (i,)
    if len(by_stem) != n:  # several archs of one point
        by_stem = {}
        for i, stem in enumerate(stems):
            by_stem[stem] = by_stem.get(stem, ()) + (i,)
    return kernels, _Index(kernels, None, by_id, by_stem, orders), templates


def _spec_from_obj(obj: dict[str, Any], launches: dict[str, LaunchGeometry]) -> KernelSpec:
    """The KernelSpec of a kernel object _fast_index accepted (no check is repeated)."""
    specs: dict[str, EntrySpec] = {}
    for symbol, value in obj["entries"].items():
        launch = value.get("launch")
        geometry = None
        if launch is not None:
            key = repr(launch)  # the validated JSON's repr: ints, strs, lists, None only
            geometry = launches.get(key)
            if geometry is None:
                geometry = launches.setdefault(key, LaunchGeometry.from_json(launch, symbol))
        entry = object.__new__(EntrySpec)  # a frozen dataclass, filled without its per-field setattr
        entry.__dict__.update(symbol=symbol, name=value["name"], types=tuple(value["params"]),
                              offsets=tuple(value["offsets"]), launch=geometry)
        specs[symbol] = entry
    return KernelSpec._checked(obj, specs)


# Only a big manifest is worth it: aging also moves the application's young objects (and any
# young cyclic garbage) to the oldest generation, where they wait for the next full collection.
_AGE_AFTER_BYTES = 1 << 20


def _age_young_objects() -> None:
    """Move what the parse allocated straight to the oldest GC generation.

    Parsed with the collector paused, the whole document sits in the youngest generation, and
    the next collections would traverse all of it twice on its way up: a one-time cost that
    otherwise lands on the first lookups. ``freeze`` then ``unfreeze`` moves every tracked
    object to the oldest generation without traversing any; skipped when the application
    froze objects itself (``unfreeze`` would release them).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class _Index:
    """A manifest's lookups. KernelSpecs of a fast-path manifest are built on first use.

    ``by_id`` maps an id, ``by_stem`` an id without its arch, to kernel positions; ``orders``
    is each family's param order in its ids (fast path), so a family and all of its params
    render one stem: one dict lookup. Lazily filled parts use setdefault, so threads that
    race on one position all get the same KernelSpec.
    """

    def __init__(self, objs: list[dict[str, Any]] | None, specs: tuple[KernelSpec, ...] | None,
                 by_id: dict[str, int], by_stem: dict[str, tuple[int, ...]], orders: dict[str, tuple[str, ...]]) -> None:
        self._objs = objs
        self._specs: dict[int, KernelSpec] = dict(enumerate(specs)) if specs is not None else {}
        self._count = len(objs) if objs is not None else len(specs or ())
        self._launches: dict[str, LaunchGeometry] = {}
        self.by_id = by_id
        self.by_stem = by_stem
        self.orders = orders
        self._by_point: dict[tuple[str, frozenset[Any]], tuple[int, ...]] | None = None
        if objs is None:  # the slow path has its specs already: index them by point
            by_point: dict[tuple[str, frozenset[Any]], list[int]] = {}
            for i, spec in self._specs.items():
                by_point.setdefault((spec.family, frozenset(spec.params.items())), []).append(i)
            self._by_point = {p: tuple(v) for p, v in by_point.items()}
        self._cache: dict[str, Any] = {}

    def __len__(self) -> int:
        return self._count

    def spec(self, i: int) -> KernelSpec:
        spec = self._specs.get(i)
        if spec is None:
            assert self._objs is not None  # every position of a slow-path index is filled
            spec = self._specs.setdefault(i, _spec_from_obj(self._objs[i], self._launches))
        return spec

    def _field(self, i: int, name: str) -> Any:
        return self._objs[i][name] if self._objs is not None else getattr(self._specs[i], name)

    def all(self) -> tuple[KernelSpec, ...]:
        specs = self._cache.get("all")
        if specs is None:
            collecting = gc.isenabled()
            gc.disable()  # tens of thousands of new acyclic objects: see Manifest.from_bytes
            try:
                specs = self._cache.setdefault("all", tuple(map(self.spec, range(self._count))))
            finally:
                if collecting:
                    if self._count >= 5000:  # see _AGE_AFTER_BYTES
                        _age_young_objects()
                    gc.enable()
        return specs

    def _lazy(self, name: str, build: Any) -> Any:
        value = self._cache.get(name)
        if value is None:
            value = self._cache.setdefault(name, build())
        return value

    def families(self) -> dict[str, tuple[int, ...]]:
        def build() -> dict[str, tuple[int, ...]]:
            out: dict[str, list[int]] = {}
            for i in range(self._count):
                out.setdefault(self._field(i, "family"), []).append(i)
            return {f: tuple(v) for f, v in out.items()}
        return self._lazy("families", build)

    def archs(self) -> tuple[str, ...]:
        return self._lazy("archs", lambda: tuple(sorted({self._field(i, "arch") for i in range(self._count)})))

    def blobs(self) -> tuple[tuple[Digest, int], ...]:
        def build() -> tuple[tuple[Digest, int], ...]:
            objs = self._objs
            if objs is not None:  # fast path: two C-level column reads; the digests were checked at open
                # One size per digest (checked at open): sorting the digest strings sorts the pairs.
                sizes = dict(zip(map(operator.itemgetter("digest"), objs), map(operator.itemgetter("size"), objs)))
                texts = sorted(sizes)
                return tuple(zip(_checked_digests(texts), map(sizes.__getitem__, texts)))
            pairs = {(str(self._field(i, "digest")), self._field(i, "size")) for i in range(self._count)}
            return tuple((Digest.parse(d), s) for d, s in sorted(pairs))
        return self._lazy("blobs", build)

    def ids_of(self) -> dict[str, tuple[str, ...]]:
        def build() -> dict[str, tuple[str, ...]]:
            out: dict[str, list[str]] = {}
            for i in range(self._count):
                out.setdefault(str(self._field(i, "digest")), []).append(self._field(i, "id"))
            return {d: tuple(v) for d, v in out.items()}
        return self._lazy("ids_of", build)

    def point(self, family: str, params: Mapping[str, ParamValue]) -> list[KernelSpec]:
        """The kernels of ``family`` whose params are exactly ``params``, every arch."""
        if self._by_point is not None:
            try:
                return [self._specs[i] for i in self._by_point.get((family, frozenset(params.items())), ())]
            except TypeError:  # an unhashable value names no point
                return []
        order = self.orders.get(family)
        if order is None or len(order) != len(params):
            return []
        try:
            stem = "/".join([family, *[render_param(k, params[k]) for k in order]])
        except KeyError:
            return []
        assert self._objs is not None
        # Rendering can collide (an int 4 and a string 'vec4'): keep only exact params.
        return [self.spec(i) for i in self.by_stem.get(stem, ()) if self._objs[i]["params"] == params]


@dataclass(frozen=True, eq=False)
class Manifest:
    """A validated manifest. Build one with ``from_path``, ``from_bytes``, ``from_digest`` or ``build``."""

    raw: bytes = field(repr=False)
    digest: Digest
    source: str
    schema: str = SCHEMA
    _index: _Index = field(default=None, repr=False)  # type: ignore[assignment]
    #: family -> its JIT template (``cubinstore.manifest.family.FamilyTemplate``), for families that allow
    #: compiling points the release lacks
    jit_templates: Mapping[str, Any] = field(default_factory=dict, repr=False)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, source: str = "<bytes>") -> Manifest:
        """Parse and validate manifest bytes; ``source`` (path, digest, URL) is named in errors."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadArgumentError(f"manifest data from {source}: expected bytes, got {type(data).__name__}")
        raw = bytes(data)
        check = _Checker(source)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise check.fail("file", f"expected at most {MAX_MANIFEST_BYTES} bytes, got {len(raw)}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise check.fail("file", f"expected UTF-8, got an invalid byte at offset {exc.start}") from None
        # Parsing creates hundreds of thousands of containers, none of them cyclic: the cyclic
        # collector would re-scan them many times (more than half of the time of a large open).
        collecting = gc.isenabled()
        gc.disable()
        try:
            try:
                _, index, templates = _fast_index(text)
            except Exception:  # noqa: BLE001 - any doubt: the full checker decides and words the error
                pass
            else:
                return cls(raw=raw, digest=Digest.of(raw), source=source, schema=SCHEMA, _index=index,
                           jit_templates=MappingProxyType(templates))
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
            return cls._from_doc(doc, raw, source)
        finally:
            if collecting:
                if len(raw) >= _AGE_AFTER_BYTES:
                    _age_young_objects()
                gc.enable()

    @classmethod
    def _from_doc(cls, doc: object, raw: bytes, source: str) -> Manifest:
        check = _Checker(source)
        if not isinstance(doc, dict):
            raise check.fail("top level", f"expected an object, got {type(doc).__name__}")
        schema = doc.get("schema")
        allowed = _TOP_KEYS | ({_FAMILIES_KEY} if schema == SCHEMA else set())
        unknown = sorted(set(doc) - allowed)
        if unknown:
            raise check.fail("top level", f"unknown key {show(unknown[0])}; allowed keys: {', '.join(sorted(allowed))}")
        if schema not in _SCHEMAS:
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
        templates = _jit_templates(check, doc.get(_FAMILIES_KEY, {}), {s.family for s in specs})
        index = _Index(None, specs, by_id, {s: tuple(v) for s, v in by_stem.items()}, {})
        return cls(raw=raw, digest=Digest.of(raw), source=source, schema=schema, _index=index,
                   jit_templates=MappingProxyType(templates))

    @classmethod
    def from_path(cls, path: str | Path) -> Manifest:
        """Read and validate the manifest file at ``path``."""
        from cubinstore._core.userfile import open_regular  # refuses a FIFO or device without blocking

        path = Path(path)
        try:
            with open_regular(path, "manifest", ManifestError) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from exc
        return cls.from_bytes(raw, source=str(path))

    @classmethod
    def from_digest(cls, digest: Digest | str, store: Store) -> Manifest:
        """Fetch the manifest blob ``digest`` from ``store`` (verified), then validate it."""
        digest = Digest.parse(digest)
        raw = store.get(digest, name=f"manifest {digest}")
        return cls.from_bytes(raw, source=str(digest))

    @classmethod
    def load(cls, ref: str | Path | Digest, store: Store | None = None) -> Manifest:
        """A manifest from a path, or from a ``sha256:`` digest through ``store``.

        The manifest sits below the store, so it builds none: a digest needs ``store`` passed.
        ``cubinstore._release.refs.load_manifest`` is the resolver that also takes ``channel:``
        and defaults the store (``cubinstore.open`` and the CLI use it)."""
        if isinstance(ref, Digest) or (isinstance(ref, str) and ref.startswith("sha256:")):
            if store is None:
                raise BadArgumentError(
                    f"Manifest.load({show(str(ref))}): a digest is fetched through a store; pass store=, or call "
                    "cubinstore._release.refs.load_manifest, which uses cubinstore.store.default_store()"
                )
            return cls.from_digest(ref, store)
        if not isinstance(ref, (str, Path)):
            raise BadArgumentError(f"manifest reference: expected a path or 'sha256:<hex>', got {show(ref)}")
        return cls.from_path(ref)

    @classmethod
    def build(cls, kernels: Iterable[KernelSpec | Mapping[str, Any]], *, source: str = "<built>",
              jit_templates: Mapping[str, Any] | None = None) -> Manifest:
        """Canonical manifest of ``kernels`` (specs or JSON objects), validated like any other.

        A JSON object's entries may be v1 lists of types: they get the ABI rule's offsets.
        ``jit_templates`` maps a family to its JIT template (a ``FamilyTemplate`` or its JSON).
        """
        objs = [k.to_json() if isinstance(k, KernelSpec) else _upgrade_v1_entries(dict(k)) for k in kernels]
        doc: dict[str, Any] = {"schema": SCHEMA, "kernels": objs}
        if jit_templates:
            doc[_FAMILIES_KEY] = {
                family: {"jit": t.to_json() if hasattr(t, "to_json") else dict(t)} for family, t in jit_templates.items()
            }
        return cls.from_bytes(dumps_canonical(doc), source=source)

    # -- queries --------------------------------------------------------------------------------

    @property
    def kernels(self) -> tuple[KernelSpec, ...]:
        """Every kernel, in manifest order (built on first access: a lookup never needs them all)."""
        return self._index.all()

    def __iter__(self) -> Iterator[KernelSpec]:
        return iter(self.kernels)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def archs(self) -> tuple[str, ...]:
        """Distinct archs, sorted."""
        return self._index.archs()

    @property
    def blobs(self) -> tuple[tuple[Digest, int], ...]:
        """The closure: each distinct (digest, size) the kernels and JIT templates need, sorted by digest."""
        if not self.jit_templates:
            return self._index.blobs()
        bundles = {(t.bundle, t.bundle_size) for t in self.jit_templates.values()}
        return tuple(sorted(set(self._index.blobs()) | bundles, key=lambda b: b[0].hex))

    def ids_of(self, digest: Digest) -> tuple[str, ...]:
        """The ids of the kernels whose CUBIN is ``digest`` (one index for the whole manifest)."""
        return self._index.ids_of().get(str(digest), ())

    def _families(self) -> str:
        return ", ".join(sorted(self._index.families()))

    def by_id(self, kernel_id: str) -> KernelSpec:
        i = self._index.by_id.get(kernel_id) if isinstance(kernel_id, str) else None
        if i is None:
            raise KernelNotFoundError(
                f"no kernel {show(kernel_id)} in manifest {self.source} ({self.digest}); "
                f"it has {len(self)} kernels of families {self._families()}"
            ) from None
        return self._index.spec(i)

    def find(self, family: str, **params: ParamValue) -> list[KernelSpec]:
        """Kernels of ``family`` whose params include every given ``key=value``, all archs, sorted by id."""
        spec = self._index.spec
        return sorted(
            (k for k in map(spec, self._index.families().get(family, ()))
             if all(key in k.params and k.params[key] == v for key, v in params.items())),
            key=lambda k: k.id,
        )

    def select(self, family_or_id: str, compute_capability: ComputeCapability, **params: ParamValue) -> KernelSpec:
        """The kernel to load on a GPU of ``compute_capability``.

        ``family_or_id`` is a full id, an id without its arch (``axpy/f32/vec4``), or a family
        narrowed by ``params``. Among compatible CUBINs the exact arch wins (``sm_90a`` before
        ``sm_90`` on 9.0), then the highest minor not above the GPU's.
        """
        cc = _check_cc(compute_capability)
        index = self._index
        candidates = index.point(family_or_id, params) if params else None
        one_point = bool(candidates)  # a family and all of its params: one dict lookup
        if one_point:
            pass
        elif family_or_id in index.by_id:
            candidates = [index.spec(index.by_id[family_or_id])]
            if params:
                raise BadArgumentError(f"select({family_or_id!r}): a full kernel id takes no params, got {sorted(params)}")
        else:
            candidates = [index.spec(i) for i in index.by_stem.get(family_or_id, ())]
            if candidates and params:
                candidates = [k for k in candidates if all(k.params.get(p) == v for p, v in params.items())]
            elif not candidates:
                candidates = self.find(family_or_id, **params)
        assert candidates is not None
        if not candidates:
            asked = family_or_id + "".join(f" {k}={v!r}" for k, v in sorted(params.items()))
            raise KernelNotFoundError(
                f"no kernel matches {asked} in manifest {self.source} ({self.digest}); "
                f"families: {self._families()}"
            )
        parse = Arch.parse  # cached per arch string
        compatible = [k for k in candidates if parse(k.arch).runs_on(cc)]
        if not compatible:
            sm = f"sm_{cc[0]}{cc[1]}"
            raise IncompatibleArchError(
                f"no CUBIN of {family_or_id!r} for compute capability {cc[0]}.{cc[1]} ({sm}): "
                f"candidates have {', '.join(sorted({k.arch for k in candidates}))}; "
                f"manifest {self.source} has archs {', '.join(self.archs)}; build the kernels for {sm} or {sm}a"
            )
        if not one_point and len(compatible) > 1:  # one point's kernels share their params
            variants = {tuple(sorted(k.params.items())) for k in compatible}
            if len(variants) > 1:
                differing = sorted({key for v in variants for key, _ in v if len({dict(w).get(key) for w in variants}) > 1})
                raise BadArgumentError(
                    f"select({family_or_id!r}) is ambiguous: {len(variants)} parameter sets match; "
                    f"pass {', '.join(differing)}"
                )
        # The highest minor not above the GPU's, then the most specific (a, then f, then plain).
        best = compatible[0] if len(compatible) == 1 else max(
            compatible, key=lambda k: (parse(k.arch).minor, parse(k.arch).preference))
        if _log.isEnabledFor(logging.DEBUG):  # the call costs more than the check
            _log.debug("selected %s (%s) for compute capability %d.%d", best.id, best.digest, cc[0], cc[1])
        return best
