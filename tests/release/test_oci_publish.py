"""A release as one OCI artifact in a real registry (Debian's docker-registry on loopback):
publish, open by artifact digest, prefetch, re-publish, a tag, and what the registry holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cubinstore
from cubinstore import Digest, Manifest
from cubinstore.internals import OCI_PREFIXES, load_manifest
from cubinstore.store import LocalLayer, Store
from cubinstore.store.oci.artifact import (
    IMAGE_MANIFEST,
    KERNELS_ANNOTATION,
    MANIFEST_MEDIA_TYPE,
    RELEASE_ARTIFACT,
)
from cubinstore.store.oci.reference import LAYOUT_SCHEME, SCHEMES
from cubinstore.store.oci.remote import OciLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def fill_local(home: Path, blobs: dict[str, bytes]) -> LocalLayer:
    local = LocalLayer(home)
    for hex_, data in blobs.items():
        local.write(Digest(hex_), data)
    return local


def publish(cli, env, ref: str, to: str):
    out = cli(["publish", ref, "--to", to], env)
    assert out.returncode == 0, out.stderr
    pinned = out.stdout.strip().splitlines()[-1]
    return out, pinned


def test_the_oci_prefixes_of_refs_are_the_registry_schemes() -> None:
    assert OCI_PREFIXES == (*SCHEMES, LAYOUT_SCHEME)  # spelled twice so a path never imports the store: checked here


def test_publish_pushes_one_artifact_and_a_second_store_opens_it_by_digest(
        registry, make_release, cli, cli_env, clean_env: Path, tmp_path: Path) -> None:
    release = make_release(n=4)
    fill_local(clean_env, release.blobs)
    repo = registry.repo()
    out, pinned = publish(cli, cli_env, str(release.path), f"{repo}:v1")
    digest = Manifest.from_path(release.path).digest
    assert pinned.startswith(f"{repo}@sha256:")
    assert f"published {digest} (4 blobs, 5 uploaded, 0 already there) to {repo} tagged v1 as artifact" in out.stdout
    artifact = Digest.parse(pinned.split("@", 1)[1])

    # What the registry holds: an image manifest of our artifactType, the manifest as config,
    # each CUBIN a layer under its own digest, annotated with its kernel ids.
    found = OciLayer(repo).get_manifest(artifact)
    assert found is not None
    doc = json.loads(found[1])
    assert doc["mediaType"] == IMAGE_MANIFEST and doc["artifactType"] == RELEASE_ARTIFACT
    assert doc["config"] == {"mediaType": MANIFEST_MEDIA_TYPE, "digest": str(digest), "size": len(release.raw)}
    assert sorted(layer["digest"] for layer in doc["layers"]) == sorted(f"sha256:{h}" for h in release.blobs)
    ids = {k["digest"]: k["id"] for k in release.doc["kernels"]}
    assert all(layer["annotations"][KERNELS_ANNOTATION] == ids[layer["digest"]] for layer in doc["layers"])
    for hex_, data in release.blobs.items():
        assert registry.blob_file(hex_).read_bytes() == data

    # Another host: an empty store, the pinned reference only.
    home = tmp_path / "production"
    store = Store([LocalLayer(home)])
    lib_manifest = load_manifest(pinned, store)
    assert lib_manifest.digest == digest
    assert any(isinstance(layer, OciLayer) for layer in store.layers)  # the kernels come from the registry
    kernel = release.doc["kernels"][0]
    assert store.get(kernel["digest"], kernel["size"]) == release.blobs[kernel["digest"].split(":")[1]]
    assert LocalLayer(home).path_for(Digest.parse(kernel["digest"])).is_file()


def test_prefetch_of_the_pinned_artifact_fills_an_empty_store(registry, make_release, cli, cli_env,
                                                             clean_env: Path, tmp_path: Path) -> None:
    release = make_release(n=3)
    fill_local(clean_env, release.blobs)
    _, pinned = publish(cli, cli_env, str(release.path), registry.repo())
    second = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "second"))
    out = cli(["prefetch", pinned], second)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"prefetched {Manifest.from_path(release.path).digest}: 3 blobs, 3 downloaded")
    local = LocalLayer(tmp_path / "second")
    for hex_, data in release.blobs.items():
        assert local.path_for(Digest(hex_)).read_bytes() == data
    # Offline afterwards: the artifact and its manifest were kept, so the same reference opens.
    offline = dict(second, CUBINSTORE_OFFLINE="1")
    out = cli(["prefetch", pinned], offline)
    assert out.returncode == 0, out.stderr
    assert "0 downloaded" in out.stdout


def test_remote_in_cubinstore_remote_serves_a_sha256_reference(registry, make_release, cli, cli_env,
                                                               clean_env: Path, tmp_path: Path) -> None:
    release = make_release(n=2)
    fill_local(clean_env, release.blobs)
    repo = registry.repo()
    publish(cli, cli_env, str(release.path), repo)
    digest = Manifest.from_path(release.path).digest
    env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "p"), CUBINSTORE_REMOTE=repo)
    out = cli(["prefetch", str(digest)], env)  # the manifest is a blob of the repository too
    assert out.returncode == 0, out.stderr
    assert "2 downloaded" in out.stdout


def test_a_second_release_changing_one_kernel_uploads_one_cubin_and_the_manifests(
        registry, make_release, tools, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=4, seed=11)
    fill_local(clean_env, release.blobs)
    repo = registry.repo()
    publish(cli, cli_env, str(release.path), f"{repo}:v1")
    # v2: one kernel rebuilt (new bytes), the other three unchanged.
    doc = json.loads(release.raw)
    changed = doc["kernels"][0]
    data = tools.fake_cubin(__import__("random").Random(99), changed["size"])
    doc["kernels"][0] = tools.kernel_doc("axpy", changed["params"], changed["arch"], data,
                                         entry=next(iter(changed["entries"])))
    v2 = release.path.parent / "v2.json"
    v2.write_bytes(tools.canonical(doc))
    fill_local(clean_env, {doc["kernels"][0]["digest"].split(":")[1]: data})
    uploads_before = registry.requests("PUT", f"/v2/{repo.split('/', 3)[3]}/blobs/uploads/")
    out, pinned = publish(cli, cli_env, str(v2), f"{repo}:v2")
    uploads = registry.requests("PUT", f"/v2/{repo.split('/', 3)[3]}/blobs/uploads/") - uploads_before
    assert uploads == 2  # the new CUBIN and the new manifest (the config); the artifact manifest is not a blob
    assert "2 uploaded, 3 already there" in out.stdout
    assert registry.requests("PUT", "/manifests/v2") == 1


def test_an_interrupted_push_resumed_uploads_only_what_is_missing(registry, make_release, cli, cli_env,
                                                                 clean_env: Path) -> None:
    release = make_release(n=4)
    fill_local(clean_env, release.blobs)
    repo = registry.repo()
    # The interrupted push: two blobs went up, no artifact manifest.
    remote = OciLayer(repo)
    first_two = sorted(release.blobs)[:2]
    pusher = OciLayer(repo + ":x", push=True)
    for hex_ in first_two:
        pusher.put(Digest(hex_), release.blobs[hex_])
    assert remote.get_manifest("x") is None
    out, _ = publish(cli, cli_env, str(release.path), repo)
    assert "3 uploaded, 2 already there" in out.stdout  # two CUBINs and the manifest
    for hex_ in first_two:
        assert registry.requests("PUT", f"digest=sha256%3A{hex_}") == 1  # never again


def test_open_by_tag_logs_the_digest_it_resolved_to(registry, make_release, cli, cli_env, clean_env: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    release = make_release(n=1)
    fill_local(clean_env, release.blobs)
    repo = registry.repo()
    _, pinned = publish(cli, cli_env, str(release.path), f"{repo}:stable")
    with caplog.at_level("WARNING", logger="cubinstore"):
        manifest = load_manifest(f"{repo}:stable", Store([LocalLayer(clean_env)]))
    assert manifest.digest == Manifest.from_path(release.path).digest
    assert f"{repo}:stable resolved to {pinned}; a tag can move" in caplog.text


def test_cubinstore_open_of_a_pinned_artifact_builds_a_library(registry, make_release, cli, cli_env,
                                                               clean_env: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    release = make_release(n=2)
    fill_local(clean_env, release.blobs)
    _, pinned = publish(cli, cli_env, str(release.path), registry.repo())
    monkeypatch.setenv("CUBINSTORE_HOME", str(tmp_path / "fresh"))
    library = cubinstore.open(pinned)
    assert library.manifest.digest == Manifest.from_path(release.path).digest
    # The registry joined the Library's own store, not the process's default one others share;
    # and a kernel's bytes come from the registry through it, verified.
    from cubinstore.store import default_store
    from cubinstore.store.oci.remote import OciLayer

    assert any(isinstance(layer, OciLayer) for layer in library.store.layers)
    assert not any(isinstance(layer, OciLayer) for layer in default_store().layers)
    spec = next(iter(library.manifest))
    assert library.store.get(spec.digest, spec.size) == release.blobs[spec.digest.hex]


def test_publish_from_one_registry_to_another_with_an_empty_local_store(
        registry, make_release, cli, cli_env, clean_env: Path, tmp_path: Path) -> None:
    # A promotion: staging's repository to production's, through a host that holds nothing.
    release = make_release(n=3)
    fill_local(clean_env, release.blobs)
    staging, production = registry.repo("staging"), registry.repo("production")
    publish(cli, cli_env, str(release.path), staging)
    env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "empty"))
    out = cli(["publish", str(release.path), "--from", staging, "--to", production], env)
    assert out.returncode == 0, out.stderr
    pinned = out.stdout.strip().splitlines()[-1]
    assert pinned.startswith(f"{production}@sha256:")
    store = Store([LocalLayer(tmp_path / "check"), OciLayer(production)])
    for hex_, data in release.blobs.items():
        assert store.get(Digest(hex_), len(data)) == data  # every blob there, read back and verified
