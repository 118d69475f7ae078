"""Family points a manifest lacks, compiled at run time from the release's own sources (real nvcc, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubinstore import Digest, jit
from cubinstore.errors import BadArgumentError, KernelNotFoundError, ManifestError
from cubinstore.internals import family as jit_family, make_bundle, template_for_sources, warmset as _warmset
from cubinstore.jit import FamilyTemplate
from cubinstore.manifest import Manifest
from cubinstore.store import LocalLayer, Store

REPO = Path(__file__).resolve().parents[2]
AXPY = ["kernels/axpy/axpy.cu", "kernels/axpy/axpy.cuh"]


@pytest.fixture(scope="module")
def axpy(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("jitfam") / "home"
    store = Store([LocalLayer(home)])
    template = template_for_sources(
        "axpy", ["dtype", "vec"], "kernels/axpy/axpy.cu", {p: (REPO / p).read_text() for p in AXPY}, store,
        defines=["DTYPE_{dtype}", "VEC={vec}"], entries={"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]},
        archs=["sm_90a", "sm_80"], package="kernels/axpy",
    )
    return store, home, template


def test_missing_point_compiles_to_the_spec_the_manifest_would_have(axpy) -> None:
    store, home, template = axpy
    spec = jit.compile_family_point(template, {"vec": 2, "dtype": "f32"}, "sm_80", store=store)
    assert spec.id == "axpy/f32/vec2/sm_80" and spec.family == "axpy" and list(spec.params) == ["dtype", "vec"]
    assert spec.target == "//kernels/axpy:axpy_f32_vec2_sm_80"
    assert dict(spec.entries) == {"axpy_f32": ("i32", "f32", "ptr", "ptr")}
    assert Digest.of(LocalLayer(home).path_for(spec.digest).read_bytes()) == spec.digest
    # It loads like any manifest entry: a one-kernel manifest of it validates.
    assert Manifest.build([spec]).by_id(spec.id).digest == spec.digest
    (rec,) = [r for r in _warmset.records(LocalLayer(home)) if r.params == {"dtype": "f32", "vec": 2}]
    assert (rec.kind, rec.family, rec.arch, rec.digest) == ("jit", "axpy", "sm_80", spec.digest)


def test_second_ask_for_the_point_is_a_hit_even_with_jit_off(axpy) -> None:
    store, home, template = axpy
    first = jit.compile_family_point(template, {"dtype": "f64", "vec": 2}, "sm_80", store=store)
    again = jit.compile_family_point(template, {"dtype": "f64", "vec": 2}, "sm_80", store=store, jit=False)
    assert again == first


def test_point_not_compiled_with_jit_off_is_kernel_not_found(axpy) -> None:
    store, home, template = axpy
    with pytest.raises(KernelNotFoundError, match=r"^JIT key xxh3:[0-9a-f]{32} \(arch sm_80, family axpy dtype='f32' vec=8\)"):
        jit.compile_family_point(template, {"dtype": "f32", "vec": 8}, "sm_80", store=store, jit=False)


def test_arch_outside_the_template_and_wrong_params_are_refused(axpy) -> None:
    store, home, template = axpy
    with pytest.raises(KernelNotFoundError, match="^axpy: its JIT template compiles for sm_90a, sm_80, not sm_70"):
        jit.compile_family_point(template, {"dtype": "f32", "vec": 2}, "sm_70", store=store)
    with pytest.raises(BadArgumentError, match="^axpy: expected parameters dtype, vec, got dtype"):
        jit.compile_family_point(template, {"dtype": "f32"}, "sm_80", store=store)


def test_bundle_with_a_path_outside_it_is_refused(tmp_path: Path) -> None:
    store = Store([LocalLayer(tmp_path / "home")])
    raw = make_bundle({"kernels/a.cu": "x"}).replace(b'"kernels/a.cu"', b'"../../etc/x"')
    digest = Digest.of(raw)
    store.local.write(digest, raw)
    template = FamilyTemplate.from_json({"schema": "cubinstore/jit-family/v1", "family": "a", "grid_keys": [],
                                         "source": "kernels/a.cu", "bundle": {"digest": str(digest), "size": len(raw)},
                                         "entries": {"k": ["i32"]}})
    with pytest.raises(ManifestError, match=r"^a JIT sources sha256:[0-9a-f]{64}: file '../../etc/x': expected a plain relative path"):
        jit.compile_family_point(template, {}, "sm_80", store=store)
    assert not (tmp_path / "etc").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"schema": "v0"}, "jit template: schema: expected 'cubinstore/jit-family/v1'"),
    ({"source": "/abs/x.cu"}, "jit template: source: expected a relative path inside the bundle"),
    ({"includes": ["boost"]}, "jit template: includes: unknown include root 'boost'; known: cutlass"),
    ({"entries": {}}, "jit template: entries: expected a non-empty object"),
])
def test_malformed_templates_are_manifest_errors_naming_the_field(change, message) -> None:
    doc = {"schema": "cubinstore/jit-family/v1", "family": "a", "grid_keys": ["x"], "source": "a.cu",
           "bundle": {"digest": "sha256:" + "ab" * 32, "size": 10}, "entries": {"k": ["i32"]}}
    doc.update(change)
    with pytest.raises(ManifestError, match="^" + message):
        FamilyTemplate.from_json(doc)


def test_resolve_miss_records_it_and_compiles_from_the_template(axpy, make_release) -> None:
    store, home, template = axpy
    manifest = Manifest.from_path(make_release(n=8, archs=("sm_80",)).path)
    spec = jit_family.resolve_miss(manifest, "axpy", {"dtype": "f32", "vec": 3}, "sm_80", template=template, store=store)
    assert spec.id == "axpy/f32/vec3/sm_80"
    misses = [r for r in _warmset.records(LocalLayer(home)) if r.params == {"dtype": "f32", "vec": 3}]
    assert [(r.kind, r.count) for r in misses] == [("jit", 2)]  # the miss, then the compile


def test_resolve_miss_with_jit_off_names_the_nearest_points(axpy, make_release) -> None:
    store, home, template = axpy
    manifest = Manifest.from_path(make_release(n=8, archs=("sm_80",)).path)
    with pytest.raises(KernelNotFoundError) as info:
        jit_family.resolve_miss(manifest, "axpy", {"dtype": "f32", "vec": 5}, "sm_80", template=template,
                                store=store, jit=False)
    assert str(info.value).startswith(
        f"no kernel axpy dtype='f32' vec=5 sm_80 in manifest {manifest.digest}; nearest: axpy/f32/vec1/sm_80 "
        "(vec: 1 in the manifest, 5 asked)")
    assert "run-time compilation is off (CUBINSTORE_JIT=0 or jit=False)" in str(info.value)
    with pytest.raises(KernelNotFoundError, match="family axpy has no JIT template"):
        jit_family.resolve_miss(manifest, "axpy", {"dtype": "f32", "vec": 5}, "sm_80", template=None, store=store)
    (rec,) = [r for r in _warmset.records(LocalLayer(home)) if r.params == {"dtype": "f32", "vec": 5}]
    assert (rec.kind, rec.count) == ("miss", 2)


def test_a_miss_without_the_jit_extra_is_recorded_and_names_what_is_missing(tmp_path: Path, make_release) -> None:
    from helpers.jit import child_env, run_child

    release = make_release(n=4, archs=("sm_80",))
    code = (
        "import sys\nsys.modules['xxhash'] = None  # the jit extra is not installed\n"
        "from cubinstore._jit import family as _jitfamily\nfrom cubinstore._release import warmset as _warmset\nfrom cubinstore.manifest import Manifest\n"
        "from cubinstore.store import LocalLayer, Store\nfrom cubinstore.errors import KernelNotFoundError\n"
        f"m = Manifest.from_path({str(release.path)!r})\n"
        f"store = Store([LocalLayer({str(tmp_path / 'home')!r})])\n"
        "t = _jitfamily.FamilyTemplate.from_json({'schema': 'cubinstore/jit-family/v1', 'family': 'axpy', "
        "'grid_keys': ['dtype', 'vec'], 'source': 'a.cu', 'bundle': {'digest': 'sha256:' + 'ab' * 32, 'size': 1}, "
        "'entries': {'k': ['i32']}})\n"
        "for template in (None, t):\n"
        "    try:\n"
        "        _jitfamily.resolve_miss(m, 'axpy', {'dtype': 'f32', 'vec': 3}, 'sm_80', template=template, store=store)\n"
        "    except KernelNotFoundError as exc:\n"
        "        print(str(exc)[:60] if template is None else str(exc))\n"
        "print(_warmset.records(store.local)[0].count, 'xxhash' in sys.modules and sys.modules['xxhash'] is not None)\n"
    )
    out = run_child(code, child_env(tmp_path / "home"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("no kernel axpy dtype='f32' vec=3 sm_80 in manifest")
    assert "compiling it at run time needs the jit extra (pip install 'cubinstore[jit]')" in lines[1]
    assert lines[2] == "2 False"
