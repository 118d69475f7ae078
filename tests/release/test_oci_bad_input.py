"""Bad input from a registry gets a clear error naming registry, repository and digest; nothing
unverified reaches the local store, and what was verified stays (the issue's "Bad input" list)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest
from cubinstore.errors import IntegrityError, MissingBlobError
from cubinstore.internals import load_manifest, release_artifact
from cubinstore.store import LocalLayer, Store
from cubinstore.store.oci.artifact import (
    IMAGE_MANIFEST,
    MANIFEST_MEDIA_TYPE,
    RELEASE_ARTIFACT,
    Descriptor,
    build_artifact,
)
from cubinstore.store.oci.remote import OciLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def push_release(repo: str, release, *, artifact: bytes | None = None) -> tuple[OciLayer, Digest]:
    """The release's blobs, manifest and (unless given) artifact, pushed with the library's client."""
    manifest = Manifest.from_path(release.path)
    registry = OciLayer(repo, push=True)
    for hex_, data in release.blobs.items():
        registry.put(Digest(hex_), data)
    registry.put(manifest.digest, manifest.raw)
    raw = artifact if artifact is not None else release_artifact(manifest)
    registry.put_manifest(Digest.of(raw), raw)
    return registry, Digest.of(raw)


def test_a_blob_the_registry_lost_fails_prefetch_naming_it_and_the_rest_stays(registry, make_release, cli,
                                                                               cli_env, tmp_path: Path) -> None:
    release = make_release(n=3)
    repo = registry.repo()
    _, artifact = push_release(repo, release)
    lost = sorted(release.blobs)[1]
    registry.blob_file(lost).unlink()  # garbage-collected under the artifact
    env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "h"))
    out = cli(["prefetch", f"{repo}@{artifact}"], env)
    assert out.returncode == 1
    assert f"sha256:{lost}" in out.stderr and repo in out.stderr
    assert "1 of 3 blobs failed" in out.stderr
    local = LocalLayer(tmp_path / "h")
    for hex_, data in release.blobs.items():
        path = local.path_for(Digest(hex_))
        assert (not path.exists()) if hex_ == lost else path.read_bytes() == data


def test_a_blob_changed_in_registry_storage_never_reaches_the_store(registry, make_release, cli, cli_env,
                                                                    tmp_path: Path) -> None:
    release = make_release(n=2)
    repo = registry.repo()
    _, artifact = push_release(repo, release)
    victim = sorted(release.blobs)[0]
    path = registry.blob_file(victim)
    data = bytearray(path.read_bytes())
    data[50] ^= 0x40
    path.write_bytes(bytes(data))
    env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "h"))
    out = cli(["prefetch", f"{repo}@{artifact}"], env)
    assert out.returncode == 1
    assert f"registry {repo}: digest mismatch for sha256:{victim}" in out.stderr
    assert not LocalLayer(tmp_path / "h").path_for(Digest(victim)).exists()


def test_an_artifact_of_another_type_is_refused(registry, make_release, clean_env: Path) -> None:
    release = make_release(n=1)
    manifest = Manifest.from_path(release.path)
    config = Descriptor(MANIFEST_MEDIA_TYPE, manifest.digest, len(manifest.raw), {})
    other = build_artifact(config, [], "application/vnd.example.sbom.v1")
    repo = registry.repo()
    _, artifact = push_release(repo, release, artifact=other)
    with pytest.raises(IntegrityError) as info:
        load_manifest(f"{repo}@{artifact}", Store([LocalLayer(clean_env)]))
    assert str(info.value) == (f"artifact {repo}@{artifact}: artifactType 'application/vnd.example.sbom.v1', "
                               f"expected '{RELEASE_ARTIFACT}': not a cubinstore release")
    assert not LocalLayer(clean_env).path_for(artifact).exists()


def test_a_config_that_is_not_a_cubinstore_manifest_is_refused_and_not_kept(registry, make_release,
                                                                            clean_env: Path) -> None:
    release = make_release(n=1)
    repo = registry.repo()
    junk = b'{"architecture":"amd64","os":"linux"}'
    registry_store = OciLayer(repo, push=True)
    registry_store.put(Digest.of(junk), junk)
    forged = build_artifact(Descriptor(MANIFEST_MEDIA_TYPE, Digest.of(junk), len(junk), {}), [], RELEASE_ARTIFACT)
    _, artifact = push_release(repo, release, artifact=forged)
    with pytest.raises(IntegrityError) as info:
        load_manifest(f"{repo}@{artifact}", Store([LocalLayer(clean_env)]))
    assert str(info.value).startswith(f"config {Digest.of(junk)} of artifact {repo}@{artifact} is not a cubinstore "
                                      "manifest: ")
    assert not LocalLayer(clean_env).path_for(Digest.of(junk)).exists()


def test_an_artifact_lacking_a_blob_of_its_manifest_is_refused(registry, make_release, clean_env: Path) -> None:
    release = make_release(n=2)
    manifest = Manifest.from_path(release.path)
    config = Descriptor(MANIFEST_MEDIA_TYPE, manifest.digest, len(manifest.raw), {})
    short = build_artifact(config, [], RELEASE_ARTIFACT)
    repo = registry.repo()
    _, artifact = push_release(repo, release, artifact=short)
    with pytest.raises(IntegrityError, match=rf"^artifact {repo}@{artifact} lacks 2 blob\(s\) of its manifest"):
        load_manifest(f"{repo}@{artifact}", Store([LocalLayer(clean_env)]))


def test_a_registry_serving_other_bytes_for_a_pinned_artifact_is_refused(clean_env: Path) -> None:
    wrong = b'{"schemaVersion":2}'

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", IMAGE_MANIFEST)
            self.send_header("Content-Length", str(len(wrong)))
            self.end_headers()
            self.wfile.write(wrong)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        repo = f"oci://127.0.0.1:{httpd.server_address[1]}/team/k"
        pinned = Digest.of(b"the artifact that was published")
        with pytest.raises(IntegrityError) as info:
            load_manifest(f"{repo}@{pinned}", Store([LocalLayer(clean_env)]))
        assert f"manifest {repo}@{pinned}: the registry served bytes that hash to {Digest.of(wrong)}; refused" in str(
            info.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_oversized_artifact_manifest_is_refused_unread(clean_env: Path) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(64 * 1024 * 1024))
            self.end_headers()
            self.wfile.write(b"{" * 1024)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        repo = f"oci://127.0.0.1:{httpd.server_address[1]}/team/k"
        pinned = Digest.of(b"x")
        with pytest.raises(IntegrityError) as info:
            load_manifest(f"{repo}@{pinned}", Store([LocalLayer(clean_env)]))
        assert "server declares 67108864 bytes, expected at most 4194304; not downloaded" in str(info.value)
        assert f"{repo}@{pinned}" in str(info.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_missing_artifact_is_a_clean_miss(registry, clean_env: Path) -> None:
    repo = registry.repo()
    pinned = Digest.of(b"never published")
    with pytest.raises(MissingBlobError, match=rf"^artifact {repo}@{pinned} not available: registry {repo}: miss"):
        load_manifest(f"{repo}@{pinned}", Store([LocalLayer(clean_env)]))


def test_the_artifact_digest_is_a_function_of_the_manifest_alone(make_release) -> None:
    release = make_release(n=3, seed=5)
    manifest = Manifest.from_path(release.path)
    assert release_artifact(manifest) == release_artifact(Manifest.from_bytes(release.raw))
    doc = json.loads(release_artifact(manifest))
    assert [layer["digest"] for layer in doc["layers"]] == sorted(layer["digest"] for layer in doc["layers"])
