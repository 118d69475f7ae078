"""A family JIT template and its source bundle are data: they cannot run a command, read a host
file or write outside the store (issue 27). Real manifests opened through ``cubinstore.open``,
real nvcc; each attack's script only touches ``tmp_path``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

import cubinstore  # noqa: E402
from cubinstore import Digest, cli, jit  # noqa: E402
from cubinstore.errors import BadArgumentError, JitCompileError, ManifestError  # noqa: E402
from cubinstore.internals import DEFAULT_NVCC_FLAGS, make_bundle, template_for_sources  # noqa: E402
from cubinstore.jit import FamilyTemplate  # noqa: E402
from cubinstore.manifest import Manifest, dumps_canonical  # noqa: E402
from cubinstore.manifest.flags import copt_problem, define_problem  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
AXPY = {p: (REPO / p).read_text() for p in ("kernels/axpy/axpy.cu", "kernels/axpy/axpy.cuh")}
SEALED = "sealed" in inspect.signature(jit.compile).parameters
needs_sealed = pytest.mark.skipif(not SEALED, reason="waiting on jit.compile(..., sealed=True) (the jitcore change)")


def _template(raw: bytes, **changes: Any) -> dict[str, Any]:
    doc = {
        "schema": "cubinstore/jit-family/v1", "family": "axpy", "grid_keys": ["dtype", "vec"],
        "source": "kernels/axpy/axpy.cu", "bundle": {"digest": str(Digest.of(raw)), "size": len(raw)},
        "defines": ["DTYPE_{dtype}", "VEC={vec}"], "copts": [], "includes": [],
        "entries": {"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]}, "archs": ["sm_80"], "package": "kernels/axpy",
    }
    doc.update(changes)
    return doc


def _publish(store: Store, tools: Any, files: dict[str, str], **changes: Any) -> str:
    """A v2 manifest (one axpy kernel, the family's template with ``changes``) and its bundle of
    ``files`` in ``store``, written as a release would be; returns the manifest's ``sha256:``."""
    raw = make_bundle(files)
    store.local.write(Digest.of(raw), raw)
    kernel = Manifest.build([tools.kernel_doc("axpy", {"dtype": "f32", "vec": 1}, "sm_80", b"\x7fELF" + bytes(60),
                                              entry="axpy_f32")]).kernels[0].to_json()
    doc = {"schema": "cubinstore/manifest/v2", "kernels": [kernel], "families": {"axpy": {"jit": _template(raw, **changes)}}}
    manifest = dumps_canonical(doc)
    store.local.write(Digest.of(manifest), manifest)
    return str(Digest.of(manifest))


def _open_and_ask(digest: str, store: Store) -> None:
    """``cubinstore.open("sha256:...")``, then what ``lib.kernel("axpy", dtype="f32", vec=2)`` does on an
    sm_80 device for the point the manifest lacks (JIT on): compile it from the template."""
    lib = cubinstore.open(digest, store=store)
    lib._missing_point("axpy", {"dtype": "f32", "vec": 2}, (8, 0), True)


def _script(marker: Path) -> str:
    return f"touch '{marker}'\nexec \"$@\"\n"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store([LocalLayer(tmp_path / "outer" / "home")])


# -- attacks through copts and defines, refused at open -------------------------------------------

def test_response_file_through_xcompiler_is_refused_at_open(store: Store, tools: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    files = {**AXPY, "kernels/axpy/opts.rsp": "-wrapper /bin/sh,inc/0/kernels/axpy/run.sh\n",
             "kernels/axpy/run.sh": _script(marker)}
    digest = _publish(store, tools, files, copts=["-Xcompiler=@inc/0/kernels/axpy/opts.rsp"])
    refused = r"families\.axpy\.jit: copts\[0\]: option '-Xcompiler' .*is not allowed in a JIT template; allowed: "
    with pytest.raises(ManifestError, match=refused):
        _open_and_ask(digest, store)
    assert not marker.exists()


def test_options_file_in_template_is_refused_at_open(store: Store, tools: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    files = {**AXPY, "kernels/axpy/opts.txt": "-Xcompiler @inc/0/kernels/axpy/opts.rsp\n",
             "kernels/axpy/opts.rsp": "-wrapper /bin/sh,inc/0/kernels/axpy/run.sh\n", "kernels/axpy/run.sh": _script(marker)}
    digest = _publish(store, tools, files, copts=["--options-file", "inc/0/kernels/axpy/opts.txt"])
    refused = r"families\.axpy\.jit: copts\[0\]: option '--options-file' is not allowed in a JIT template"
    with pytest.raises(ManifestError, match=refused):
        _open_and_ask(digest, store)
    assert not marker.exists()


def test_dependency_file_outside_the_store_is_refused_at_open(store: Store, tools: Any, tmp_path: Path) -> None:
    # The compile directory is <home>/v1/jit/tmp/<dir>: five levels up is tmp_path/outer.
    digest = _publish(store, tools, AXPY, copts=["-Xcompiler=-MD,-MF,../../../../../x.d"])
    with pytest.raises(ManifestError, match=r"families\.axpy\.jit: copts\[0\]: option '-Xcompiler' "):
        _open_and_ask(digest, store)
    assert not list(tmp_path.rglob("x.d"))


@pytest.mark.parametrize("spelled", [["-include", "{host}"], ["-include{host}"], ["-I", "{dir}"], ["-isystem{dir}"]])
def test_host_path_options_are_refused_at_open(store: Store, tools: Any, tmp_path: Path, spelled: list[str]) -> None:
    host = tmp_path / "host.h"
    host.write_text("#define FROM_THE_HOST 1\n")
    copts = [s.replace("{host}", str(host)).replace("{dir}", str(tmp_path)) for s in spelled]
    digest = _publish(store, tools, AXPY, copts=copts)
    option = re.match(r"-include|-isystem|-I", spelled[0]).group(0)  # type: ignore[union-attr]
    with pytest.raises(ManifestError, match=rf"copts\[0\]: option '{option}'.* is not allowed in a JIT template"):
        _open_and_ask(digest, store)


def test_define_that_the_shell_would_expand_is_refused_at_open(store: Store, tools: Any, tmp_path: Path) -> None:
    # nvcc runs the preprocessor through sh -c with each -D in double quotes: $(...) would run.
    marker = tmp_path / "ran"
    digest = _publish(store, tools, AXPY, defines=["DTYPE_{dtype}", "VEC={vec}", f"PWN=$(touch {marker})"])
    refused = r"families\.axpy\.jit: defines\[2\]: 'PWN=\$\(touch .*expected NAME or NAME=VALUE"
    with pytest.raises(ManifestError, match=refused):
        _open_and_ask(digest, store)
    assert not marker.exists()


def test_bad_arch_in_template_is_a_manifest_error(store: Store, tools: Any, tmp_path: Path, clean_env: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    digest = _publish(store, tools, AXPY, archs=["sm_90a", "sm_9"])
    with pytest.raises(ManifestError, match=r"families\.axpy\.jit: archs\[1\]: invalid arch 'sm_9'"):
        _open_and_ask(digest, store)
    # The CLI: a bad release (exit 1, one line), not bad usage (exit 2).
    path = tmp_path / "manifest.json"
    path.write_bytes(store.get(Digest.parse(digest)))
    assert cli.main(["ls", str(path)]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert "families.axpy.jit: archs[1]: invalid arch 'sm_9'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("entries", "message"), [
    ({"axpy_{dtype}": ["i32", "notatype"]},
     r"entries\['axpy_\{dtype\}'\]\[1\]: expected one of i8 .* or a placeholder \(\{dtype\}, \{vec\}\), got 'notatype'"),
    ({"axpy_{dtype}": ["i32", "{nokey}"]}, r"entries\['axpy_\{dtype\}'\]\[1\]: expected one of .*got '\{nokey\}'"),
    ({"axpy_{dtype}": ["struct:6:4"]}, r"entries\['axpy_\{dtype\}'\]\[0\]: expected one of .*got 'struct:6:4'"),
    ({"axpy f32": ["i32"]}, r"entries\['axpy f32'\]: expected a symbol \(a C identifier, placeholders allowed\)"),
])
def test_entry_types_that_are_not_types_are_refused_at_open(store: Store, tools: Any, entries: dict, message: str) -> None:
    digest = _publish(store, tools, AXPY, entries=entries)
    with pytest.raises(ManifestError, match=r"families\.axpy\.jit: " + message):
        _open_and_ask(digest, store)


# -- the allow-list --------------------------------------------------------------------------------

@pytest.mark.parametrize("copt", [
    "-Xcompiler=-fno-strict-aliasing", "-Xlinker=-rpath", "-wrapper", "-ccbin=gcc", "--compiler-bindir", "-odir",
    "--keep", "--keep-dir", "-save-temps", "@opts.rsp", "-optf", "-o", "-MD", "-MF", "-M", "-isystem", "-I.", "-Ifoo",
    "-include", "--pre-include=x.h", "-Xptxas=-v,--output-file", "-Xptxas -v", "-Xcicc=-O3", "-DX=a/b", "-DX=a..b",
    "-DX=@x", "-DX=$(id)", "-DX=`id`", "-maxrregcount=-1", "-std=c++{v}", "-O3\n", "-O\x003", "-O9", "--dryrun", "-E",
    "-Xnvlink=-v", "-G", "--use-local-env", "-x", "cu",
])
def test_copts_outside_the_allow_list_are_refused(copt: str) -> None:
    assert copt_problem(copt, ["v"]) is not None


@pytest.mark.parametrize("copt", [
    *DEFAULT_NVCC_FLAGS, "-std=c++20", "-O2", "--expt-extended-lambda", "-lineinfo", "--use_fast_math", "-ftz=true",
    "-prec-div=false", "-prec-sqrt=true", "-fmad=false", "-maxrregcount=128", "-maxrregcount={regs}",
    "--extra-device-vectorization", "-w", "--diag-suppress=177,550", "-DBM={bm}", "-DNDEBUG", "-UNDEBUG",
    "-Xptxas=-v", "-Xptxas=-v,--warn-on-spills",
])
def test_behaviour_flags_are_allowed(copt: str) -> None:
    assert copt_problem(copt, ["regs", "bm"]) is None


def test_every_copt_and_define_of_the_projects_families_is_allowed() -> None:
    # What kernels/*/BUILD.bazel pass to cubin_instantiations (and so to a JIT template with jit = True).
    lists = {"copts": [], "defines": []}
    for build in sorted((REPO / "kernels").glob("*/BUILD.bazel")):
        for field, body in re.findall(r"\b(copts|defines) = \[(.*?)\]", build.read_text(), re.S):
            lists[field] += re.findall(r'"((?:[^"\\]|\\.)*)"', body)
    assert lists["defines"], "no defines found: the BUILD files changed shape"
    keys = ["dtype", "vec", "bm", "bn", "bk", "stages", "cluster", "swap", "warps", "tile"]
    assert [c for c in lists["copts"] if copt_problem(c, keys)] == []
    assert [d for d in lists["defines"] if define_problem(d, keys)] == []


def test_the_built_release_opens(tmp_path: Path) -> None:
    built = REPO / "bazel-bin" / "kernels" / "manifest.json"
    if not built.is_file():
        pytest.skip("bazel-bin/kernels/manifest.json not built")
    assert "gemm" in Manifest.from_path(built).jit_templates


def test_placeholder_filled_into_a_refused_flag_is_refused_before_nvcc(tmp_path: Path) -> None:
    store = Store([LocalLayer(tmp_path / "home")])
    template = template_for_sources("axpy", ["dtype", "vec"], "kernels/axpy/axpy.cu", AXPY, store,
                                    defines=["DTYPE_{dtype}", "VEC={vec}"], copts=["-maxrregcount={vec}"],
                                    entries={"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]})
    refused = r"^axpy dtype='f32' vec='a\.\.b': copts\[0\] '-maxrregcount=\{vec\}' filled is not allowed"
    with pytest.raises(BadArgumentError, match=refused):
        jit.compile_family_point(template, {"dtype": "f32", "vec": "a..b"}, "sm_80", store=store)
    assert not (tmp_path / "home" / "v1" / "jit" / "sources").exists()


def test_bundle_with_duplicate_keys_is_refused(tmp_path: Path) -> None:
    store = Store([LocalLayer(tmp_path / "home")])
    raw = make_bundle({"kernels/a.cu": "x", "kernels/b.cu": "y"}).replace(b'"kernels/b.cu"', b'"kernels/a.cu"')
    store.local.write(Digest.of(raw), raw)
    template = FamilyTemplate.from_json(_template(raw, grid_keys=[], source="kernels/a.cu", defines=[],
                                                  entries={"k": ["i32"]}))
    with pytest.raises(ManifestError, match=r"^axpy JIT sources sha256:[0-9a-f]{64}: duplicate key 'kernels/a.cu'"):
        jit.compile_family_point(template, {}, "sm_80", store=store)


# -- sealed compiles: nothing outside the roots is read -------------------------------------------

def _sealed_template(store: Store, tu: str, defines: list[str]) -> FamilyTemplate:
    return template_for_sources("host", [], "kernels/host/k.cu", {"kernels/host/k.cu": tu}, store,
                                defines=defines, entries={"k": ["i32"]})


def _nothing_cached(store: Store, template: FamilyTemplate) -> None:
    local = store.local
    assert [n for shard in local.list_names(("jit", "index")) for n in local.list_names(("jit", "index", shard))] == []
    assert set(local.iter_digests()) == {template.bundle}  # the bundle, no CUBIN


@needs_sealed
def test_template_including_an_absolute_host_file_fails_the_compile(tmp_path: Path) -> None:
    host = tmp_path / "host_cfg.h"
    host.write_text("#define HOST_VALUE 3\n")
    store = Store([LocalLayer(tmp_path / "home")])
    template = _sealed_template(store, f'#include "{host}"\nextern "C" __global__ void k(int n) {{ (void)n; }}\n', [])
    with pytest.raises(JitCompileError, match=re.escape(str(host))):
        jit.compile_family_point(template, {}, "sm_80", store=store)
    _nothing_cached(store, template)


@needs_sealed
def test_define_naming_a_host_header_fails_the_compile(tmp_path: Path) -> None:
    host = tmp_path / "host_cfg.h"
    host.write_text("#define HOST_VALUE 3\n")
    store = Store([LocalLayer(tmp_path / "home")])
    template = _sealed_template(store, '#include CFG\nextern "C" __global__ void k(int n) { (void)n; }\n',
                                [f'CFG="{host}"'])
    with pytest.raises(JitCompileError, match=re.escape(str(host))):
        jit.compile_family_point(template, {}, "sm_80", store=store)
    _nothing_cached(store, template)


# -- materialised sources are re-checked against the bundle -------------------------------------

def _axpy(store: Store) -> FamilyTemplate:
    return template_for_sources("axpy", ["dtype", "vec"], "kernels/axpy/axpy.cu", AXPY, store,
                                defines=["DTYPE_{dtype}", "VEC={vec}"],
                                entries={"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]})


@pytest.mark.parametrize("fresh_process", [False, True])
def test_edited_materialised_header_is_rewritten_from_the_bundle(tmp_path: Path, fresh_process: bool) -> None:
    store = Store([LocalLayer(tmp_path / "home")])
    template = _axpy(store)
    jit.compile_family_point(template, {"dtype": "f32", "vec": 1}, "sm_80", store=store)
    header = tmp_path / "home" / "v1" / "jit" / "sources" / template.bundle.hex / "kernels" / "axpy" / "axpy.cuh"
    header.write_text(header.read_text().replace("a * x[i] + y[i]", "a * x[i] - y[i]"))
    if fresh_process:  # nothing of the tree hashed in this process: what the next process sees
        jit.clear_caches()
    edited = jit.compile_family_point(template, {"dtype": "f32", "vec": 2}, "sm_80", store=store)
    clean_store = Store([LocalLayer(tmp_path / "clean")])
    clean = jit.compile_family_point(_axpy(clean_store), {"dtype": "f32", "vec": 2}, "sm_80", store=clean_store)
    assert edited.digest == clean.digest
    assert header.read_text() == AXPY["kernels/axpy/axpy.cuh"]


def test_extra_header_that_would_shadow_an_include_is_removed(tmp_path: Path) -> None:
    store = Store([LocalLayer(tmp_path / "home")])
    template = _axpy(store)
    jit.compile_family_point(template, {"dtype": "f32", "vec": 1}, "sm_80", store=store)
    sources = tmp_path / "home" / "v1" / "jit" / "sources" / template.bundle.hex
    # nvcc force-includes cuda_runtime.h: searched in -I directories before the toolkit's.
    (sources / "cuda_runtime.h").write_text('#error "a header the bundle does not have"\n')
    (sources / "cute").mkdir()
    (sources / "cute" / "tensor.hpp").write_text("#error shadowed\n")
    spec = jit.compile_family_point(template, {"dtype": "f64", "vec": 1}, "sm_80", store=store)
    assert spec.id == "axpy/f64/vec1/sm_80"
    assert not (sources / "cuda_runtime.h").exists() and not (sources / "cute").exists()
