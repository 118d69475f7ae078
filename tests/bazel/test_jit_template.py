"""cubin_jit_template: Bazel writes a family's JIT template and source bundle; the runtime fetches
the bundle by digest from the cache the build filled and compiles any point from it: a point
the release has comes out byte-identical to Bazel's CUBIN, one it lacks compiles too."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from cubinstore import Digest, jit  # noqa: E402
from cubinstore.jit import FamilyTemplate  # noqa: E402
from cubinstore.store import DiskCacheLayer, LocalLayer, Store  # noqa: E402

from ._workspace import BazelError, Workspace, seed_disk_cache  # noqa: E402

pytestmark = pytest.mark.bazel

AXPY_TEMPLATE = '''
load("//tools:defs.bzl", "cubin_jit_template", "cuda_headers")

cubin_jit_template(
    name = "axpy_jit",
    archs = ["sm_90a", "sm_80"],
    defines = ["DTYPE_{dtype}", "VEC={vec}"],
    entries = {"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]},
    family = "axpy",
    grid_keys = ["dtype", "vec"],
    hdrs = ["axpy.cuh"],
    src = "axpy.cu",
)

cuda_headers(
    name = "local_headers",
    hdrs = ["axpy.cuh"],
)

cubin_jit_template(
    name = "bad_dep",
    deps = [":local_headers"],
    entries = {"k": ["i32"]},
    family = "axpy",
    grid_keys = [],
    src = "axpy.cu",
)
'''


@pytest.fixture(scope="module")
def built(bazel_tools, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("jit_template")
    ws = Workspace.create(base / "cubinstore", base / "output_base", bazel_tools.bazel, bazel_tools.venv)
    with open(ws.root / "kernels" / "axpy" / "BUILD.bazel", "a") as f:
        f.write(AXPY_TEMPLATE)
    disk_cache = base / "disk_cache"
    seed_disk_cache(disk_cache)
    try:
        result = ws.build(["//kernels/axpy:axpy_jit", "//kernels/axpy:axpy_f32_vec4_sm_90a"], disk_cache=disk_cache)
        yield ws, disk_cache, result, base
    finally:
        ws.shutdown()


def test_the_template_names_the_bundle_by_the_sha256_of_its_bytes(built) -> None:
    ws, _, result, _ = built
    out = ws.root / "bazel-bin" / "kernels" / "axpy"
    template = FamilyTemplate.from_json(json.loads((out / "axpy_jit.json").read_text()))
    bundle = (out / "axpy_jit.sources.json").read_bytes()
    assert template.bundle == Digest.of(bundle) and template.bundle_size == len(bundle)
    assert sorted(json.loads(bundle)["files"]) == ["kernels/axpy/axpy.cu", "kernels/axpy/axpy.cuh"]
    assert (template.family, template.source, template.package) == ("axpy", "kernels/axpy/axpy.cu", "kernels/axpy")
    assert any(s.mnemonic == "CubinJitTemplate" for s in result.spawns)


def test_points_compile_from_the_bundle_in_the_build_cache(built) -> None:
    ws, disk_cache, _, base = built
    template = FamilyTemplate.from_json(json.loads((ws.root / "bazel-bin" / "kernels" / "axpy" / "axpy_jit.json").read_text()))
    # Production: an empty local store, the bundle fetched by digest from the cache CI filled.
    store = Store([LocalLayer(base / "production"), DiskCacheLayer(disk_cache)])
    have = jit.compile_family_point(template, {"dtype": "f32", "vec": 4}, "sm_90a", store=store)
    aot = (ws.root / "bazel-bin" / "kernels" / "axpy" / "axpy_f32_vec4_sm_90a.cubin").read_bytes()
    assert have.digest == Digest.of(aot)  # the release's own sources, the rule's command: the same bytes
    assert have.target == "//kernels/axpy:axpy_f32_vec4_sm_90a"
    missing = jit.compile_family_point(template, {"dtype": "f64", "vec": 3}, "sm_80", store=store)
    assert missing.id == "axpy/f64/vec3/sm_80" and dict(missing.entries) == {"axpy_f64": ("i32", "f64", "ptr", "ptr")}


def test_a_dep_outside_the_known_external_roots_fails_naming_it(built) -> None:
    ws = built[0]
    with pytest.raises(BazelError) as info:
        ws.run("build", ["--color=no", "--curses=no", "//kernels/axpy:bad_dep"])
    assert info.value.fail_message().startswith(
        "//kernels/axpy:bad_dep: attribute 'deps' has '//kernels/axpy:local_headers'; a JIT template can name headers of @cutlass only")
