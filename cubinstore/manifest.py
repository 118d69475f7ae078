"""The kernel manifest (schema ``cubinstore/manifest/v1``): parsing, validation, lookup, arch selection.

A manifest is untrusted input until ``Manifest.from_bytes`` has validated every
field; after that its ``KernelSpec`` values are frozen and safe to use.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from cubinstore._digest import Digest, show
from cubinstore.errors import (
    BadArgumentError,
    IncompatibleArchError,
    KernelNotFoundError,
    ManifestError,
)

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = [
    "MAX_BLOB_SIZE",
    "MAX_MANIFEST_BYTES",
    "PARAM_TYPES",
    "SCHEMA",
    "KernelSpec",
    "Manifest",
    "arch_compatible",
    "dumps_canonical",
    "kernel_id",
    "parse_arch",
]

_log = logging.getLogger(__name__)

SCHEMA = "cubinstore/manifest/v1"
PARAM_TYPES = frozenset({"i32", "u32", "i64", "u64", "f32", "f64", "ptr", "tensormap"})
# Bounds so a hostile manifest cannot make us allocate without limit.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_BLOB_SIZE = 1024 * 1024 * 1024

_TOP_KEYS = frozenset({"schema", "kernels"})
_KERNEL_KEYS = frozenset({"id", "family", "params", "arch", "digest", "size", "entries", "target"})
_ARCH_RE = re.compile(r"sm_([1-9][0-9]{1,2})(a?)", re.ASCII)
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# Family names and string parameter values become id segments: no '/', no spaces.
_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", re.ASCII)
_LABEL_RE = re.compile(r"//[A-Za-z0-9_.+/-]*(?::[A-Za-z0-9_.+/=,@~-]+)?", re.ASCII)

ParamValue = str | int
ComputeCapability = tuple[int, int]


def parse_arch(arch: object) -> tuple[int, int, bool]:
    """``"sm_90a"`` -> ``(9, 0, True)``; ``"sm_100"`` -> ``(10, 0, False)``."""
    match = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if match is None:
        raise BadArgumentError(f"invalid arch {show(arch)}: expected 'sm_<major><minor>' with optional 'a', e.g. 'sm_90a'")
    digits, specific = match.groups()
    return int(digits[:-1]), int(digits[-1]), specific == "a"


def _check_cc(cc: object) -> ComputeCapability:
    if (
        not isinstance(cc, tuple)
        or len(cc) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)
    ):
        raise BadArgumentError(f"invalid compute capability {show(cc)}: expected a tuple (major, minor) of non-negative ints")
    return cc


def arch_compatible(arch: str, cc: ComputeCapability) -> bool:
    """Whether a CUBIN built for ``arch`` loads on a GPU of compute capability ``cc``.

    ``sm_XYa`` (arch-specific features, e.g. wgmma) runs only on X.Y exactly;
    ``sm_XY`` runs on major X with minor >= Y. CUBINs never cross a major version.
    """
    major, minor, specific = parse_arch(arch)
    cc = _check_cc(cc)
    if specific:
        return (major, minor) == cc
    return major == cc[0] and cc[1] >= minor


def _render_param(key: str, value: ParamValue) -> str:
    return value if isinstance(value, str) else f"{key}{value}"


def kernel_id(family: str, params: Mapping[str, ParamValue], arch: str) -> str:
    """``<family>/<param values in the mapping's (grid) order>/<arch>``; an int renders as ``<key><value>``."""
    return "/".join([family, *(_render_param(k, v) for k, v in params.items()), arch])


def dumps_canonical(doc: Mapping[str, Any]) -> bytes:
    """Canonical manifest JSON: sorted keys, kernels sorted by id, compact separators, UTF-8, one newline."""
    doc = dict(doc)
    if isinstance(doc.get("kernels"), list):
        doc["kernels"] = sorted(doc["kernels"], key=lambda k: str(k.get("id", "")) if isinstance(k, Mapping) else "")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8") + b"\n"


@dataclass(frozen=True)
class KernelSpec:
    """One CUBIN of a release: what it is, where its bytes are (by digest), how to call its entries."""

    id: str
    family: str
    params: Mapping[str, ParamValue]
    arch: str
    digest: Digest
    size: int
    entries: Mapping[str, tuple[str, ...]]
    target: str
    _key: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Freeze the mappings so a spec shared between threads cannot change under a loader.
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(
            self, "entries", MappingProxyType({k: tuple(v) for k, v in self.entries.items()})
        )
        object.__setattr__(
            self,
            "_key",
            (self.id, self.family, tuple(sorted(self.params.items())), self.arch, self.digest, self.size,
             tuple(sorted(self.entries.items())), self.target),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelSpec) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def compute_capability(self) -> ComputeCapability:
        major, minor, _ = parse_arch(self.arch)
        return major, minor

    def to_json(self) -> dict[str, Any]:
        """The manifest JSON object of this kernel."""
        return {
            "id": self.id,
            "family": self.family,
            "params": dict(self.params),
            "arch": self.arch,
            "digest": str(self.digest),
            "size": self.size,
            "entries": {k: list(v) for k, v in self.entries.items()},
            "target": self.target,
        }


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


class _Checker:
    """Builds ``invalid manifest <source>: <field>: expected X, got Y`` errors."""

    def __init__(self, source: str) -> None:
        self.source = source

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
        if not isinstance(family, str) or not _WORD_RE.fullmatch(family):
            raise self.fail(f"{where}.family", f"expected a name like 'axpy' ([A-Za-z0-9_.+-]), got {show(family)}")

        params = obj["params"]
        if not isinstance(params, dict):
            raise self.fail(f"{where}.params", f"expected an object, got {type(params).__name__}")
        for key, value in params.items():
            if not _IDENT_RE.fullmatch(key):
                raise self.fail(f"{where}.params", f"expected identifier keys, got {show(key)}")
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise self.fail(f"{where}.params.{key}", f"expected a string or an integer, got {show(value)}")
            if isinstance(value, str) and not _WORD_RE.fullmatch(value):
                raise self.fail(f"{where}.params.{key}", f"expected a value like 'f32' ([A-Za-z0-9_.+-]), got {show(value)}")

        arch = obj["arch"]
        try:
            parse_arch(arch)
        except BadArgumentError:
            raise self.fail(f"{where}.arch", f"expected 'sm_<digits>' with optional 'a' (e.g. 'sm_90a'), got {show(arch)}") from None

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
        checked_entries: dict[str, tuple[str, ...]] = {}
        for name, types in entries.items():
            if not _IDENT_RE.fullmatch(name):
                raise self.fail(f"{where}.entries", f"expected C identifiers as entry names, got {show(name)}")
            if not isinstance(types, list):
                raise self.fail(f"{where}.entries.{name}", f"expected a list of parameter types, got {show(types)}")
            for pos, type_ in enumerate(types):
                if not isinstance(type_, str) or type_ not in PARAM_TYPES:
                    raise self.fail(
                        f"{where}.entries.{name}[{pos}]",
                        f"expected one of {' '.join(sorted(PARAM_TYPES))}, got {show(type_)}",
                    )
            checked_entries[name] = tuple(types)

        target = obj["target"]
        if (
            not isinstance(target, str)
            or not _LABEL_RE.fullmatch(target)
            or ".." in target.replace(":", "/").split("/")
        ):
            raise self.fail(f"{where}.target", f"expected a Bazel label like '//pkg:name', got {show(target)}")

        return KernelSpec(
            id=kid, family=family, params=params, arch=arch, digest=digest,
            size=size, entries=checked_entries, target=target,
        )

    def _check_id(self, where: str, kid: str, family: str, params: Mapping[str, ParamValue], arch: str) -> None:
        parts = kid.split("/")
        expected = kernel_id(family, params, arch)
        # Canonical JSON sorts params, so grid order is lost: compare the middle segments as a multiset.
        if (
            len(parts) != len(params) + 2
            or parts[0] != family
            or parts[-1] != arch
            or Counter(parts[1:-1]) != Counter(_render_param(k, v) for k, v in params.items())
        ):
            raise self.fail(where, f"expected '<family>/<param values>/<arch>' consistent with family, params and arch (e.g. {show(expected)}), got {show(kid)}")


@dataclass(frozen=True, eq=False)
class Manifest:
    """A validated manifest. Build one with ``from_path``, ``from_bytes``, ``from_digest`` or ``build``."""

    raw: bytes = field(repr=False)
    digest: Digest
    source: str
    kernels: tuple[KernelSpec, ...] = field(repr=False)
    _by_id: Mapping[str, KernelSpec] = field(repr=False)

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
        try:
            doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
        except _DuplicateKeyError as exc:
            raise check.fail("file", f"duplicate key {show(exc.args[0])}") from None
        except json.JSONDecodeError as exc:
            raise check.fail("file", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except RecursionError:
            raise check.fail("file", "JSON nested too deeply") from None
        except ValueError as exc:  # NaN/Infinity, integers too long to convert
            raise check.fail("file", f"not valid JSON: {exc}") from None
        return cls._from_doc(doc, raw, source)

    @classmethod
    def _from_doc(cls, doc: object, raw: bytes, source: str) -> Manifest:
        check = _Checker(source)
        if not isinstance(doc, dict):
            raise check.fail("top level", f"expected an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - _TOP_KEYS)
        if unknown:
            raise check.fail("top level", f"unknown key {show(unknown[0])}; allowed keys: kernels, schema")
        if doc.get("schema") != SCHEMA:
            raise check.fail("schema", f"expected {SCHEMA!r}, got {show(doc.get('schema'))}")
        kernels = doc.get("kernels")
        if not isinstance(kernels, list) or not kernels:
            raise check.fail("kernels", f"expected a non-empty list, got {show(kernels)}")
        specs = tuple(check.kernel(i, k) for i, k in enumerate(kernels))
        by_id: dict[str, KernelSpec] = {}
        sizes: dict[Digest, tuple[int, str]] = {}
        for i, spec in enumerate(specs):
            if spec.id in by_id:
                raise check.fail(f"kernels[{i}].id", f"duplicate id {show(spec.id)}")
            by_id[spec.id] = spec
            seen = sizes.setdefault(spec.digest, (spec.size, spec.id))
            if seen[0] != spec.size:
                raise check.fail(
                    f"kernels[{i}] (id {show(spec.id)}).size",
                    f"{spec.digest} has size {seen[0]} in kernel {show(seen[1])}, got {spec.size}",
                )
        return cls(raw=raw, digest=Digest.of(raw), source=source, kernels=specs, _by_id=MappingProxyType(by_id))

    @classmethod
    def from_path(cls, path: str | Path) -> Manifest:
        """Read and validate the manifest file at ``path``."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
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
        """A manifest from a path, or from a ``sha256:`` digest through ``store`` (default ``Store.from_env()``)."""
        if isinstance(ref, Digest) or (isinstance(ref, str) and ref.startswith("sha256:")):
            if store is None:
                from cubinstore.store import Store  # the store module imports this one

                store = Store.from_env()
            return cls.from_digest(ref, store)
        if not isinstance(ref, (str, Path)):
            raise BadArgumentError(f"manifest reference: expected a path or 'sha256:<hex>', got {show(ref)}")
        return cls.from_path(ref)

    @classmethod
    def build(cls, kernels: Iterable[KernelSpec | Mapping[str, Any]], *, source: str = "<built>") -> Manifest:
        """Canonical manifest of ``kernels`` (specs or JSON objects), validated like any other."""
        objs = [k.to_json() if isinstance(k, KernelSpec) else dict(k) for k in kernels]
        return cls.from_bytes(dumps_canonical({"schema": SCHEMA, "kernels": objs}), source=source)

    # -- queries --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[KernelSpec]:
        return iter(self.kernels)

    def __len__(self) -> int:
        return len(self.kernels)

    @property
    def archs(self) -> tuple[str, ...]:
        """Distinct archs, sorted."""
        return tuple(sorted({k.arch for k in self.kernels}))

    @property
    def blobs(self) -> tuple[tuple[Digest, int], ...]:
        """The closure: each distinct (digest, size) the kernels need, sorted by digest."""
        return tuple(sorted({(k.digest, k.size) for k in self.kernels}, key=lambda b: b[0].hex))

    def by_id(self, kernel_id: str) -> KernelSpec:
        try:
            return self._by_id[kernel_id]
        except KeyError:
            raise KernelNotFoundError(
                f"no kernel {show(kernel_id)} in manifest {self.source} ({self.digest}); "
                f"it has {len(self.kernels)} kernels of families {', '.join(sorted({k.family for k in self.kernels}))}"
            ) from None

    def find(self, family: str, **params: ParamValue) -> list[KernelSpec]:
        """Kernels of ``family`` whose params include every given ``key=value``, all archs, sorted by id."""
        return sorted(
            (k for k in self.kernels
             if k.family == family and all(key in k.params and k.params[key] == v for key, v in params.items())),
            key=lambda k: k.id,
        )

    def select(self, family_or_id: str, compute_capability: ComputeCapability, **params: ParamValue) -> KernelSpec:
        """The kernel to load on a GPU of ``compute_capability``.

        ``family_or_id`` is a full id, an id without its arch (``axpy/f32/vec4``), or a family
        narrowed by ``params``. Among compatible CUBINs the exact arch wins (``sm_90a`` before
        ``sm_90`` on 9.0), then the highest minor not above the GPU's.
        """
        cc = _check_cc(compute_capability)
        if family_or_id in self._by_id:
            candidates = [self._by_id[family_or_id]]
            if params:
                raise BadArgumentError(f"select({family_or_id!r}): a full kernel id takes no params, got {sorted(params)}")
        else:
            prefix = family_or_id + "/"
            candidates = [k for k in self.kernels if k.id.startswith(prefix) and k.id.count("/") == family_or_id.count("/") + 1]
            if candidates and params:
                candidates = [k for k in candidates if all(k.params.get(p) == v for p, v in params.items())]
            elif not candidates:
                candidates = self.find(family_or_id, **params)
        if not candidates:
            asked = family_or_id + "".join(f" {k}={v!r}" for k, v in sorted(params.items()))
            raise KernelNotFoundError(
                f"no kernel matches {asked} in manifest {self.source} ({self.digest}); "
                f"families: {', '.join(sorted({k.family for k in self.kernels}))}"
            )
        compatible = [k for k in candidates if arch_compatible(k.arch, cc)]
        sm = f"sm_{cc[0]}{cc[1]}"
        if not compatible:
            raise IncompatibleArchError(
                f"no CUBIN of {family_or_id!r} for compute capability {cc[0]}.{cc[1]} ({sm}): "
                f"candidates have {', '.join(sorted({k.arch for k in candidates}))}; "
                f"manifest {self.source} has archs {', '.join(self.archs)}; build the kernels for {sm} or {sm}a"
            )
        variants = {tuple(sorted(k.params.items())) for k in compatible}
        if len(variants) > 1:
            differing = sorted({key for v in variants for key, _ in v if len({dict(w).get(key) for w in variants}) > 1})
            raise BadArgumentError(
                f"select({family_or_id!r}) is ambiguous: {len(variants)} parameter sets match; "
                f"pass {', '.join(differing)}"
            )
        best = max(compatible, key=lambda k: (parse_arch(k.arch)[1], parse_arch(k.arch)[2]))
        _log.debug("selected %s (%s) for compute capability %d.%d", best.id, best.digest, cc[0], cc[1])
        return best
