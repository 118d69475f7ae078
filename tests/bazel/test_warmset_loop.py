"""The warm-set loop on the smallest family: a point production missed (and JIT-compiled) is
exported, the family's BUILD.bazel loads the export, the next `bazel build` has the point in its
manifest, and a fresh process gets it from the release with no compile at all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from cubinstore import jit  # noqa: E402
from cubinstore.errors import KernelNotFoundError  # noqa: E402
from cubinstore.internals import template_for_sources  # noqa: E402
from cubinstore.manifest import Manifest  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

from ._workspace import REPO_ROOT, Workspace, seed_disk_cache  # noqa: E402

pytestmark = pytest.mark.bazel

TARGET = "//kernels:axpy_release"
NEW_POINTS = {"//kernels/axpy:axpy_f32_vec2_sm_90a", "//kernels/axpy:axpy_f32_vec2_sm_80"}


def _wire_warmset(root: Path, env: dict[str, str]) -> None:
    """What a family does once to take part: load its export and pass its points to cubin_instantiations."""
    out = subprocess.run([sys.executable, "-m", "cubinstore", "warmset", "export", "--family", "axpy",
                          "--out", str(root / "kernels" / "axpy" / "warmset.bzl")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    build = root / "kernels" / "axpy" / "BUILD.bazel"
    text = build.read_text().replace('    name = "axpy",\n', '    name = "axpy",\n    warm_points = WARM_POINTS,\n', 1)
    build.write_text('load(":warmset.bzl", "WARM_POINTS")\n' + text)
    # A manifest of this one family, so the loop builds nothing else.
    with open(root / "kernels" / "BUILD.bazel", "a") as f:
        f.write('\ncubin_manifest(\n    name = "axpy_release",\n    families = ["//kernels/axpy"],\n)\n')


def _child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env.update(CUBINSTORE_HOME=str(home), PYTHONPATH=str(REPO_ROOT), **extra)
    return env


def test_a_production_miss_is_in_the_next_release_and_loads_with_no_compile(bazel_tools, tmp_path: Path) -> None:
    ws = Workspace.create(tmp_path / "ci" / "cubinstore", tmp_path / "output_base", bazel_tools.bazel, bazel_tools.venv)
    prod_home = tmp_path / "production"
    try:
        _wire_warmset(ws.root, _child_env(prod_home))
        disk_cache = tmp_path / "disk_cache"
        seed_disk_cache(disk_cache)
        ws.build([TARGET], disk_cache=disk_cache)
        release1 = Manifest.from_path(ws.root / "bazel-bin" / "kernels" / "axpy_release.json")
        with pytest.raises(KernelNotFoundError):
            release1.select("axpy", (9, 0), dtype="f32", vec=2)

        # Production meets the point and compiles it from the family's sources.
        store = Store([LocalLayer(prod_home)])
        files = {p: (ws.root / p).read_text() for p in ("kernels/axpy/axpy.cu", "kernels/axpy/axpy.cuh")}
        template = template_for_sources(
            "axpy", ["dtype", "vec"], "kernels/axpy/axpy.cu", files, store,
            defines=["DTYPE_{dtype}", "VEC={vec}"], entries={"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]},
            archs=["sm_90a", "sm_80"], package="kernels/axpy")
        jitted = jit.compile_family_point(template, {"dtype": "f32", "vec": 2}, "sm_90a", store=store)

        # CI: export the warm set into the family, build the next release.
        out = subprocess.run([sys.executable, "-m", "cubinstore", "warmset", "export", "--family", "axpy",
                              "--out", str(ws.root / "kernels" / "axpy" / "warmset.bzl")],
                             env=_child_env(prod_home), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "(1 new)" in out.stdout, out.stderr
        second = ws.build([TARGET], disk_cache=disk_cache)
        assert second.misses() == NEW_POINTS  # every old point came from the cache
        release2 = Manifest.from_path(ws.root / "bazel-bin" / "kernels" / "axpy_release.json")
        old = {k.id: k.digest for k in release1.kernels}
        assert {k.id: k.digest for k in release2.kernels if k.id in old} == old
        point = release2.select("axpy", (9, 0), dtype="f32", vec=2)
        assert point.id == "axpy/f32/vec2/sm_90a" == jitted.id
        # The JIT runs the rule's command shape, so the bytes match (axpy has no internal-linkage
        # symbols, the one thing the TU's name could salt).
        assert jitted.digest == point.digest

        # A fresh process on a fresh host: the release's point, verified from the cache CI
        # filled, without entering the JIT.
        fresh = tmp_path / "fresh"
        code = (
            "import cubinstore\n"
            f"lib = cubinstore.open({str(ws.root / 'bazel-bin' / 'kernels' / 'axpy_release.json')!r})\n"
            "spec = lib.manifest.select('axpy', (9, 0), dtype='f32', vec=2)\n"
            "data = lib.store.get(spec.digest, spec.size, name=spec.id)\n"
            "print(spec.id, spec.digest, len(data))\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env=_child_env(fresh, CUBINSTORE_DISK_CACHE=str(disk_cache), CUBINSTORE_OFFLINE="1"))
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [point.id, str(point.digest), str(point.size)]
        assert not (fresh / "v1" / "jit").exists()  # the JIT was never entered
        assert re.search(r"WARM_POINTS = \[\s*\{\s*\"dtype\": \"f32\",\s*\"vec\": 2,\s*\},\s*\]",
                         (ws.root / "kernels" / "axpy" / "warmset.bzl").read_text())
    finally:
        ws.shutdown()
