"""`import cubinstore` loads only what the call path needs: the rest comes in on first use."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["http.client", "ssl", "email", "cubinstore.store.http", "cubinstore.launch", "cubinstore.tensormap",
         "cubinstore.store", "cubinstore.manifest", "cryptography", "ctypes", "tempfile", "tarfile", "xxhash"]


def modules_after(code: str, **env: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_cubinstore_loads_none_of_the_heavy_modules() -> None:
    loaded = modules_after("import cubinstore")
    assert [m for m in HEAVY if m in loaded] == []


def test_public_names_load_on_first_use() -> None:
    loaded = modules_after("import cubinstore\nfrom cubinstore import Manifest, Store\nassert cubinstore.TensorMap")
    assert {"cubinstore.manifest", "cubinstore.store", "cubinstore.tensormap"} <= loaded
    with pytest.raises(AttributeError):
        import cubinstore

        cubinstore.no_such_name  # noqa: B018
    assert {"open", "Library", "Store", "TensorMap"} <= set(dir(cubinstore))


def test_a_store_without_remotes_never_imports_http(tmp_path: Path) -> None:
    code = "import cubinstore\ncubinstore.Store.from_env()"
    assert not {"cubinstore.store.http", "http.client", "ssl"} & modules_after(code, CUBINSTORE_HOME=str(tmp_path))
    with_remote = modules_after(code, CUBINSTORE_HOME=str(tmp_path), CUBINSTORE_REMOTE="http://127.0.0.1:9")
    assert "cubinstore.store.http" in with_remote


def test_opening_a_manifest_imports_no_http_tensor_maps_or_bundles(make_release) -> None:
    release = make_release(n=2)
    loaded = modules_after(f"import cubinstore\nassert len(cubinstore.open({str(release.path)!r}).manifest.kernels) == 2")
    assert "cubinstore.launch" in loaded
    assert not {"cubinstore.store.http", "ssl", "cubinstore.tensormap", "tarfile", "cryptography"} & loaded


def test_import_cubinstore_adds_only_its_errors() -> None:
    # -S: no site (its own imports would hide ours); what `import cubinstore` adds to a bare
    # interpreter, printed without importing anything more.
    code = "import sys\nbefore = set(sys.modules)\nimport cubinstore\nprint(sorted(set(sys.modules) - before))"
    out = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60, check=True)
    added = set(ast.literal_eval(out.stdout.splitlines()[-1]))
    assert {m for m in added if m.startswith("cubinstore")} == {"cubinstore", "cubinstore.errors"}
    # logging (and traceback, re, threading with it), dataclasses, hashlib and typing come with first use.
    assert not {"logging", "re", "dataclasses", "hashlib", "typing", "threading", "traceback"} & added
