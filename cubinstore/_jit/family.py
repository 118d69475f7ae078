"""Missing points of a manifest family, compiled at run time from the release's own sources.

A family that allows it carries a JIT template (``FamilyTemplate``, JSON schema
``cubinstore/jit-family/v1``, defined and validated in ``cubinstore.manifest.family``): its TU
(a template with ``{param}`` placeholders, rendered the way ``cubin_tu`` renders it), a source
bundle holding the TU and every header of the family (one JSON blob in the CAS, fetched and
verified by its sha256), the defines and copts with placeholders, the external include roots it
needs (``cutlass``), the entries and the archs. This module is the compile side:
``compile_family_point`` renders one point, compiles it through ``cubinstore._jit.compiler``
(same content key, index, single flight and warm set) and returns the ``KernelSpec`` the
manifest would have had, so ``Library.kernel`` can load it like any other.

A template and its bundle are data from a release: ``FamilyTemplate.from_json`` (at manifest
open) admits only the copts and defines of ``cubinstore.manifest.flags``'s allow-list, real archs
and parameter types; the filled flags are checked again before each compile; the compile is
sealed (a file read outside the bundle, the include roots, the toolkit and the host compiler's
system headers fails it); and the materialised sources are compared with the verified bundle
before use, so an edited or added file under ``v1/jit/sources/`` is never compiled.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from cubinstore._core import knobs as _env
from cubinstore._core.abi import REL_PATH_RE, WORD_RE, Arch, dumps_canonical, kernel_id, loads_strict, render_param
from cubinstore._core.digest import Digest
from cubinstore._core.text import show
from cubinstore._core.log import get_logger
from cubinstore._jit.explain import nearest_points
from cubinstore.errors import BadArgumentError, CubinstoreError, KernelNotFoundError, ManifestError, StoreError
from cubinstore.manifest import KernelSpec
from cubinstore.manifest.family import EXTERNAL_ROOTS, TEMPLATE_SCHEMA, FamilyTemplate
from cubinstore.manifest.flags import copt_problem, define_problem
from cubinstore.manifest.toolkit import facts as toolkit_facts

if TYPE_CHECKING:
    from cubinstore._jit.compiler import Compiled
    from cubinstore.store import Store

# FamilyTemplate, TEMPLATE_SCHEMA and EXTERNAL_ROOTS are re-exported: their home is cubinstore.manifest.family.
__all__ = ["EXTERNAL_ROOTS", "SOURCES_SCHEMA", "TEMPLATE_SCHEMA", "FamilyTemplate", "compile_family_point",
           "compile_point", "cutlass_include", "make_bundle", "resolve_miss", "template_for_sources"]

_log = get_logger(__name__)

SOURCES_SCHEMA: Final = "cubinstore/jit-sources/v1"
_MAX_DEPTH: Final = 32


def make_bundle(files: Mapping[str, bytes | str]) -> bytes:
    """The sources blob of a family: canonical JSON of relative path -> UTF-8 text."""
    out: dict[str, str] = {}
    for rel, data in files.items():
        if not REL_PATH_RE.fullmatch(rel):
            raise BadArgumentError(f"source bundle: {show(rel)} is not a plain relative path")
        out[rel] = data.decode("utf-8") if isinstance(data, bytes) else data
    return dumps_canonical({"schema": SOURCES_SCHEMA, "files": out})


def _bundle_files(raw: bytes, where: str) -> dict[str, bytes]:
    """The bundle's files, relative path -> UTF-8 bytes, each path a plain relative name."""
    doc = loads_strict(raw, where, ManifestError)
    if not isinstance(doc, dict) or doc.get("schema") != SOURCES_SCHEMA or not isinstance(doc.get("files"), dict):
        raise ManifestError(f"{where}: expected a {SOURCES_SCHEMA!r} object")
    files: dict[str, bytes] = {}
    for rel, text in doc["files"].items():
        # Paths become files under the store: no absolute path, no '..', nothing but plain names.
        if not isinstance(rel, str) or not REL_PATH_RE.fullmatch(rel) or ".." in rel.split("/") or not isinstance(text, str):
            raise ManifestError(f"{where}: file {show(rel)}: expected a plain relative path and text")
        try:
            files[rel] = text.encode("utf-8")
        except UnicodeEncodeError:
            raise ManifestError(f"{where}: file {show(rel)}: expected UTF-8 text, got a lone surrogate") from None
    clash = sorted(_dirs_of(files) & files.keys())
    if clash:
        raise ManifestError(f"{where}: {show(clash[0])} is both a file and a directory of the bundle")
    return files


def _dirs_of(files: Mapping[str, bytes]) -> set[str]:
    return {rel.rsplit("/", i)[0] for rel in files for i in range(1, rel.count("/") + 1)}


_COMPLETE: Final = ".complete"  # written last: the tree was written whole once
# (store's sources dir, bundle hex) -> (the tree's signature when it last held exactly the bundle,
# the bundle's verified files). Bounded: a process compiles a few families.
_checked: dict[tuple[str, str], tuple[tuple[tuple[Any, ...], ...], dict[str, bytes]]] = {}
_checked_lock = threading.Lock()
_MAX_CHECKED: Final = 8


def _materialize(store: Store, template: FamilyTemplate) -> tuple[Path, dict[str, bytes], bool]:
    """The bundle's files under ``<store>/v1/jit/sources/<hex>/``, their verified bytes, and
    whether a tree found complete had to be repaired.

    Files go through the local store's descriptor-based API; processes that write the same
    bundle at once write the same bytes, each file atomically. What is on disk is compared with
    the bundle (read through ``store.get``, which verifies its sha256) once per process, and
    again whenever the tree's stat signature changes: a file edited since is rewritten and
    anything the bundle lacks (a header that would shadow an include) is removed.
    """
    local = store.local
    if local is None:
        raise StoreError(f"the JIT needs a local store layer; {store!r} has none")
    base = ("jit", "sources", template.bundle.hex)
    final = Path(local.root) / "v1" / "jit" / "sources" / template.bundle.hex
    where = f"{template.family} JIT sources {template.bundle}"
    cache_key = (str(final), template.bundle.hex)
    with _checked_lock:
        known = _checked.get(cache_key)
    if known is not None and _signature(local, base, known[1]) == known[0]:
        return final, known[1], False
    raw = store.get(template.bundle, template.bundle_size, name=f"{template.family} JIT sources")
    files = _bundle_files(raw, where)
    if template.source not in files:
        raise ManifestError(f"{template.family} JIT template: source {template.source!r} is not in bundle {template.bundle}")
    repaired = _sync(local, base, files, final, where)
    signature = _signature(local, base, files)
    with _checked_lock:
        if len(_checked) >= _MAX_CHECKED and cache_key not in _checked:
            _checked.pop(next(iter(_checked)))
        _checked[cache_key] = (signature, files)
    return final, files, repaired


def _signature(local: Any, base: tuple[str, ...], files: Mapping[str, bytes]) -> tuple[tuple[Any, ...], ...]:
    """Every entry of the tree with what an edit changes (inode, size, mtime, ctime), in the bundle's directories."""
    dirs = _dirs_of(files)
    out: list[tuple[Any, ...]] = []
    pending: list[tuple[str, ...]] = [()]
    while pending:
        parts = pending.pop()
        for name, st in local.list_dir((*base, *parts)):
            rel = "/".join((*parts, name))
            out.append((rel, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            if stat.S_ISDIR(st.st_mode) and rel in dirs:
                pending.append((*parts, name))
    return tuple(sorted(out))


def _sync(local: Any, base: tuple[str, ...], files: Mapping[str, bytes], final: Path, where: str) -> bool:
    """Make ``v1/<base>`` hold exactly ``files``: rewrite what differs, remove what the bundle lacks.

    Returns whether a tree that was complete had to change (edited, or a file added)."""
    from cubinstore.store.local.root import TEMP_PREFIX  # the store package: only once a bundle is written

    expected = {**files, _COMPLETE: b""}
    dirs = _dirs_of(files)
    good: set[str] = set()
    removed = False
    pending: list[tuple[str, ...]] = [()]
    while pending:
        parts = pending.pop()
        for name, st in local.list_dir((*base, *parts)):
            rel = "/".join((*parts, name))
            if stat.S_ISDIR(st.st_mode) and rel in dirs:
                pending.append((*parts, name))
            elif stat.S_ISREG(st.st_mode) and rel in expected:
                if _reads_as(local, (*base, *parts), name, expected[rel]):
                    good.add(rel)
            elif stat.S_ISREG(st.st_mode) and name.startswith(TEMP_PREFIX):
                continue  # a concurrent writer's temp file (no include can name it), renamed soon
            else:
                _log.warning("%s: removing %s from the materialised sources: the bundle has no such file", where, final / rel)
                _remove(local, (*base, *parts), name, st, final / rel)
                removed = True
    stale = [rel for rel in files if rel not in good]
    if stale and _COMPLETE in good:
        _log.warning("%s: %d materialised file(s) differ from the bundle (%s); rewriting them",
                     where, len(stale), ", ".join(stale[:3]) + (" ..." if len(stale) > 3 else ""))
    for rel in stale:
        *dirs_, name = rel.split("/")
        local.write_file((*base, *dirs_), name, files[rel], durable=False)
    if _COMPLETE not in good:
        local.write_file(base, _COMPLETE, b"")
    return _COMPLETE in good and (removed or bool(stale))


def _reads_as(local: Any, parts: tuple[str, ...], name: str, want: bytes) -> bool:
    try:
        return local.read_file(parts, name, len(want)) == want
    except (CubinstoreError, OSError):  # a link or a file swapped under us: rewrite it
        return False


def _remove(local: Any, parts: tuple[str, ...], name: str, st: os.stat_result, path: Path, depth: int = 0) -> None:
    """Remove ``v1/<parts>/<name>``: a file or link, or a directory and everything in it (no link followed)."""
    if not stat.S_ISDIR(st.st_mode):
        local.remove_file(parts, name)
        return
    if depth > _MAX_DEPTH:
        raise StoreError(f"cannot remove {path}: nested deeper than {_MAX_DEPTH} directories")
    for child, child_st in local.list_dir((*parts, name)):
        _remove(local, (*parts, name), child, child_st, path / child, depth + 1)
    with local._fs.dir("v1", *parts, check=True) as fd:
        if fd is None:  # gone already (never rmdir relative to the working directory)
            return
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError as exc:
            raise StoreError(f"cannot remove {path}: {exc.strerror or exc}") from exc


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


def _filled_flags(template: FamilyTemplate, params: Mapping[str, str | int]) -> list[str]:
    """The template's copts and ``-D`` defines for one point, each checked again once filled."""
    flags: list[str] = []
    for field, texts, check, prefix in (("copts", template.copts, copt_problem, ""),
                                        ("defines", template.defines, define_problem, "-D")):
        for i, raw in enumerate(texts):
            filled = _fill(raw, params)
            why = check(filled)
            if why is not None:
                asked = " ".join(f"{k}={v!r}" for k, v in params.items())
                raise BadArgumentError(f"{template.family} {asked}: {field}[{i}] {raw!r} filled is not allowed: {why}")
            flags.append(prefix + filled)
    return flags


def compile_family_point(template: FamilyTemplate, params: Mapping[str, str | int], arch: str, *,
                         store: Store | None = None, include_roots: Mapping[str, str | os.PathLike[str]] | None = None,
                         jit: bool | None = None) -> KernelSpec:
    """The ``KernelSpec`` of ``template``'s point ``params`` for ``arch``, compiled now or found compiled.

    ``include_roots`` overrides where external roots are (default: ``cutlass_include()``).
    Raises ``KernelNotFoundError`` when JIT is off and the point is not compiled yet.
    """
    return compile_point(template, params, arch, store=store, include_roots=include_roots, jit=jit)[0]


def compile_point(template: FamilyTemplate, params: Mapping[str, str | int], arch: str, *,
                  store: Store | None = None, include_roots: Mapping[str, str | os.PathLike[str]] | None = None,
                  jit: bool | None = None, direct: bool = True) -> tuple[KernelSpec, Compiled]:
    """``compile_family_point``'s spec and the compiler's ``Compiled`` behind it (how it was found,
    how long the direct check took); ``direct`` as ``compiler.compile``'s (benchmarks compare the two)."""
    try:
        # Imported here, not above: the compiler needs xxhash (the `jit` extra), and a host
        # without it still records a miss and names the nearest points (``resolve_miss``).
        from cubinstore._jit import compiler as _compiler
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
        if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, str) and not WORD_RE.fullmatch(v)):
            raise BadArgumentError(f"{template.family}: parameter {k} must be an int or a word like 'f32', got {show(v)}")
    parsed = Arch.parse(arch)
    if template.archs and str(parsed) not in template.archs:
        raise KernelNotFoundError(
            f"{template.family}: its JIT template compiles for {', '.join(template.archs)}, not {parsed}"
        )
    if store is None:
        store = _compiler.default_store()
    flags = _filled_flags(template, ordered)
    sources, files, repaired = _materialize(store, template)
    if repaired:  # its files changed under this process: what the JIT hashed of them here is stale
        _compiler.clear_caches()
    text = _fill(files[template.source].decode("utf-8"), ordered)
    roots = dict(include_roots or {})
    include_dirs: list[str | os.PathLike[str]] = [sources]
    for name in template.includes:
        include_dirs.append(roots[name] if name in roots else cutlass_include())
    entries = {_fill(e, ordered): tuple(_fill(t, ordered) for t in types) for e, types in (template.entries or {}).items()}
    # Sealed: a file read from outside the bundle, the include roots, the toolkit and the host
    # compiler's system headers fails the compile (an absolute #include, a define naming a host file).
    k = _compiler.compile(text, include_dirs=include_dirs, flags=flags, arch=parsed, entries=entries,
                          family=template.family, params=ordered, store=store, jit=jit, sealed=True, direct=direct)
    rendered = [render_param(key, v) for key, v in ordered.items()]
    target = f"//{template.package}:{'_'.join([template.family, *rendered, str(parsed)])}" if template.package else \
        f"//jit:k{k.key.hex}"
    # The local toolkit that compiled it (its key names the version), as a release's kernel records it.
    spec = KernelSpec(id=kernel_id(template.family, ordered, parsed), family=template.family, params=ordered,
                      arch=str(parsed), digest=k.digest, size=k.size, entries=entries, target=target,
                      **toolkit_facts(k.key.parts.toolkit.get("version")))  # type: ignore[arg-type]
    return spec, k


def resolve_miss(manifest: Any, family: str, params: Mapping[str, str | int], arch: str, *,
                 template: FamilyTemplate | None, store: Store | None = None, jit: bool | None = None) -> KernelSpec:
    """What ``Library.kernel`` does when ``manifest`` has no kernel for a family point.

    Records the miss in the warm set, then compiles the point from ``template`` (the family's
    JIT template, None if it has none) when JIT is on (``jit``, default ``CUBINSTORE_JIT``).
    Otherwise raises ``KernelNotFoundError`` naming the nearest points and why it did not compile.
    """
    # Standard library only up to the compile: a host without the jit extra still records the
    # miss and gets the nearest points. The store package comes in with the first miss, not
    # with ``import cubinstore.launch``.
    from cubinstore._release import warmset as _warmset

    if store is None:
        from cubinstore.store import default_store

        store = default_store()
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
