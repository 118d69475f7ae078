"""A family's JIT template (JSON schema ``cubinstore/jit-family/v1``): what a manifest's
``families.<name>.jit`` holds, and its validation.

A template says how to compile any point of one family: its TU inside a source bundle (a blob
named by sha256), the defines and copts with ``{param}`` placeholders, the external include
roots, the entries and the archs. It is data from a release, so ``FamilyTemplate.from_json``
(run when the manifest is opened) admits only the copts and defines of the allow-list in
``cubinstore.manifest.flags``, real archs and parameter types. The compile side (bundles,
materialising, compiling a point) is ``cubinstore._jit.family``; this module is the schema
alone, so the manifest can check it without importing the compiler. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cubinstore._core.abi import IDENT_RE, REL_PATH_RE, WORD_RE, Arch, param_type, type_grammar
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, ManifestError
from cubinstore.manifest.flags import copt_problem, define_problem

__all__ = ["EXTERNAL_ROOTS", "MAX_BUNDLE_BYTES", "TEMPLATE_SCHEMA", "FamilyTemplate"]

TEMPLATE_SCHEMA: Final = "cubinstore/jit-family/v1"
MAX_BUNDLE_BYTES: Final = 64 * 1024 * 1024
#: The include roots a template may name (``tools/private/rules/cubin_jit_template.bzl`` mirrors them).
EXTERNAL_ROOTS: Final = ("cutlass",)


@dataclass(frozen=True)
class FamilyTemplate:
    """How to compile any point of one family (what a manifest's ``families.<name>.jit`` holds)."""

    family: str
    grid_keys: tuple[str, ...]  # parameter names in id order
    source: str  # the TU (template) inside the bundle, e.g. "kernels/gemm/sm90_bf16_gemm.cu"
    bundle: Digest  # the sources blob (``cubinstore._jit.family.SOURCES_SCHEMA``)
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
        if not isinstance(family, str) or not WORD_RE.fullmatch(family):
            raise fail("family", f"expected a name like 'gemm', got {show(family)}")
        keys = doc.get("grid_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) and IDENT_RE.fullmatch(k) for k in keys):
            raise fail("grid_keys", f"expected a list of identifiers, got {show(keys)}")
        if len(set(keys)) != len(keys):
            raise fail("grid_keys", f"expected distinct names, got {show(keys)}")
        source = doc.get("source")
        if not isinstance(source, str) or not REL_PATH_RE.fullmatch(source):
            raise fail("source", f"expected a relative path inside the bundle, got {show(source)}")
        bundle = doc.get("bundle")
        if not isinstance(bundle, Mapping):
            raise fail("bundle", f"expected {{digest, size}}, got {show(bundle)}")
        try:
            digest = Digest.parse(bundle.get("digest"))
        except BadArgumentError as exc:
            raise fail("bundle.digest", str(exc)) from None
        size = bundle.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BUNDLE_BYTES:
            raise fail("bundle.size", f"expected 1..{MAX_BUNDLE_BYTES} bytes, got {show(size)}")
        lists = {}
        for name in ("defines", "copts", "includes", "archs"):
            value = doc.get(name, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise fail(name, f"expected a list of strings, got {show(value)}")
            lists[name] = tuple(value)
        for root in lists["includes"]:
            if root not in EXTERNAL_ROOTS:
                raise fail("includes", f"unknown include root {root!r}; known: {', '.join(EXTERNAL_ROOTS)}")
        # A template is data: what reaches nvcc is checked against the allow-list here, at open.
        for i, copt in enumerate(lists["copts"]):
            why = copt_problem(copt, keys)
            if why is not None:
                raise fail(f"copts[{i}]", why)
        for i, define in enumerate(lists["defines"]):
            why = define_problem(define, keys)
            if why is not None:
                raise fail(f"defines[{i}]", why)
        for i, arch in enumerate(lists["archs"]):
            try:
                Arch.parse(arch)
            except BadArgumentError as exc:
                raise fail(f"archs[{i}]", str(exc)) from None
        entries = doc.get("entries")
        if not isinstance(entries, Mapping) or not entries or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v) for k, v in entries.items()):
            raise fail("entries", f"expected a non-empty object of symbol -> parameter types, got {show(entries)}")
        for name, types in entries.items():
            why = _entry_problem(name, types, keys)
            if why is not None:
                raise fail(f"entries[{name!r}]{why[0]}", why[1])
        package = doc.get("package", "")
        if not isinstance(package, str) or (package and not REL_PATH_RE.fullmatch(package)):
            raise fail("package", f"expected a Bazel package like 'kernels/gemm', got {show(package)}")
        return cls(family, tuple(keys), source, digest, size, lists["defines"], lists["copts"], lists["includes"],
                   {k: tuple(v) for k, v in entries.items()}, lists["archs"], package)


def _entry_problem(name: str, types: Sequence[str], keys: Sequence[str]) -> tuple[str, str] | None:
    """(where, why) when an entry is not a symbol with parameter types; None when it is.

    A type is a parameter type (``_abi.param_type``) or one whole placeholder (``{dtype}``),
    filled with the point's value and checked again at compile time."""
    standin = name
    for k in keys:
        standin = standin.replace("{" + k + "}", "x")
    if not IDENT_RE.fullmatch(standin):
        return "", f"expected a symbol (a C identifier, placeholders allowed), got {show(name)}"
    placeholders = {"{" + k + "}" for k in keys}
    for i, t in enumerate(types):
        if t in placeholders:
            continue
        try:
            param_type(t)
        except BadArgumentError:
            spelled = f" or a placeholder ({', '.join(sorted(placeholders))})" if placeholders else ""
            return f"[{i}]", f"expected one of {type_grammar()}{spelled}, got {show(t)}"
    return None
