"""The warm-set loop of cubinstore-nvcc on a pip-installed kernel library: its JIT's calls miss
(compiled through cubinstore-nvcc), `warmset export --nvcc` turns them into Bazel targets whose
include root is a repository finding the library by package name, `bazel build` compiles them,
`warmset publish --nvcc` puts Bazel's CUBINs on the nginx cache under the calls' keys, and a
fresh host (empty CUBINSTORE_HOME, the library at another prefix, CUBINSTORE_REMOTE set) runs
the same JIT with zero nvcc compiles, getting Bazel's bytes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xxhash", reason="cubinstore-nvcc needs the jit extra (xxhash)")

from helpers.jit import child_env  # noqa: E402
from helpers.kernel_library import (  # noqa: E402
    INSTANTIATIONS,
    LibraryJit,
    copy_install,
    count_compiles,
    counting_nvcc,
    install_library,
)

from ._workspace import Workspace  # noqa: E402

pytestmark = pytest.mark.bazel

WRAPPER = Path(sys.executable).with_name("cubinstore-nvcc")
CALLS = INSTANTIATIONS  # the 41 of the seed's start-up: each is one nvcc run and one Bazel action
PACKAGE = "nvcc_warmset"  # where the export goes in the CI workspace


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cubinstore", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def _workspace_lines(stdout: str) -> str:
    """The lines `warmset export --nvcc` prints for WORKSPACE."""
    return stdout.split("WORKSPACE:\n", 1)[1].split("\n\nor MODULE.bazel:", 1)[0]


def test_exported_calls_built_by_bazel_and_published_are_remote_hits_on_a_fresh_host(
        bazel_tools, nginx, tmp_path: Path) -> None:
    if not WRAPPER.exists():
        pytest.skip(f"{WRAPPER} is not installed (pip install -e . installs the console script)")
    ws = Workspace.create(tmp_path / "ci" / "cubinstore", tmp_path / "output_base", bazel_tools.bazel, bazel_tools.venv)
    try:
        log = tmp_path / "nvcc.log"
        shim = counting_nvcc(tmp_path / "toolkit", log)  # the nvcc behind cubinstore-nvcc, on every host

        # A serving host: every call of the library's JIT is a miss, compiled and kept for export.
        serving = install_library(tmp_path / "serving")
        first_env = child_env(tmp_path / "serving-home", CUBINSTORE_NVCC=str(shim))
        first = LibraryJit(serving, tmp_path / "serving-cache", WRAPPER, env=first_env)
        jitted = {inst: first.build(inst).read_bytes() for inst in CALLS}
        assert count_compiles(log) == len(CALLS)

        # CI: export the calls into the workspace, declare their repositories, build them.
        out = ws.root / PACKAGE
        exported = _cli(["warmset", "export", "--nvcc", "--out", str(out)], first_env)
        assert exported.returncode == 0, exported.stderr
        assert exported.stdout.startswith(f"exported {len(CALLS)} cubinstore-nvcc calls to {out} (include roots: 1 repository)")
        with open(ws.root / "WORKSPACE", "a") as f:
            f.write("\n" + _workspace_lines(exported.stdout) + "\n")
        # CI installs the library where it likes: the repository rule finds it by package name.
        ci_install = copy_install(tmp_path / "serving", tmp_path / "ci-env")
        site_packages = ci_install.parents[1]
        build = ws.build([f"//{PACKAGE}:cubins"], disk_cache=None, env={"PYTHONPATH": str(site_packages)})
        calls = json.loads((out / "calls.json").read_bytes())["calls"]
        assert build.misses() == {f"//{PACKAGE}:{c['target']}" for c in calls.values()}
        assert len(calls) == len(CALLS)
        by_source = {c["source"]: c for c in calls.values()}
        built = {}
        for inst in CALLS:
            call = by_source["sha256:" + hashlib.sha256(inst.tu().encode()).hexdigest()]
            built[inst] = (ws.root / "bazel-bin" / PACKAGE / f"{call['target']}.cubin").read_bytes()
            # The rule runs the JIT's command (flags, roots, the TU's name), so the bytes are the same.
            assert built[inst] == jitted[inst], inst.name

        # CI publishes what Bazel built, checked against the install it compiled.
        url = nginx.base()
        ci_env = child_env(tmp_path / "ci-home", CUBINSTORE_NVCC=str(shim))
        published = _cli(["warmset", "publish", "--nvcc", str(out), "--bazel-bin", str(ws.root / "bazel-bin"),
                          "--to", url], ci_env)
        assert published.returncode == 0, published.stderr
        assert published.stdout.startswith(f"published {len(CALLS)} calls to remote {url}; 0 skipped, 0 uploads failed")

        # A fresh host: nothing local, the library at another prefix, the remote set.
        compiles, lookups = count_compiles(log), nginx.requests("GET", "/ac/")
        fresh_root = copy_install(tmp_path / "serving", tmp_path / "fresh" / "deeper" / "env")
        fresh_env = child_env(tmp_path / "fresh-home", CUBINSTORE_NVCC=str(shim), CUBINSTORE_REMOTE=url)
        fresh = LibraryJit(fresh_root, tmp_path / "fresh-cache", WRAPPER, env=fresh_env)
        for inst in CALLS:
            assert fresh.build(inst).read_bytes() == built[inst], inst.name
        assert fresh.nvcc_runs() == len(CALLS)  # the library's own cache missed: each call reached cubinstore-nvcc
        assert count_compiles(log) == compiles  # and none ran nvcc
        assert nginx.requests("GET", "/ac/") - lookups == len(CALLS)  # one action-cache lookup a call
    finally:
        ws.shutdown()
