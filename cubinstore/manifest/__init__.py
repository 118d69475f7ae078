"""The kernel manifest (schemas ``cubinstore/manifest/v2``, and ``v1`` read only): parsing,
validation, lookup, arch selection.

A manifest is untrusted input until ``Manifest.from_bytes`` has validated every field; after
that its ``KernelSpec`` values are frozen and safe to use. The facts it is checked against
(parameter types, the layout rule, the arch grammar, ids, limits) live in ``cubinstore._core.abi``.

The package, top down (imports point down only; pyproject.toml's ``manifest`` contract):
``Manifest`` here; ``index`` (lookups, arch selection); ``fast`` (the fast path for canonical
documents, which only ever accepts); ``schema`` (the schema and the full checker, which decides
everything else and words every error); ``spec`` (``KernelSpec``, ``EntrySpec``); ``family``
(a family's JIT template) over ``flags`` (its allow-list).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from cubinstore._core.abi import MAX_POINT_PARAMS  # noqa: F401 - importable from here, as before the split
from cubinstore._core.abi import MAX_BLOB_SIZE, MAX_MANIFEST_BYTES, dumps_canonical, kernel_id
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, ManifestError
from cubinstore.manifest import schema as _schema
from cubinstore.manifest.fast import check as _fast_index
from cubinstore.manifest.index import AGE_AFTER_BYTES as _AGE_AFTER_BYTES
from cubinstore.manifest.index import Index as _Index
from cubinstore.manifest.index import age_young_objects as _age_young_objects
from cubinstore.manifest.index import arch_compatible, parse_arch
from cubinstore.manifest.schema import FAMILIES_KEY as _FAMILIES_KEY
from cubinstore.manifest.schema import PARAM_TYPES, SCHEMA, SCHEMA_V1
from cubinstore.manifest.schema import Checker as _Checker
from cubinstore.manifest.schema import upgrade_v1_entries as _upgrade_v1_entries
from cubinstore.manifest.spec import ComputeCapability, EntrySpec, KernelSpec, ParamValue

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


def __getattr__(name: str) -> Any:
    # ``order_steps`` is schema's counter, which its checker rebinds: read it there on each access.
    if name == "order_steps":
        return _schema.order_steps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, source: str = "<bytes>",
                   fast: bool = True) -> Manifest:
        """Parse and validate manifest bytes; ``source`` (path, digest, URL) is named in errors.

        ``fast=False`` skips the fast path (``fast.py``): the full checker alone decides, as tests
        that hold the two paths to the same answers need; the result is the same either way."""
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
            if fast:
                try:
                    objs, by_id, by_stem, orders, templates = _fast_index(text)
                except Exception:  # noqa: BLE001 - any doubt: the full checker decides and words the error
                    pass
                else:
                    digest = Digest.of(raw)
                    index = _Index(objs, None, by_id, by_stem, orders, source=source, digest=digest)
                    return cls(raw=raw, digest=digest, source=source, schema=SCHEMA, _index=index,
                               jit_templates=MappingProxyType(templates))
            schema, specs, by_id, by_stem, templates = _schema.check(text, source)
            digest = Digest.of(raw)
            index = _Index(None, specs, by_id, by_stem, {}, source=source, digest=digest)
            return cls(raw=raw, digest=digest, source=source, schema=schema, _index=index,
                       jit_templates=MappingProxyType(templates))
        finally:
            if collecting:
                if len(raw) >= _AGE_AFTER_BYTES:
                    _age_young_objects()
                gc.enable()

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

    def by_id(self, kernel_id: str) -> KernelSpec:
        """The kernel whose id is ``kernel_id``."""
        return self._index.lookup(kernel_id)

    def find(self, family: str, **params: ParamValue) -> list[KernelSpec]:
        """Kernels of ``family`` whose params include every given ``key=value``, all archs, sorted by id."""
        return self._index.find(family, params)

    def select(self, family_or_id: str, compute_capability: ComputeCapability, **params: ParamValue) -> KernelSpec:
        """The kernel to load on a GPU of ``compute_capability``.

        ``family_or_id`` is a full id, an id without its arch (``axpy/f32/vec4``), or a family
        narrowed by ``params``. Among compatible CUBINs the exact arch wins (``sm_90a`` before
        ``sm_90`` on 9.0), then the highest minor not above the GPU's.
        """
        return self._index.select(family_or_id, compute_capability, params)

    @property
    def selector(self) -> Callable[[str, ComputeCapability, Mapping[str, ParamValue]], KernelSpec]:
        """``select`` itself, its ``params`` as one mapping: for a caller that selects on every first load
        (``Library.kernel``), which then pays no call of this class's wrapper (issue 31)."""
        return self._index.select
