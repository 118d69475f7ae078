"""What a validated manifest hands out: ``KernelSpec`` (one CUBIN of a release) and ``EntrySpec``
(one kernel entry of it), frozen, so a spec shared between threads cannot change under a loader.

Both validators (``cubinstore.manifest.schema``'s full checker and ``cubinstore.manifest.fast``)
build these; neither is checked here.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from cubinstore._core import abi as _abi
from cubinstore._core.digest import Digest
from cubinstore._core.geometry import LaunchGeometry
from cubinstore.errors import KernelNotFoundError
from cubinstore.manifest.ptx import is_ptx, layout_arch

__all__ = ["ComputeCapability", "EntrySpec", "KernelSpec", "ParamValue", "checked_digests"]

ParamValue = str | int
ComputeCapability = tuple[int, int]


_set_hex = Digest.__dict__["hex"].__set__  # the slot's setter: what Digest.__init__ fills after its check
_after_prefix = operator.itemgetter(slice(len("sha256:"), None))
# A fast-path KernelSpec's fields that a load does not read, filled at first use (``__getattr__``).
# (Not a field with a default, toolkit or min_driver: the class's default would answer for it.)
_LAZY = frozenset({"family", "params", "entries", "target", "entry_specs", "_names"})
_set = object.__setattr__


def _checked_digest(text: str) -> Digest:
    """The Digest of a ``sha256:<hex>`` string the fast path's regex already matched (no second check)."""
    digest = object.__new__(Digest)
    _set_hex(digest, text[7:])
    return digest


def checked_digests(texts: list[str]) -> list[Digest]:
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


def _entry_specs(table: dict[str, Any], launches: dict[str, LaunchGeometry],
                 types: Mapping[str, tuple[str, ...]]) -> dict[str, EntrySpec]:
    """The EntrySpecs of a checked kernel object's entry ``table`` (its ``types`` already built), each
    launch geometry built once per manifest (``launches``, keyed by its JSON's repr)."""
    specs: dict[str, EntrySpec] = {}
    for symbol, value in table.items():
        launch = value.get("launch")
        geometry = None
        if launch is not None:
            key = repr(launch)  # the validated JSON's repr: ints, strs, lists, None only
            geometry = launches.get(key)
            if geometry is None:
                geometry = launches.setdefault(key, LaunchGeometry.from_json(launch, symbol))
        entry = object.__new__(EntrySpec)  # a frozen dataclass, filled without its per-field setattr
        entry.__dict__.update(symbol=symbol, name=value["name"], types=types[symbol],
                              offsets=tuple(value["offsets"]), launch=geometry)
        specs[symbol] = entry
    return specs


def _by_either_name(specs: dict[str, EntrySpec]) -> Mapping[str, EntrySpec]:
    """What ``KernelSpec.entry`` resolves: each entry by its readable name and by its symbol (a symbol
    wins where one entry's symbol is another's readable name)."""
    names = {e.name: e for e in specs.values()}
    names.update(specs)
    return MappingProxyType(names)


def _entry_types(table: dict[str, Any]) -> Mapping[str, tuple[str, ...]]:
    """A checked entry table's ``entries`` mapping: each symbol's parameter types."""
    return MappingProxyType({symbol: tuple(value["params"]) for symbol, value in table.items()})


@dataclass(frozen=True, eq=False)
class KernelSpec:
    """One CUBIN of a release: what it is, where its bytes are (by digest), how to call its entries.

    ``entries`` maps each entry symbol to its parameter types; ``entry_specs`` has the rest
    (readable name, offsets, launch geometry); ``entry(name)`` resolves either name. ``symbols``
    are the entry symbols in order (what a load looks up).
    ``toolkit`` and ``min_driver`` (``cubinstore.manifest.toolkit``) are None for a kernel whose
    manifest predates them. An arch ``compute_<XY>`` makes the blob PTX text (``is_ptx``).
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
    toolkit: str | None = None  # the CUDA toolkit that built it, e.g. "13.0.88"
    min_driver: int | None = None  # the oldest driver that loads it, as cuDriverGetVersion reports (13000)
    symbols: tuple[str, ...] = field(init=False, repr=False, compare=False)  # entries' keys, in order

    def __post_init__(self) -> None:
        # Freeze the mappings so a spec shared between threads cannot change under a loader.
        specs = dict(self.entry_specs)
        for symbol, types in self.entries.items():
            specs.setdefault(symbol, EntrySpec(symbol, symbol, tuple(types), None, None))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "entries", MappingProxyType({s: e.types for s, e in specs.items()}))
        object.__setattr__(self, "entry_specs", MappingProxyType(specs))
        object.__setattr__(self, "symbols", tuple(specs))
        object.__setattr__(self, "_names", _by_either_name(specs))

    @classmethod
    def _checked(cls, obj: dict[str, Any], launches: dict[str, LaunchGeometry], whole: bool = False) -> KernelSpec:
        """What ``__init__`` builds, from a kernel object the manifest's fast path checked. Only what a
        load reads (the id, arch, digest, size, symbols and toolkit facts) is filled here, unless
        ``whole``; the rest (``_LAZY``) is filled from the object at its first use, each launch geometry
        once per manifest (``launches``).

        The object is the manifest's private parse, so its dicts are wrapped, not copied. A process's
        first call of each kernel builds its spec between driver calls that leave the CPU's caches
        cold: each field read and each object made here is a cache miss (issue 31; one dict literal,
        not ``__dict__.update``: 0.7 us less a spec on an H100 host). A walk of every kernel (``ls``,
        ``verify``) reads their family, params, target and entries: ``whole`` fills those now, not by
        a call each (three times the walk's time at 23,000 kernels).
        """
        spec = object.__new__(cls)
        table = obj["entries"]
        fields = {
            "id": obj["id"], "arch": obj["arch"], "digest": _checked_digest(obj["digest"]), "size": obj["size"],
            "symbols": tuple(table), "toolkit": obj.get("toolkit"), "min_driver": obj.get("min_driver"),
            "_from": (obj, launches),
        }
        if whole:
            fields["family"] = obj["family"]
            fields["params"] = MappingProxyType(obj["params"])
            fields["entries"] = _entry_types(table)
            fields["target"] = obj["target"]
        _set(spec, "__dict__", fields)
        return spec

    def __getattr__(self, name: str) -> Any:
        # Only for what the instance lacks: a fast-path spec's _LAZY fields, filled at their first use
        # (threads that race fill equal values; the first one filled is kept).
        source = self.__dict__.get("_from") if name in _LAZY else None
        if source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        obj, launches = source
        fields = self.__dict__
        if name == "entry_specs" or name == "_names":
            specs = _entry_specs(obj["entries"], launches, self.entries)
            # One pair, so the names ``entry`` resolves are the very entry specs, whichever thread won.
            built = fields.setdefault("_entries_built", (MappingProxyType(specs), _by_either_name(specs)))
            fields.setdefault("entry_specs", built[0])
            fields.setdefault("_names", built[1])
            return fields[name]
        if name == "entries":
            value: Any = _entry_types(obj["entries"])
        else:
            value = MappingProxyType(obj["params"]) if name == "params" else obj[name]
        return fields.setdefault(name, value)

    @functools.cached_property
    def _key(self) -> tuple[Any, ...]:
        # Computed on first comparison only: opening a manifest of many kernels never needs it.
        return (self.id, self.family, tuple(sorted(self.params.items())), self.arch, self.digest, self.size,
                tuple(sorted((s, repr(e.to_json())) for s, e in self.entry_specs.items())), self.target,
                self.toolkit, self.min_driver)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelSpec) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def compute_capability(self) -> ComputeCapability:
        """The oldest GPU it is built for (PTX: the one its ``.target`` names)."""
        return layout_arch(self.arch).compute_capability

    @property
    def is_ptx(self) -> bool:
        """Whether the blob is PTX text (arch ``compute_...``), which the driver compiles at load."""
        return is_ptx(self.arch)

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
            out["offsets"] = list(_abi.param_layout(types, layout_arch(self.arch)))
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest (v2) JSON object of this kernel."""
        out: dict[str, Any] = {
            "id": self.id,
            "family": self.family,
            "params": dict(self.params),
            "arch": self.arch,
            "digest": str(self.digest),
            "size": self.size,
            "entries": {s: self._entry_json(e) for s, e in self.entry_specs.items()},
            "target": self.target,
        }
        if self.toolkit is not None:
            out["toolkit"] = self.toolkit
        if self.min_driver is not None:
            out["min_driver"] = self.min_driver
        return out
