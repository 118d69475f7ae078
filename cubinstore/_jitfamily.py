"""Missing points of a manifest family, compiled at run time from the release's own sources.

A family that allows it carries a JIT template (``FamilyTemplate``, JSON schema
``cubinstore/jit-family/v1``): its TU (a template with ``{param}`` placeholders, rendered the
way ``cubin_tu`` renders it), a source bundle holding the TU and every header of the family
(one JSON blob in the CAS, fetched and verified by its sha256), the defines and copts with
placeholders, the external include roots it needs (``cutlass``), the entries and the archs.
``compile_family_point`` renders one point, compiles it through ``cubinstore.jit`` (same
content key, index, single flight and warm set) and returns the ``KernelSpec`` the manifest
would have had, so ``Library.kernel`` can load it like any other.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from cubinstore import _env
from cubinstore._abi import Arch, dumps_canonical, kernel_id, render_param
from cubinstore._digest import Digest, show
from cubinstore._log import get_logger
from cubinstore.errors import BadArgumentError, KernelNotFoundError, ManifestError, StoreError

if TYPE_CHECKING:
    from cubinstore.manifest import KernelSpec
    from cubinstore.store import Store

__all__ = ["FamilyTemplate", "SOURCES_SCHEMA", "TEMPLATE_SCHEMA", "compile_family_point", "make_bundle", "resolve_miss"]

_log = get_logger(__name__)

TEMPLATE_SCHEMA: Final = "cubinstore/jit-family/v1"
SOURCES_SCHEMA: Final = "cubinstore/jit-sources/v1"
_REL_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*", re.ASCII)
_IDENT_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_WORD_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", re.ASCII)
_MAX_BUNDLE: Final = 64 * 1024 * 1024
EXTERNAL_ROOTS: Final = ("cutlass",)


@dataclass(frozen=True)
class FamilyTemplate:
    """How to compile any point of one family (what a manifest's ``families.<name>.jit`` holds)."""

    family: str
    grid_keys: tuple[str, ...]  # parameter names in id order
    source: str  # the TU (template) inside the bundle, e.g. "kernels/gemm/sm90_bf16_gemm.cu"
    bundle: Digest  # the sources blob (SOURCES_SCHEMA)
    bundle_size: int
    defines: tuple[str, ...] = ()  # without -D; placeholders filled per point
    copts: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()  # external include roots, from EXTERNAL_ROOTS
    entries: Mapping[str, tuple[str, ...]] = None  # type: ignore[assignment]  # symbol -> types, placeholders filled
    archs: tuple[str, ...] = ()
    package: str = ""  # Bazel package of the family, for the spec's target label

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": TEMPLATE_SCHEMA, "family": self.family, "grid_keys": list(self.grid_keys),
            "source": self.source, "bundle": {"digest": str(self.bundle), "size": self.bundle_size},
            "defines": list(self.defines), "copts": list(self.copts), "includes": list(self.includes),
            "entries": {k: list(v) for k, v in (self.entries or {}).items()}, "archs": list(self.archs),
            "package": self.package,
        }

    @classmethod
    def from_json(cls, doc: object, where: str = "jit template") -> FamilyTemplate:
        """Validate an untrusted template; ``ManifestError`` names the field."""
        def fail(field: str, why: str) -> ManifestError:
            return ManifestError(f"{where}: {field}: {why}")

        if not isinstance(doc, Mapping) or doc.get("schema") != TEMPLATE_SCHEMA:
            raise fail("schema", f"expected {TEMPLATE_SCHEMA!r}, got {show(doc.get('schema') if isinstance(doc, Mapping) else doc)}")
        family = doc.get("family")
        if not isinstance(family, str) or not _WORD_RE.fullmatch(family):
            raise fail("family", f"expected a name like 'gemm', got {show(family)}")
        keys = doc.get("grid_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) and _IDENT_RE.fullmatch(k) for k in keys):
            raise fail("grid_keys", f"expected a list of identifiers, got {show(keys)}")
        source = doc.get("source")
        if not isinstance(source, str) or not _REL_RE.fullmatch(source):
            raise fail("source", f"expected a relative path inside the bundle, got {show(source)}")
        bundle = doc.get("bundle")
        if not isinstance(bundle, Mapping):
            raise fail("bundle", f"expected {{digest, size}}, got {show(bundle)}")
        try:
            digest = Digest.parse(bundle.get("digest"))
        except BadArgumentError as exc:
            raise fail("bundle.digest", str(exc)) from None
        size = bundle.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= _MAX_BUNDLE:
            raise fail("bundle.size", f"expected 1..{_MAX_BUNDLE} bytes, got {show(size)}")
        lists = {}
        for name in ("defines", "copts", "includes", "archs"):
            value = doc.get(name, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise fail(name, f"expected a list of strings, got {show(value)}")
            lists[name] = tuple(value)
        for root in lists["includes"]:
            if root not in EXTERNAL_ROOTS:
                raise fail("includes", f"unknown include root {root!r}; known: {', '.join(EXTERNAL_ROOTS)}")
        for arch in lists["archs"]:
            Arch.parse(arch)
        entries = doc.get("entries")
        if not isinstance(entries, Mapping) or not entries or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v) for k, v in entries.items()):
            raise fail("entries", f"expected a non-empty object of symbol -> parameter types, got {show(entries)}")
        package = doc.get("package", "")
        if not isinstance(package, str) or (package and not _REL_RE.fullmatch(package)):
            raise fail("package", f"expected a Bazel package like 'kernels/gemm', got {show(package)}")
        return cls(family, tuple(keys), source, digest, size, lists["defines"], lists["copts"], lists["includes"],
                   {k: tuple(v) for k, v in entries.items()}, lists["archs"], package)


def make_bundle(files: Mapping[str, bytes | str]) -> bytes:
    """The sources blob of a family: canonical JSON of relative path -> UTF-8 text."""
    out: dict[str, str] = {}
    for rel, data in files.items():
        if not _REL_RE.fullmatch(rel):
            raise BadArgumentError(f"source bundle: {show(rel)} is not a plain relative path")
        out[rel] = data.decode("utf-8") if isinstance(data, bytes) else data
    return dumps_canonical({"schema": SOURCES_SCHEMA, "files": out})


def _bundle_files(raw: bytes, where: str) -> dict[str, str]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{where}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SOURCES_SCHEMA or not isinstance(doc.get("files"), dict):
        raise ManifestError(f"{where}: expected a {SOURCES_SCHEMA!r} object")
    files = doc["files"]
    for rel, text in files.items():
        # Paths become files under the store: no absolute path, no '..', nothing but plain names.
        if not isinstance(rel, str) or not _REL_RE.fullmatch(rel) or ".." in rel.split("/") or not isinstance(text, str):
            raise ManifestError(f"{where}: file {show(rel)}: expected a plain relative path and text")
    return files


def _materialize(store: Store, template: FamilyTemplate) -> Path:
    """The bundle's files under ``<store>/v1/jit/sources/<hex>/``; ``.complete`` is written last.

    Files go through the local store's descriptor-based API; processes that write the same
    bundle at once write the same bytes, each file atomically.
    """
    local = store.local
    if local is None:
        raise StoreError(f"the JIT needs a local store layer; {store!r} has none")
    base = ("jit", "sources", template.bundle.hex)
    final = Path(local.root) / "v1" / "jit" / "sources" / template.bundle.hex
    try:
        if local.read_file(base, ".complete", 0) is not None:
            return final
    except Exception:  # noqa: BLE001 - a link or damage there: write it again (or fail safely)
        pass
    raw = store.get(template.bundle, template.bundle_size, name=f"{template.family} JIT sources")
    files = _bundle_files(raw, f"{template.family} JIT sources {template.bundle}")
    if template.source not in files:
        raise ManifestError(f"{template.family} JIT template: source {template.source!r} is not in bundle {template.bundle}")
    for rel, text in files.items():
        *dirs, name = rel.split("/")
        local.write_file((*base, *dirs), name, text.encode("utf-8"), durable=False)
    local.write_file(base, ".complete", b"")
    return final


def _has_cutlass_headers(root: Path) -> bool:
    return (root / "cute" / "tensor.hpp").is_file() and (root / "cutlass" / "version.h").is_file()


def cutlass_include() -> Path:
    """The CUTLASS/CuTe include root, in ``third_party/cutlass/cutlass_headers.bzl``'s order (Starlark
    cannot import this): $CUBINSTORE_CUTLASS_INCLUDE, which must hold the headers, else the
    ``nvidia-cutlass`` wheel this Python sees. The one Python lookup (tests, benchmarks and
    tools/stage_device.sh call it); ``BadArgumentError`` names what was tried."""
    configured = _env.cutlass_include()
    if configured is not None:
        if _has_cutlass_headers(configured):
            return configured
        raise BadArgumentError(
            f"$CUBINSTORE_CUTLASS_INCLUDE={str(configured)!r} holds no cute/tensor.hpp and cutlass/version.h"
        )
    tried = ["$CUBINSTORE_CUTLASS_INCLUDE (unset)"]
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
        if _has_cutlass_headers(candidate):
            return candidate
        tried.append(f"{candidate} (the nvidia-cutlass wheel, no cute/tensor.hpp and cutlass/version.h)")
    else:
        tried.append("the nvidia-cutlass wheel (cutlass_library not installed)")
    raise BadArgumentError(
        f"CUTLASS headers not found. Tried, in order: {'; '.join(tried)}. "
        "Install nvidia-cutlass==4.2.0.0 or set CUBINSTORE_CUTLASS_INCLUDE."
    )


def _fill(text: str, params: Mapping[str, str | int]) -> str:
    for k, v in params.items():
        text = text.replace("{" + k + "}", str(v))
    return text


def compile_family_point(template: FamilyTemplate, params: Mapping[str, str | int], arch: str, *,
                         store: Store | None = None, include_roots: Mapping[str, str | os.PathLike[str]] | None = None,
                         jit: bool | None = None) -> KernelSpec:
    """The ``KernelSpec`` of ``template``'s point ``params`` for ``arch``, compiled now or found compiled.

    ``include_roots`` overrides where external roots are (default: ``cutlass_include()``).
    Raises ``KernelNotFoundError`` when JIT is off and the point is not compiled yet.
    """
    from cubinstore.manifest import KernelSpec

    try:
        from cubinstore import jit as _jit
    except ImportError as exc:  # xxhash: the `jit` extra
        raise KernelNotFoundError(
            f"{template.family} {dict(params)} {arch}: compiling it at run time needs the jit extra "
            f"(pip install 'cubinstore[jit]'): {exc}"
        ) from exc
    if set(params) != set(template.grid_keys):
        raise BadArgumentError(
            f"{template.family}: expected parameters {', '.join(template.grid_keys)}, got {', '.join(sorted(params)) or 'none'}"
        )
    ordered = {k: params[k] for k in template.grid_keys}
    for k, v in ordered.items():
        if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, str) and not _WORD_RE.fullmatch(v)):
            raise BadArgumentError(f"{template.family}: parameter {k} must be an int or a word like 'f32', got {show(v)}")
    parsed = Arch.parse(arch)
    if template.archs and str(parsed) not in template.archs:
        raise KernelNotFoundError(
            f"{template.family}: its JIT template compiles for {', '.join(template.archs)}, not {parsed}"
        )
    if store is None:
        store = _jit._default_store()
    sources = _materialize(store, template)
    text = _fill((sources / template.source).read_text(encoding="utf-8"), ordered)
    roots = dict(include_roots or {})
    include_dirs: list[str | os.PathLike[str]] = [sources]
    for name in template.includes:
        include_dirs.append(roots[name] if name in roots else cutlass_include())
    flags = [*(_fill(c, ordered) for c in template.copts), *("-D" + _fill(d, ordered) for d in template.defines)]
    entries = {_fill(e, ordered): tuple(_fill(t, ordered) for t in types) for e, types in (template.entries or {}).items()}
    k = _jit.compile(text, include_dirs=include_dirs, flags=flags, arch=parsed, entries=entries,
                     family=template.family, params=ordered, store=store, jit=jit)
    rendered = [render_param(key, v) for key, v in ordered.items()]
    target = f"//{template.package}:{'_'.join([template.family, *rendered, str(parsed)])}" if template.package else \
        f"//jit:k{k.key.hex}"
    return KernelSpec(id=kernel_id(template.family, ordered, parsed), family=template.family, params=ordered,
                      arch=str(parsed), digest=k.digest, size=k.size, entries=entries, target=target)


def resolve_miss(manifest: Any, family: str, params: Mapping[str, str | int], arch: str, *,
                 template: FamilyTemplate | None, store: Store | None = None, jit: bool | None = None) -> KernelSpec:
    """What ``Library.kernel`` does when ``manifest`` has no kernel for a family point.

    Records the miss in the warm set, then compiles the point from ``template`` (the family's
    JIT template, None if it has none) when JIT is on (``jit``, default ``CUBINSTORE_JIT``).
    Otherwise raises ``KernelNotFoundError`` naming the nearest points and why it did not compile.
    """
    # Standard library only up to the compile: a host without the jit extra still records the
    # miss and gets the nearest points.
    from cubinstore import _warmset
    from cubinstore._explain import nearest_points
    from cubinstore.errors import CubinstoreError

    if store is None:
        from cubinstore.store import Store

        store = Store.from_env()
    if store.local is not None:
        try:
            _warmset.record(store.local, kind="miss", family=family, params=params, arch=str(arch))
        except CubinstoreError as exc:  # the warm set is advice; the caller still gets an answer
            _log.warning("cannot record the miss of %s in the warm set: %s", family, exc)
    enabled = _env.jit() if jit is None else jit
    if template is not None and enabled:
        return compile_family_point(template, params, arch, store=store, jit=True)
    asked = " ".join(f"{k}={v!r}" for k, v in params.items())
    near = "; ".join(f"{k.id} ({', '.join(d)})" for k, d in nearest_points(manifest, family, params, arch, limit=4))
    why = "run-time compilation is off (CUBINSTORE_JIT=0 or jit=False)" if template is not None else \
        f"family {family} has no JIT template"
    raise KernelNotFoundError(
        f"no kernel {family} {asked} {arch} in manifest {manifest.digest}; nearest: {near}; {why}. "
        f"The miss is recorded: `cubinstore warmset export --family {family}` adds it to the next release"
    )


def template_for_sources(family: str, grid_keys: Sequence[str], source: str, files: Mapping[str, bytes | str],
                         store: Store, **fields: Any) -> FamilyTemplate:
    """Put a bundle of ``files`` in ``store``'s local CAS and return the template naming it (tests, tools)."""
    raw = make_bundle(files)
    digest = Digest.of(raw)
    if store.local is None:
        raise StoreError(f"{store!r} has no local layer to keep the source bundle in")
    store.local.write(digest, raw)
    doc = {"schema": TEMPLATE_SCHEMA, "family": family, "grid_keys": list(grid_keys), "source": source,
           "bundle": {"digest": str(digest), "size": len(raw)}, **{k: (dict(v) if isinstance(v, Mapping) else list(v))
                                                                   if not isinstance(v, str) else v for k, v in fields.items()}}
    if "entries" in doc:
        doc["entries"] = {k: list(v) for k, v in doc["entries"].items()}
    return FamilyTemplate.from_json(doc)
