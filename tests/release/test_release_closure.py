"""A release's closure from a build tree, and a local store that cannot be used, through the real CLI.

The closure is the manifest's CUBINs, the source bundle of each family JIT template
(``<name>.sources.json`` beside the CUBINs in ``bazel-bin``) and the manifest itself:
``publish``, ``pack`` and ``prefetch`` find every member in the build tree, verified by size
and sha256. A failure about the store rather than one blob is one line, not one per blob.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest
from cubinstore.internals import make_bundle, pack
from cubinstore.store import HttpLayer, LocalLayer, Store

pytestmark = pytest.mark.usefixtures("clean_env")

OFFSETS = {"f32": [0, 4, 8, 16], "f64": [0, 8, 16, 24]}  # (i32, dtype, ptr, ptr) laid out as the CUDA ABI does


@dataclass
class BuildTree:
    """A ``bazel-bin`` as the build leaves it: CUBINs, a family's JIT template and its source bundle, the manifest."""

    root: Path  # the bazel-bin directory
    manifest: Path
    blobs: dict[str, bytes]  # hex -> bytes: the whole closure but the manifest
    bundle_hex: str

    @property
    def digest(self) -> Digest:
        return Manifest.from_path(self.manifest).digest


@pytest.fixture
def build_tree(tmp_path: Path, tools) -> BuildTree:
    rng = random.Random(27)
    root = tmp_path / "ws" / "bazel-bin"
    package = root / "kernels" / "axpy"
    package.mkdir(parents=True)
    bundle = make_bundle({"kernels/axpy/axpy.cu": "// axpy, rendered per point\n#include \"axpy.cuh\"\n",
                          "kernels/axpy/axpy.cuh": "#pragma once\n"})
    (package / "axpy_jit.sources.json").write_bytes(bundle)
    kernels, blobs = [], {hashlib.sha256(bundle).hexdigest(): bundle}
    for i, (dtype, vec, arch) in enumerate([("f32", 1, "sm_80"), ("f32", 2, "sm_80"), ("f64", 1, "sm_90a")]):
        data = tools.fake_cubin(rng, 3000 + 97 * i)
        doc = tools.kernel_doc("axpy", {"dtype": dtype, "vec": vec}, arch, data, entry=f"axpy_{dtype}")
        doc["entries"] = {f"axpy_{dtype}": {"name": f"axpy_{dtype}", "params": ["i32", dtype, "ptr", "ptr"],
                                            "offsets": OFFSETS[dtype]}}  # manifest v2: families need it
        kernels.append(doc)
        blobs[doc["digest"].split(":")[1]] = data
        (package / f"axpy_{dtype}_vec{vec}_{arch}.cubin").write_bytes(data)
    template = {
        "schema": "cubinstore/jit-family/v1", "family": "axpy", "grid_keys": ["dtype", "vec"],
        "source": "kernels/axpy/axpy.cu",
        "bundle": {"digest": "sha256:" + hashlib.sha256(bundle).hexdigest(), "size": len(bundle)},
        "defines": ["DTYPE_{dtype}", "VEC={vec}"], "copts": [], "includes": [],
        "entries": {"axpy_{dtype}": ["i32", "{dtype}", "ptr", "ptr"]}, "archs": ["sm_90a", "sm_80"],
        "package": "kernels/axpy",
    }
    doc = {"schema": "cubinstore/manifest/v2", "kernels": kernels, "families": {"axpy": {"jit": template}}}
    manifest = root / "kernels" / "manifest.json"
    manifest.write_bytes(tools.canonical(doc))
    tree = BuildTree(root, manifest, blobs, hashlib.sha256(bundle).hexdigest())
    assert set(tree.blobs) == {d.hex for d, _ in Manifest.from_path(manifest).blobs}  # the bundle is in the closure
    return tree


@pytest.fixture
def env(cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The CLI's environment (no remote configured), run from an empty directory: no ./bazel-bin of the checkout."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return dict(cli_env, CUBINSTORE_TEST_CWD=str(cwd))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def requests(nginx, url: str, method: str, hex_: str) -> int:
    """Requests ``method`` made for blob ``hex_`` under ``url`` (the server's log is shared by every test)."""
    return nginx.requests(method, f"{url.split(str(nginx.port), 1)[1]}/cas/{hex_}")


# -- 1. publish, pack and prefetch find every member of the closure in a build tree ------------------

def test_publish_from_a_build_tree_uploads_and_reverifies_the_jit_source_bundle(nginx, build_tree, cli, env) -> None:
    url = nginx.base()
    out = cli(["publish", str(build_tree.manifest), "--to", url], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"published {build_tree.digest} (4 blobs) to {url}"
    for hex_, data in build_tree.blobs.items():
        assert requests(nginx, url, "PUT", hex_) == 1 and requests(nginx, url, "GET", hex_) == 1  # uploaded, read back
        assert nginx.file(url, hex_).read_bytes() == data
    bundle_file = build_tree.root / "kernels" / "axpy" / "axpy_jit.sources.json"
    assert nginx.file(url, build_tree.bundle_hex).read_bytes() == bundle_file.read_bytes()
    assert nginx.file(url, build_tree.digest.hex).read_bytes() == build_tree.manifest.read_bytes()


def test_publish_never_uploads_a_tampered_source_bundle_from_the_build_tree(nginx, build_tree, cli, env) -> None:
    path = build_tree.root / "kernels" / "axpy" / "axpy_jit.sources.json"
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x01  # same size: found by size, refused by sha256
    path.write_bytes(bytes(raw))
    url = nginx.base()
    out = cli(["publish", str(build_tree.manifest), "--to", url], env)
    assert out.returncode == 1
    lines = error_lines(out.stderr)
    named = f"cubinstore: error: sha256:{build_tree.bundle_hex} (axpy JIT sources)"
    assert any(line.startswith(named) and "not available" in line for line in lines), out.stderr
    assert lines[-1].endswith("1 problems; manifest not uploaded")
    assert requests(nginx, url, "PUT", build_tree.bundle_hex) == 0 and requests(nginx, url, "PUT", build_tree.digest.hex) == 0


def test_pack_from_a_build_tree_packs_the_jit_source_bundle(build_tree, cli, env, tmp_path: Path) -> None:
    out_tar = tmp_path / "release.tar"
    out = cli(["pack", str(build_tree.manifest), str(out_tar)], env)
    assert out.returncode == 0, out.stderr
    with tarfile.open(out_tar) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert members == {"manifest.json": build_tree.manifest.read_bytes(),
                       **{f"cas/{hex_}": data for hex_, data in build_tree.blobs.items()}}
    # The bundle unpacks (every member re-verified) on a host that never saw the build tree.
    second = dict(env, CUBINSTORE_HOME=str(tmp_path / "second"))
    out = cli(["unpack", str(out_tar), "--expect", str(build_tree.digest)], second)
    assert out.returncode == 0, out.stderr
    bundle = build_tree.blobs[build_tree.bundle_hex]
    assert LocalLayer(tmp_path / "second").status(Digest(build_tree.bundle_hex), len(bundle)) == "ok"


def test_prefetch_from_a_build_tree_stores_the_jit_source_bundle(build_tree, cli, env, clean_env: Path, tmp_path: Path) -> None:
    out = cli(["prefetch", str(build_tree.manifest)], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"prefetched {build_tree.digest}: 4 blobs")
    local = LocalLayer(clean_env)
    for hex_, data in build_tree.blobs.items():
        assert local.path_for(Digest(hex_)).read_bytes() == data
        assert local.status(Digest(hex_), len(data)) == "ok"
    # One arch: its CUBINs and the bundle of the template that compiles for it, nothing else.
    home = tmp_path / "sm80"
    out = cli(["prefetch", str(build_tree.manifest), "--arch", "sm_80"], dict(env, CUBINSTORE_HOME=str(home)))
    assert out.returncode == 0, out.stderr
    manifest = Manifest.from_path(build_tree.manifest)
    wanted = {k.digest.hex for k in manifest.kernels if k.arch == "sm_80"} | {build_tree.bundle_hex}
    stored = {p.name for p in (home / "v1" / "cas").rglob("*") if p.is_file()} - {build_tree.digest.hex}
    assert stored == wanted


# -- 2. a failure about the store is one line ----------------------------------------------------------

def _bundle_of(build_tree: BuildTree, tmp_path: Path) -> Path:
    source = LocalLayer(tmp_path / "packer")
    for hex_, data in build_tree.blobs.items():
        source.write(Digest(hex_), data)
    out = tmp_path / "release.tar"
    pack(Manifest.from_path(build_tree.manifest), Store([source]), out)
    return out


@pytest.mark.parametrize("command", ["prefetch", "pack", "unpack", "verify", "verify-manifest", "gc", "stats", "ls",
                                     "warmset-prefetch"])
def test_a_store_root_that_is_a_file_is_one_error_line(build_tree, cli, env, tmp_path: Path, command: str) -> None:
    home = tmp_path / "not-a-directory"
    home.write_bytes(b"")
    manifest = str(build_tree.manifest)
    if command == "unpack":
        args = ["unpack", str(_bundle_of(build_tree, tmp_path))]
    else:
        args = {
            "prefetch": ["prefetch", manifest], "pack": ["pack", manifest, str(tmp_path / "out.tar")],
            "verify": ["verify"], "verify-manifest": ["verify", manifest], "gc": ["gc", "--max-bytes", "0"],
            "stats": ["stats"], "ls": ["ls", manifest], "warmset-prefetch": ["warmset", "prefetch", manifest],
        }[command]
    out = cli(args, dict(env, CUBINSTORE_HOME=str(home), CUBINSTORE_FETCH_JOBS="4"))
    assert out.returncode == 1, out.stderr
    assert error_lines(out.stderr) == [f"cubinstore: error: cannot open store directory {home}: Not a directory"], out.stderr


def test_prefetch_into_a_store_others_can_write_is_one_error_line(nginx, build_tree, cli, env, tmp_path: Path) -> None:
    url = nginx.base()
    remote = HttpLayer(url)
    for hex_, data in build_tree.blobs.items():
        remote.put(Digest(hex_), data)
    home = tmp_path / "shared"
    home.mkdir()
    os.chmod(home, 0o777)
    manifest = tmp_path / "manifest.json"  # not in the build tree: every blob comes from the remote
    shutil.copy(build_tree.manifest, manifest)
    out = cli(["prefetch", str(manifest), "--remote", url], dict(env, CUBINSTORE_HOME=str(home)))
    assert out.returncode == 1
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"cubinstore: error: refusing to write to the store at {home}: {home} is writable by group and others")
    assert not (home / "v1" / "cas").exists() or not any(p.is_file() for p in (home / "v1" / "cas").rglob("*"))


class _BreakingServer:
    """An HTTP CAS on loopback serving ``blobs`` that, on its first blob request, replaces the
    client's store root with a regular file before answering: the store fails mid-prefetch,
    after the command has opened it, at a point set by the request (no timing involved)."""

    def __init__(self, blobs: dict[str, bytes], home: Path) -> None:
        self.requests = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hex_ = self.path.rsplit("/", 1)[-1]
                with lock:
                    outer.requests += 1
                    if home.is_dir():
                        shutil.rmtree(home)
                        home.write_bytes(b"")
                body = blobs.get(hex_)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body or b"")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> _BreakingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def many_blobs(tools, tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A manifest of 24 kernels (outside any build tree) and their bytes."""
    rng = random.Random(58)
    kernels, blobs = [], {}
    for i in range(24):
        data = tools.fake_cubin(rng, 2000 + i)
        doc = tools.kernel_doc("axpy", {"dtype": "f32", "vec": i + 1}, "sm_80", data, entry="axpy_f32")
        kernels.append(doc)
        blobs[doc["digest"].split(":")[1]] = data
    path = tmp_path / "many" / "manifest.json"
    path.parent.mkdir()
    path.write_bytes(tools.canonical({"schema": "cubinstore/manifest/v1", "kernels": kernels}))
    return path, blobs


@pytest.mark.parametrize("jobs", ["1", "4"])
def test_a_store_that_breaks_during_prefetch_is_one_error_line(many_blobs, cli, env, tmp_path: Path, jobs: str) -> None:
    manifest, blobs = many_blobs
    home = tmp_path / "home-breaks"
    home.mkdir()
    with _BreakingServer(blobs, home) as server:
        out = cli(["prefetch", str(manifest), "--remote", server.url],
                  dict(env, CUBINSTORE_HOME=str(home), CUBINSTORE_FETCH_JOBS=jobs))
    assert home.is_file()  # the server did break it
    assert out.returncode == 1, out.stderr
    assert error_lines(out.stderr) == [f"cubinstore: error: cannot open store directory {home}: Not a directory"], out.stderr
    assert server.requests <= int(jobs)  # stopped: no blob requested after the store failed, but those in flight


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a private mount namespace")
def test_a_full_store_filesystem_stops_prefetch_with_one_error_line(nginx, cli, env, tmp_path: Path, tools) -> None:
    rng = random.Random(99)
    kernels, blobs = [], {}
    for i in range(16):  # 16 x 40 KB into a 256 KB filesystem
        data = tools.fake_cubin(rng, 40_000 + i)
        doc = tools.kernel_doc("axpy", {"dtype": "f32", "vec": i + 1}, "sm_80", data, entry="axpy_f32")
        kernels.append(doc)
        blobs[doc["digest"].split(":")[1]] = data
    manifest = tmp_path / "full" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_bytes(tools.canonical({"schema": "cubinstore/manifest/v1", "kernels": kernels}))
    url = nginx.base()
    remote = HttpLayer(url)
    for hex_, data in blobs.items():
        remote.put(Digest(hex_), data)
    home = tmp_path / "small"
    home.mkdir()
    # The tmpfs exists only in the child's own mount namespace: nothing to unmount, nothing left mounted.
    script = 'mount -t tmpfs -o size=256k,mode=0755 tmpfs "$1" 2>/dev/null || exit 77; shift; exec "$@"'
    child_env = dict(env, CUBINSTORE_HOME=str(home), CUBINSTORE_FETCH_JOBS="1")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(home), sys.executable, "-m", "cubinstore",
                          "prefetch", str(manifest), "--remote", url],
                         env=child_env, capture_output=True, text=True, timeout=120, cwd=env["CUBINSTORE_TEST_CWD"])
    if out.returncode == 77 or "unshare:" in out.stderr:
        pytest.skip("no private mount namespace with a tmpfs here (needs root or user namespaces)")
    assert out.returncode == 1, out.stderr
    full = f"cubinstore: error: cannot write to the store at {home}: No space left on device"
    assert error_lines(out.stderr) == [full], out.stderr
    assert sum(requests(nginx, url, "GET", hex_) for hex_ in blobs) < len(blobs)  # stopped at the first full write


def test_warmset_prefetch_into_a_store_others_can_write_is_one_error_line(nginx, build_tree, cli, env,
                                                                          tmp_path: Path) -> None:
    from cubinstore.internals import warmset as _warmset

    url = nginx.base()
    remote = HttpLayer(url)
    for hex_, data in build_tree.blobs.items():
        remote.put(Digest(hex_), data)
    manifest = tmp_path / "manifest.json"  # not in the build tree: every blob comes from the remote
    shutil.copy(build_tree.manifest, manifest)
    home = tmp_path / "shared"
    local = LocalLayer(home)
    kernels = Manifest.from_path(manifest).kernels
    for k in kernels:  # every kernel is warm, recorded while the store was still private
        _warmset.record(local, kind="miss", family=k.family, params=k.params, arch=k.arch)
    os.chmod(home, 0o777)
    out = cli(["warmset", "prefetch", str(manifest), "--remote", url], dict(env, CUBINSTORE_HOME=str(home)))
    assert out.returncode == 1
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"cubinstore: error: refusing to write to the store at {home}"), out.stderr
