"""A remote cache shared by CI (reads and writes: --config=ci) and production (reads only:
--config=readonly), with nginx (WebDAV, HTTP) and with BuildGrid (REAPI, gRPC) started here
on loopback.

Bazel ignores failed uploads silently, so an upload is proven, never assumed: every CUBIN of
the CI build's manifest is read back from the server by digest and hashed, and a production
checkout elsewhere, with its own output base and no disk cache, builds nothing.
"""

from __future__ import annotations

import hashlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import cubinstore

from ._servers import BuildGridCache, NginxCache
from ._workspace import (
    ALL_TARGETS, MANIFEST, PTX_COMPILE, BuildResult, Workspace, compiled_targets, find_bgd, find_nginx,
)
from .conftest import Checkouts, unavailable

pytestmark = pytest.mark.bazel


def _ci_build(ws: Workspace, url: str) -> BuildResult:
    # No disk cache: a disk-cache hit is never uploaded, and each action must run to be uploaded.
    return ws.build(ALL_TARGETS, disk_cache=None, flags=["--config=ci", f"--remote_cache={url}"])


def _production_build(ws: Workspace, url: str) -> BuildResult:
    return ws.build(ALL_TARGETS, disk_cache=None, flags=["--config=readonly", f"--remote_cache={url}"])


def _blobs(manifest: dict) -> dict[str, int]:
    """hex digest -> size of every CUBIN the manifest names."""
    return {k["digest"].removeprefix("sha256:"): k["size"] for k in manifest["kernels"]}


def _assert_cold(ci: BuildResult) -> None:
    compiles = ci.by_label()
    assert compiles and ci.hits() == set(), f"the CI build must compile everything itself (log: {ci.log})"


def _assert_all_remote_hits(production: BuildResult, ci: BuildResult) -> None:
    instantiations = compiled_targets(ci.manifest_json())
    assert set(production.by_label()) == instantiations
    assert production.misses() == set(), f"production recompiled (log: {production.log})"
    assert set(production.by_label(PTX_COMPILE)) == compiled_targets(ci.manifest_json(), PTX_COMPILE)
    assert production.misses(PTX_COMPILE) == set()
    assert production.by_label(MANIFEST) == {"//kernels:manifest": True}
    assert production.manifest == ci.manifest


# -- nginx (HTTP) -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxCache]:
    nginx = find_nginx()
    if nginx is None:
        unavailable("nginx not found (tools/bootstrap.sh installs nginx-light)")
    server = NginxCache(tmp_path_factory.mktemp("nginx_cache"), nginx)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http_ci(checkouts: Checkouts, http_cache: NginxCache) -> BuildResult:
    return _ci_build(checkouts.shallow, http_cache.url)


def test_ci_build_uploads_every_cubin_to_the_http_cache(http_ci: BuildResult, http_cache: NginxCache) -> None:
    _assert_cold(http_ci)
    for hex_digest, size in _blobs(http_ci.manifest_json()).items():
        stored = http_cache.blob(hex_digest)
        assert stored.is_file(), f"{http_cache.url}/cas/{hex_digest} was never uploaded"
        with urllib.request.urlopen(f"{http_cache.url}/cas/{hex_digest}", timeout=30) as response:
            served = response.read()
        assert (hashlib.sha256(served).hexdigest(), len(served)) == (hex_digest, size)
        assert served == stored.read_bytes()
    manifest_hex = hashlib.sha256(http_ci.manifest or b"").hexdigest()
    assert http_cache.blob(manifest_hex).is_file(), "manifest.json was never uploaded"
    # One action result per action that ran: every CubinCompile plus the CubinManifest.
    ran = [s for s in http_ci.spawns if not s.cache_hit]
    assert len(http_cache.action_results()) >= len(ran)


def test_production_checkout_takes_every_action_from_the_http_cache(
        checkouts: Checkouts, http_ci: BuildResult, http_cache: NginxCache) -> None:
    puts = http_cache.requests("PUT")
    production = _production_build(checkouts.deep, http_cache.url)

    _assert_all_remote_hits(production, http_ci)
    assert http_cache.requests("PUT") == puts, "--config=readonly uploaded to the cache"


def test_runtime_fetches_the_release_by_digest_from_the_cache_ci_filled(
        http_ci: BuildResult, http_cache: NginxCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Production: only the manifest's digest and the cache URL; every byte verified on the way in.
    home = tmp_path / "home"
    monkeypatch.setenv("CUBINSTORE_HOME", str(home))
    monkeypatch.setenv("CUBINSTORE_REMOTE", http_cache.url)
    release = "sha256:" + hashlib.sha256(http_ci.manifest or b"").hexdigest()
    library = cubinstore.open(release)
    assert library.manifest.raw == http_ci.manifest
    for spec in library.manifest.kernels:
        data = library.store.get(spec.digest, spec.size, name=spec.id)
        assert hashlib.sha256(data).hexdigest() == spec.digest.hex
        assert (home / "v1" / "cas" / spec.digest.hex[:2] / spec.digest.hex).read_bytes() == data


# -- BuildGrid (gRPC) -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuildGridCache]:
    bgd = find_bgd()
    if bgd is None:
        unavailable("BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    server = BuildGridCache(tmp_path_factory.mktemp("buildgrid_cache"), bgd)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def grpc_ci(checkouts: Checkouts, grpc_cache: BuildGridCache) -> BuildResult:
    # CI in the deep checkout this time: production is the shallow one.
    return _ci_build(checkouts.deep, grpc_cache.url)


def test_buildgrid_serves_every_cubin_of_the_ci_manifest_by_digest(
        grpc_ci: BuildResult, grpc_cache: BuildGridCache, tmp_path: Path) -> None:
    _assert_cold(grpc_ci)
    blobs = _blobs(grpc_ci.manifest_json())
    fetched = grpc_cache.download(blobs, tmp_path / "fetched")
    for hex_digest, size in blobs.items():
        data = fetched[hex_digest]
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (hex_digest, size)


def test_production_checkout_takes_every_action_from_buildgrid(
        checkouts: Checkouts, grpc_ci: BuildResult, grpc_cache: BuildGridCache) -> None:
    production = _production_build(checkouts.shallow, grpc_cache.url)
    _assert_all_remote_hits(production, grpc_ci)


# -- both -----------------------------------------------------------------------------------------------

def test_cold_ci_builds_at_two_paths_give_byte_identical_manifests(
        http_ci: BuildResult, grpc_ci: BuildResult) -> None:
    # Both compiled everything, in checkouts of different depth with different output bases:
    # CUBIN bytes must not depend on where the workspace lives.
    _assert_cold(http_ci)
    _assert_cold(grpc_ci)
    assert http_ci.manifest is not None
    assert grpc_ci.manifest == http_ci.manifest
