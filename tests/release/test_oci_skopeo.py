"""Other tools carry a release: `skopeo copy` (Debian's skopeo) takes the artifact cubinstore pushed
to another registry and to an `oci:` layout directory, and cubinstore opens, prefetches and
verifies it from each copy; `skopeo inspect --raw` shows the manifest a person reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers.registry import find_skopeo

from cubinstore import Digest, Manifest
from cubinstore.errors import IntegrityError
from cubinstore.internals import load_manifest
from cubinstore.store import LocalLayer, Store
from cubinstore.store.oci.artifact import RELEASE_ARTIFACT

pytestmark = pytest.mark.usefixtures("clean_env")


def skopeo(*args: str) -> str:
    proc = subprocess.run([str(find_skopeo()), "--insecure-policy", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def docker_ref(oci_url: str) -> str:
    return "docker://" + oci_url.split("://", 1)[1]


@pytest.fixture
def pushed(registry, make_release, cli, cli_env, clean_env: Path):
    release = make_release(n=3)
    local = LocalLayer(clean_env)
    for hex_, data in release.blobs.items():
        local.write(Digest(hex_), data)
    repo = registry.repo()
    out = cli(["publish", str(release.path), "--to", f"{repo}:v1"], cli_env)
    assert out.returncode == 0, out.stderr
    return release, repo, out.stdout.strip().splitlines()[-1]


def test_skopeo_inspect_raw_shows_the_artifact(pushed) -> None:
    release, repo, pinned = pushed
    raw = skopeo("inspect", "--raw", "--tls-verify=false", docker_ref(pinned))
    doc = json.loads(raw)
    assert doc["artifactType"] == RELEASE_ARTIFACT
    assert raw.startswith("{\n  \"artifactType\"")  # indented for people
    assert Digest.of(raw.encode()) == Digest.parse(pinned.split("@")[1])


def test_skopeo_copy_to_another_registry_keeps_the_digest_and_cubinstore_prefetches_from_the_copy(
        pushed, registry, cli, cli_env, tmp_path: Path) -> None:
    release, repo, pinned = pushed
    artifact = pinned.split("@")[1]
    copy = registry.repo("copied")
    skopeo("copy", "--src-tls-verify=false", "--dest-tls-verify=false", docker_ref(pinned), docker_ref(copy) + ":v1")
    env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "from-copy"))
    out = cli(["prefetch", f"{copy}@{artifact}"], env)
    assert out.returncode == 0, out.stderr
    assert "3 downloaded" in out.stdout
    for hex_, data in release.blobs.items():
        assert LocalLayer(tmp_path / "from-copy").path_for(Digest(hex_)).read_bytes() == data


def test_skopeo_copy_to_an_oci_layout_opens_with_cubinstore(pushed, tmp_path: Path) -> None:
    release, repo, pinned = pushed
    artifact = pinned.split("@")[1]
    layout = tmp_path / "layout"
    skopeo("copy", "--src-tls-verify=false", docker_ref(pinned), f"oci:{layout}:v1")
    store = Store([LocalLayer(tmp_path / "host")])
    manifest = load_manifest(f"oci-layout:{layout}@{artifact}", store)
    assert manifest.digest == Manifest.from_path(release.path).digest
    for kernel in release.doc["kernels"]:
        assert store.get(kernel["digest"], kernel["size"]) == release.blobs[kernel["digest"].split(":")[1]]
    # A blob changed in the copy is refused, never stored.
    victim = release.doc["kernels"][0]
    path = layout / "blobs" / "sha256" / victim["digest"].split(":")[1]
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    fresh = Store([LocalLayer(tmp_path / "host2")])
    load_manifest(f"oci-layout:{layout}:v1", fresh)
    with pytest.raises(IntegrityError, match=f"^{victim['digest']}"):
        fresh.get(victim["digest"], victim["size"])
    assert not LocalLayer(tmp_path / "host2").path_for(Digest.parse(victim["digest"])).exists()
