"""The warm-set loop of ``cubinstore-nvcc``: the misses it kept become Bazel targets CI builds
(``export``), and CI publishes what Bazel built under the calls' keys (``publish``).

    DIR/srcs/<sha256 hex>.cu   each call's TU text, by content (from the local CAS)
    DIR/BUILD.bazel            one ``nvcc_cubin`` named ``nvcc_<call key>`` per call, and the
                               filegroup ``cubins`` of them all
    DIR/repositories.bzl       ``nvcc_warmset_repositories()``: one ``pip_package_headers`` per
                               include root, for WORKSPACE (``Exported.module_lines``: MODULE.bazel's)
    DIR/calls.json             per call key: target, arch, TU, flags, roots, and the call record
                               (what publish checks and uploads)

An include root becomes a repository that finds the library where CI installed it: a root
inside ``.../site-packages/<package>/<subdir>`` (or ``dist-packages``) becomes
``pip_package_headers(package, subdir)`` (``third_party/pip``), which asks Python where the
package is. A root anywhere else has no name another host could find it by, so its call is
refused, naming the root (install the headers as a Python package, or let the library's JIT
pass its installed folder). No generated Bazel file holds an absolute path.

Publishing (trusted writers, CI) takes each call's CUBIN from ``bazel-bin``, checks it is an
ELF CUBIN for the call's arch, recomputes the call key with this host's toolchain (so a CUBIN
is never published under the key of a toolkit it was not built with), checks the call record
against the folders the build's repositories linked (every file the record says the compile
read must be what Bazel compiled, every absent place still absent: ``calls.check``), sets the
record's digest and size to Bazel's CUBIN, and uploads (``remote.publish``). A call that does
not check is skipped with the reason, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cubinstore._core.abi import Arch, loads_strict
from cubinstore._core.cubin import CubinImage
from cubinstore._core.digest import Digest
from cubinstore._jit.compiler import SOURCE_NAME
from cubinstore._nvcc import calls, remote, warm
from cubinstore._nvcc.argv import Call, parse
from cubinstore.errors import BadArgumentError, CubinFormatError, CubinstoreError

if TYPE_CHECKING:
    from cubinstore.store import Store

__all__ = ["SCHEMA", "Exported", "PipRoot", "PublishReport", "export", "pip_root", "publish"]

SCHEMA = "cubinstore/nvcc-warmset/v1"  # calls.json
TARGET_GROUP = "cubins"
MAX_CALLS_JSON = 256 << 20
MAX_SOURCE = 64 << 20
MAX_CUBIN = 1 << 30  # calls.record_problem's bound on a record's size
_SITE_DIRS = ("site-packages", "dist-packages")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}", re.ASCII)
_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]{0,254}", re.ASCII)  # never "." or ".."
_KEY = re.compile(r"[0-9a-f]{32}", re.ASCII)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}", re.ASCII)
_REPO = re.compile(r"pip_[A-Za-z0-9_]{1,200}", re.ASCII)
_WORKSPACE_FILES = ("MODULE.bazel", "WORKSPACE", "WORKSPACE.bazel")


# -- include roots ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipRoot:
    """An include root inside an installed Python package: ``<package folder>/<subdir>``."""

    package: str  # the import name, e.g. "deep_gemm"
    subdir: str  # "" (the package's folder) or a relative path, e.g. "include"

    @property
    def repository(self) -> str:
        """The Bazel repository that finds it: ``pip_<package>[_<subdir>]``."""
        tail = re.sub(r"[^A-Za-z0-9_]", "_", self.subdir)
        return f"pip_{self.package}_{tail}" if tail else f"pip_{self.package}"

    def declaration(self) -> str:
        """The repository rule's call (WORKSPACE macro and MODULE.bazel alike)."""
        return f"pip_package_headers(name = {_q(self.repository)}, package = {_q(self.package)}, subdir = {_q(self.subdir)})"


def pip_root(path: str) -> PipRoot | None:
    """The package a root lies in (the last ``site-packages``/``dist-packages`` above it), or None."""
    parts = Path(path).parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in _SITE_DIRS:
            package, rest = parts[i + 1], parts[i + 2:]
            if _IDENT.fullmatch(package) and all(_PART.fullmatch(p) for p in rest):
                return PipRoot(package, "/".join(rest))
            return None
    return None


def _q(text: str) -> str:
    """A Starlark string literal (the text is printable ASCII: checked before it gets here)."""
    return json.dumps(text, ensure_ascii=True)


# -- export ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportedCall:
    """One call as a target: ``nvcc_<call key>`` compiling ``srcs/<source>.cu``."""

    key: str
    arch: str
    source: str  # sha256 hex of the TU text
    flags: tuple[str, ...]  # as the call key covers them: -isystem roots by label, in place
    deps: tuple[PipRoot, ...]  # the -I roots, in order
    system_deps: tuple[PipRoot, ...]  # the -isystem roots, in order
    labels: tuple[str, ...]  # the record's root label of each of deps + system_deps
    record: dict[str, Any]

    @property
    def target(self) -> str:
        return f"nvcc_{self.key}"

    @property
    def copts(self) -> list[str]:
        """The flags without the -isystem roots (``nvcc_cubin`` takes those as ``system_deps``)."""
        return _copts(self.flags)


def _copts(flags: tuple[str, ...] | list[str]) -> list[str]:
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "-isystem":
            i += 2
        else:
            out.append(flags[i])
            i += 1
    return out


@dataclass
class Exported:
    """What ``export`` wrote, and the calls it refused (each message names the call and why)."""

    out: Path
    calls: list[ExportedCall] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    package: str | None = None  # DIR's Bazel package, where DIR lies in a workspace
    rules_repo: str = "@cubinstore"

    @property
    def repositories(self) -> list[PipRoot]:
        found: dict[str, PipRoot] = {}
        for call in self.calls:
            for root in (*call.deps, *call.system_deps):
                found.setdefault(root.repository, root)
        return [found[name] for name in sorted(found)]

    def workspace_lines(self) -> list[str]:
        package = self.package if self.package is not None else "<the package of " + str(self.out) + ">"
        return [f'load("//{package}:repositories.bzl", "nvcc_warmset_repositories")', "", "nvcc_warmset_repositories()"]

    def module_lines(self) -> list[str]:
        rule = f"{self.rules_repo}//third_party/pip:pip_package_headers.bzl"
        return [f'pip_package_headers = use_repo_rule("{rule}", "pip_package_headers")', "",
                *(root.declaration() for root in self.repositories)]


def _flags_problem(arch: str, flags: list[str]) -> str | None:
    """Why ``flags`` (as a call key covers them) are not ones ``cubinstore-nvcc`` caches as they
    are (None: they are). They are read back from a file: every word must be printable ASCII and
    one ``argv``'s allow-list models, unchanged; each ``-isystem`` root is ``{flagpath/<i>}``."""
    if any(not (w.isascii() and w.isprintable()) for w in flags):
        return "a flag holds a character that is not printable ASCII"
    real, n = list(flags), 0
    for i, word in enumerate(flags):
        if word == "-isystem":
            if i + 1 >= len(flags) or flags[i + 1] != f"{{flagpath/{n}}}":
                return f"-isystem #{n} is not followed by {{flagpath/{n}}}"
            real[i + 1] = f"/flagpath/{n}"
            n += 1
    call = parse(["k.cu", "-cubin", "-o", "k.cubin", f"-arch={arch}", *real], "/", [])
    if not isinstance(call, Call):
        return f"not a call cubinstore-nvcc caches ({call.why})"
    if list(call.flags) != real or call.include_dirs:
        return "the flags do not read back as written"
    return None


def _roots_problem(labels: list[str], flags: list[str]) -> str | None:
    """Why ``labels`` are not the roots of a call with ``flags``: ``inc/0..`` then ``flagpath/0..``."""
    includes = sum(1 for label in labels if label.startswith("inc/"))
    expected = [f"inc/{i}" for i in range(includes)] + [f"flagpath/{i}" for i in range(flags.count("-isystem"))]
    return None if labels == expected else f"its roots {labels} are not {expected}"


def _exported_call(local: Any, doc: dict[str, Any]) -> tuple[ExportedCall, bytes] | str:
    """The call a note describes and its TU text, or why it cannot become a target."""
    key, arch, flags = doc["call"], doc["arch"], list(doc["flags"])
    if not _KEY.fullmatch(key):
        return "its call key is malformed"
    try:
        Arch.parse(arch)
    except BadArgumentError as exc:
        return str(exc)
    if doc["kind"] != "cubin":
        return f"its output kind {doc['kind']!r} is not cubin"
    problem = _flags_problem(arch, flags)
    if problem is not None:
        return f"flags: {problem}"
    roots = doc["roots"]
    problem = _roots_problem([r["label"] for r in roots], flags)
    if problem is not None:
        return problem
    pips = []
    for root in roots:
        found = pip_root(root["path"])
        if found is None:
            return (f"include root {root['label']} ({root['path']}) lies in no installed Python package (no "
                    "site-packages/<package>/ above it), so CI cannot find it by name: install those headers as a "
                    "Python package, or have the library pass its installed folder")
        pips.append(found)
    labels = {r["label"] for r in roots} | {"cuda"}
    record = doc["record"]
    if any(f[0] not in labels for f in record["files"]) or any(a[0] not in labels for a in record["absent"]):
        return "its record names a root the call does not have"
    source = Digest.parse(doc["source"])
    text = local.read_verified(source, doc["size"]) if 0 < doc["size"] <= MAX_SOURCE else None
    if text is None:
        return f"its TU text {source} is not in the local store"
    n = sum(1 for r in roots if r["label"].startswith("inc/"))
    return ExportedCall(key, arch, source.hex, tuple(flags), tuple(pips[:n]), tuple(pips[n:]),
                        tuple(r["label"] for r in roots), record), text


def workspace_package(directory: Path) -> tuple[Path, str] | None:
    """(workspace root, Bazel package) of ``directory``: the nearest folder above it holding a
    WORKSPACE or MODULE.bazel; None if there is none."""
    here = directory.resolve()
    for top in (here, *here.parents):
        if any((top / name).is_file() for name in _WORKSPACE_FILES):
            return top, here.relative_to(top).as_posix() if here != top else ""
    return None


def _write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` in one rename (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _string_list(name: str, items: list[str]) -> list[str]:
    """``name = [...]`` as buildifier formats it (one item a line; empty lists stay on one line)."""
    if not items:
        return []
    return [f"    {name} = [", *(f"        {_q(item)}," for item in items), "    ],"]


def _build_file(exported: Exported) -> str:
    lines = [
        "# Generated by `cubinstore warmset export --nvcc` from the calls cubinstore-nvcc compiled: one",
        "# nvcc_cubin per call key (its TU in srcs/, by sha256). Build them all with the target",
        f"# `{TARGET_GROUP}`, then `cubinstore warmset publish --nvcc` this folder. Do not edit.",
        "",
        f'load("{exported.rules_repo}//tools:defs.bzl", "nvcc_cubin")',
        "",
    ]
    for call in exported.calls:
        lines += ["nvcc_cubin(", f"    name = {_q(call.target)},", f'    srcs = ["srcs/{call.source}.cu"],',
                  f"    arch = {_q(call.arch)},", *_string_list("copts", call.copts),
                  f"    source_name = {_q(SOURCE_NAME)},",
                  *_string_list("system_deps", [f"@{r.repository}//:headers" for r in call.system_deps]),
                  *_string_list("deps", [f"@{r.repository}//:headers" for r in call.deps]), ")", ""]
    lines += ["filegroup(", f"    name = {_q(TARGET_GROUP)},", *_string_list("srcs", [f":{c.target}" for c in exported.calls]),
              '    visibility = ["//visibility:public"],', ")", ""]
    return "\n".join(lines)


def _repositories_file(exported: Exported) -> str:
    lines = [
        '"""The include roots of the calls in this folder\'s BUILD.bazel, each an installed Python',
        "package's folder found by name (generated by `cubinstore warmset export --nvcc`).",
        "",
        "WORKSPACE: load this file and call nvcc_warmset_repositories(); MODULE.bazel: declare the",
        'same repositories with use_repo_rule (the export prints the lines)."""',
        "",
        f'load("{exported.rules_repo}//third_party/pip:pip_package_headers.bzl", "pip_package_headers")',
        "",
        "def nvcc_warmset_repositories():",
        '    """Declares every repository the calls of this folder include from."""',
    ]
    lines += [f"    {root.declaration()}" for root in exported.repositories] or ["    pass"]
    return "\n".join(lines) + "\n"


def _calls_file(exported: Exported) -> bytes:
    doc = {"schema": SCHEMA, "calls": {
        c.key: {"target": c.target, "arch": c.arch, "source": "sha256:" + c.source,
                "flags": list(c.flags),
                "roots": [{"label": label, "repository": root.repository, "package": root.package, "subdir": root.subdir}
                          for label, root in zip(c.labels, (*c.deps, *c.system_deps))],
                "record": c.record}
        for c in exported.calls}}
    return calls.canonical(doc) + b"\n"


def export(local: Any, out: Path, *, rules_repo: str = "@cubinstore") -> Exported:
    """Write ``out`` (see the module docstring) from every call ``cubinstore-nvcc`` kept in the
    local store ``local``; a call that cannot become a target is listed in ``refused``."""
    if not re.fullmatch(r"@[A-Za-z][A-Za-z0-9_.~+-]{0,200}|", rules_repo, re.ASCII):
        raise BadArgumentError(f"--rules-repo: expected a repository name like '@cubinstore', got {rules_repo!r}")
    exported = Exported(out, rules_repo=rules_repo)
    texts: dict[str, bytes] = {}
    owners: dict[str, PipRoot] = {}
    for doc in warm.notes(local):
        result = _exported_call(local, doc)
        if isinstance(result, str):
            exported.refused.append(f"call {doc['call']}: {result}")
            continue
        call, texts[result[0].source] = result
        for root in (*call.deps, *call.system_deps):
            other = owners.setdefault(root.repository, root)
            if other != root:
                raise BadArgumentError(f"warmset export: include roots {other} and {root} would share the "
                                       f"repository name {root.repository}")
        exported.calls.append(call)
    try:
        (out / "srcs").mkdir(parents=True, exist_ok=True)
        for hex_, text in texts.items():
            _write(out / "srcs" / f"{hex_}.cu", text)
        found = workspace_package(out)
        exported.package = found[1] if found is not None else None
        _write(out / "BUILD.bazel", _build_file(exported).encode())
        _write(out / "repositories.bzl", _repositories_file(exported).encode())
        _write(out / "calls.json", _calls_file(exported))
    except OSError as exc:
        raise BadArgumentError(f"warmset export: cannot write {out}: {exc.strerror or exc}") from exc
    return exported


# -- publish -----------------------------------------------------------------------------------------

@dataclass
class PublishReport:
    """What ``publish`` did, call by call."""

    published: list[str] = field(default_factory=list)  # call keys
    skipped: list[str] = field(default_factory=list)  # why, per call not published
    failed: list[str] = field(default_factory=list)  # upload problems, per call and remote


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise BadArgumentError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & 0o170000 != 0o100000:
            raise BadArgumentError(f"{what}: {path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BadArgumentError(f"{what}: {path} is over {limit} bytes")
    return data


def _calls_doc(out: Path) -> dict[str, dict[str, Any]]:
    """calls.json, checked: every field publish uses has the shape the export writes."""
    where = f"{out / 'calls.json'}"
    doc = loads_strict(_read_bounded(out / "calls.json", MAX_CALLS_JSON, "warmset publish"), where, BadArgumentError)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("calls"), dict):
        raise BadArgumentError(f"{where}: expected a document of schema {SCHEMA}")
    for key, c in doc["calls"].items():
        ok = (_KEY.fullmatch(key) and isinstance(c, dict) and c.get("target") == f"nvcc_{key}"
              and isinstance(c.get("arch"), str) and isinstance(c.get("source"), str)
              and c["source"].startswith("sha256:") and _SHA256_HEX.fullmatch(c["source"][7:])
              and isinstance(c.get("flags"), list) and all(isinstance(f, str) for f in c["flags"])
              and isinstance(c.get("roots"), list)
              and all(isinstance(r, dict) and isinstance(r.get("label"), str)
                      and isinstance(r.get("repository"), str) and _REPO.fullmatch(r["repository"]) for r in c["roots"])
              and isinstance(c.get("record"), dict) and calls.record_problem(c["record"]) is None)
        if not ok:
            raise BadArgumentError(f"{where}: the entry of call {key[:40]!r} is malformed")
        Arch.parse(c["arch"])
        problem = _flags_problem(c["arch"], c["flags"])
        if problem is not None:
            raise BadArgumentError(f"{where}: the flags of call {key}: {problem}")
        problem = _roots_problem([r["label"] for r in c["roots"]], c["flags"])
        if problem is not None:
            raise BadArgumentError(f"{where}: call {key}: {problem}")
    return doc["calls"]


def _output_base(bazel_bin: Path) -> Path:
    real = Path(os.path.realpath(bazel_bin))
    if len(real.parents) < 5 or real.parents[3].name != "execroot" or real.parents[1].name != "bazel-out":
        raise BadArgumentError(f"--bazel-bin {bazel_bin}: expected Bazel's bin folder (<output base>/execroot/"
                               f"<workspace>/bazel-out/<config>/bin), got {real}")
    return real.parents[4]


def _repository_dir(output_base: Path, name: str) -> Path | None:
    """The folder Bazel fetched repository ``name`` into (its WORKSPACE name, or a bzlmod canonical
    name ending ``~<name>``/``+<name>``); None if there is not exactly one."""
    external = output_base / "external"
    if (external / name).is_dir():
        return external / name
    try:
        found = [p for p in external.iterdir() if p.name.endswith(("~" + name, "+" + name)) and p.is_dir()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _toolchain(store: Store) -> dict[str, Any]:
    """This host's toolchain identity, as ``cubinstore-nvcc`` would take it here."""
    from cubinstore._nvcc.miss import toolchain
    from cubinstore._nvcc.real import real_nvcc

    return toolchain(store, real_nvcc(None))


def _cubin(path: Path, arch: str, what: str) -> bytes:
    data = _read_bounded(path, MAX_CUBIN, what)
    image = CubinImage(data, f"{what} ({path})")
    wanted = Arch.parse(arch)
    if image.sm != wanted.sm:
        raise CubinFormatError(f"{what}: {path} is a CUBIN for sm_{image.sm}, expected {arch}")
    return data


def _named(why: str, bases: dict[str, str]) -> str:
    """``calls.check``'s reason with the root's label (``inc/0/x.h changed``) replaced by its folder."""
    label, sep, rest = why.partition("/")
    if label == "cuda" and sep:
        return f"{bases['cuda']}/{rest}"
    head, sep2, tail = rest.partition("/")
    key = f"{label}/{head}"
    return f"{bases[key]}/{tail}" if sep and sep2 and key in bases else why


def publish(store: Store, out: Path, bazel_bin: Path) -> PublishReport:
    """Publish each call of ``out/calls.json`` that checks here to every remote of ``store``,
    with the CUBIN Bazel built (``bazel_bin``); see the module docstring."""
    entries = _calls_doc(out)
    located = workspace_package(out)
    if located is None:
        raise BadArgumentError(f"warmset publish: {out} lies in no Bazel workspace (no WORKSPACE or MODULE.bazel above it)")
    package = located[1]
    output_base = _output_base(bazel_bin)
    env = _toolchain(store)
    toolkit = env["toolkit"]
    built = _repository_dir(output_base, "local_cuda")
    if built is not None and os.path.realpath(built / "bin" / "nvcc") != os.path.realpath(Path(toolkit) / "bin" / "nvcc"):
        raise BadArgumentError(
            f"warmset publish: Bazel compiled with the toolkit of {os.path.realpath(built / 'bin' / 'nvcc')}, "
            f"cubinstore-nvcc here uses {toolkit}: run both with the same CUDA_PATH")
    report = PublishReport()
    for key in sorted(entries):
        c = entries[key]
        what = f"call {key} (//{package}:{c['target']})"
        try:
            text = _read_bounded(out / "srcs" / f"{c['source'][7:]}.cu", MAX_SOURCE, what)
            if hashlib.sha256(text).hexdigest() != c["source"][7:]:
                report.skipped.append(f"{what}: srcs/{c['source'][7:]}.cu does not hash to its name")
                continue
            flags = c["flags"]
            includes = sum(1 for r in c["roots"] if r["label"].startswith("inc/"))
            if calls.call_key(text, c["arch"], "cubin", flags, includes, env["identity"]) != key:
                report.skipped.append(
                    f"{what}: this host's toolchain (CUDA toolkit {toolkit}, host compiler, CUBINSTORE_NVCC) is not the "
                    "one that recorded the call, so Bazel's CUBIN is not what its key names")
                continue
            bases = {"cuda": toolkit}
            for root in c["roots"]:
                repo = _repository_dir(output_base, root["repository"])
                if repo is None:
                    raise BadArgumentError(f"{what}: Bazel fetched no repository {root['repository']} under "
                                           f"{output_base / 'external'}")
                bases[root["label"]] = os.path.realpath(repo / "include")
            why = calls.check(c["record"], bases)
            if why is not None:
                report.skipped.append(f"{what}: not published: {_named(why, bases)} since the call was recorded")
                continue
            data = _cubin(Path(bazel_bin) / package / f"{c['target']}.cubin", c["arch"], what)
            record = dict(c["record"], digest=str(Digest.of(data)), size=len(data))
            problems = remote.publish(store, key, record, data)
        except CubinstoreError as exc:
            report.skipped.append(str(exc))
            continue
        if problems:
            report.failed.extend(f"{what}: {p}" for p in problems)
        else:
            report.published.append(key)
    return report

