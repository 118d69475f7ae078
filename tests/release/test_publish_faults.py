"""`cubinstore publish` against servers that fail it: a server that answers 201/204 to a blob PUT
but keeps nothing, and a publisher killed (SIGKILL) between its blob uploads and the manifest.

RELIABILITY.md, "Build and upload side": an upload that fails silently is detected and publish
says so; a CI job killed between blob upload and manifest publish leaves no published manifest
that references a missing blob, and running publish again completes the release.

The kill tests hold one request open in the server (``FaultyServer``'s ``hold`` action), wait
for the server's signal that it arrived, and only then kill the child: no timer decides when.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest
from cubinstore.store import LocalLayer
from cubinstore.store.oci.remote import OciLayer

pytestmark = pytest.mark.usefixtures("clean_env")

# The longest the test waits for the child to reach the held request (it is there in well under
# a second); a dead child is noticed at once, see `kill_when_held`.
REACH_S = 60


def fill_local(home: Path, blobs: dict[str, bytes]) -> LocalLayer:
    local = LocalLayer(home)
    for hex_, data in blobs.items():
        local.write(Digest(hex_), data)
    return local


def verifies(hex_: str, size: int, data: bytes | None) -> bool:
    return data is not None and len(data) == size and hashlib.sha256(data).hexdigest() == hex_


def sequential(env: dict[str, str]) -> dict[str, str]:
    # One upload at a time, so "the k-th blob PUT" is a fixed blob and what precedes it is known;
    # no retry, so a held request is never sent again behind the test's back.
    return {**env, "CUBINSTORE_FETCH_JOBS": "1", "CUBINSTORE_HTTP_RETRIES": "0"}


def kill_when_held(args: list[str], env: dict[str, str], arrived: threading.Event) -> None:
    """Run ``python -m cubinstore ARGS``, wait for the server's ``arrived`` signal, SIGKILL it."""
    child = subprocess.Popen([sys.executable, "-m", "cubinstore", *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + REACH_S
        # The signal decides; the short wait only lets a child that died early fail the test now.
        while not arrived.wait(0.05):
            if child.poll() is not None or time.monotonic() > deadline:
                out, errs = child.communicate(timeout=10) if child.poll() is not None else ("", "")
                pytest.fail(f"publish never reached the held request (exit {child.returncode}): {out}{errs}")
        assert child.poll() is None, "publish finished while its request was held"
        child.kill()
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)
    assert child.returncode == -9


# -- an upload the server acknowledged and dropped --------------------------------------------------

@pytest.mark.parametrize("dropped, status", [("one", 201), ("all", 204)])
def test_publish_names_each_blob_the_server_acknowledged_but_did_not_keep(
        faulty, make_release, cli, cli_env, clean_env: Path, dropped: str, status: int) -> None:
    release = make_release(n=4)
    fill_local(clean_env, release.blobs)
    manifest = Manifest.from_path(release.path)
    ids = {k["digest"]: k["id"] for k in release.doc["kernels"]}
    lost = [d for d, _ in manifest.blobs][1:2] if dropped == "one" else [d for d, _ in manifest.blobs]
    for digest in lost:
        # The PUT is answered `status` and its body thrown away; the read-back GET finds nothing (404).
        faulty.script(f"/cas/{digest.hex}", [("status", status), ("ok",)])

    out = cli(["publish", str(release.path), "--to", faulty.url], cli_env)

    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines() == [
        *(f"cubinstore: error: {d} ({ids[str(d)]}) is missing from {faulty.url} after upload" for d in lost),
        f"cubinstore: error: publish {manifest.digest} to {faulty.url}: {len(lost)} problems; manifest not uploaded",
    ]
    assert faulty.count("PUT", f"/cas/{manifest.digest.hex}") == 0
    for digest, _size in manifest.blobs:
        assert faulty.count("PUT", f"/cas/{digest.hex}") == 1  # the 201/204 was taken as success: no retry
        assert faulty.count("GET", f"/cas/{digest.hex}") == 1  # and then read back, which caught it
        assert (f"/cas/{digest.hex}" in faulty.stored) == (digest not in lost)


# -- killed between blob upload and manifest publish: HTTP CAS ------------------------------------

@pytest.mark.parametrize("window, k", [
    ("put", 1),        # the first blob's PUT: nothing on the server yet
    ("put", 4),        # the last blob's PUT: every other blob up
    ("read-back", 4),  # every blob up, the last one being read back: the manifest is next
])
def test_publish_killed_before_the_manifest_leaves_none_and_a_rerun_completes(
        faulty, make_release, cli, cli_env, clean_env: Path, window: str, k: int) -> None:
    release = make_release(n=4)
    fill_local(clean_env, release.blobs)
    manifest = Manifest.from_path(release.path)
    blobs = list(manifest.blobs)
    held = blobs[k - 1][0]
    arrived, release_held = threading.Event(), threading.Event()
    hold = ("hold", arrived, release_held)
    # One script per path, popped by PUT then GET: hold the PUT, or let it store and hold the GET.
    faulty.script(f"/cas/{held.hex}", [hold, ("ok",)] if window == "put" else [("ok",), hold, ("ok",)])

    try:
        kill_when_held(["publish", str(release.path), "--to", faulty.url], sequential(cli_env), arrived)
        # The held request is still open: what the server holds is what the dead publisher left.
        stored = dict(faulty.stored)
    finally:
        release_held.set()

    assert f"/cas/{manifest.digest.hex}" not in stored
    assert faulty.count("PUT", f"/cas/{manifest.digest.hex}") == 0
    expected = blobs[:k - 1] if window == "put" else blobs
    assert sorted(stored) == sorted(f"/cas/{d.hex}" for d, _ in expected)
    for digest, size in expected:
        assert verifies(digest.hex, size, stored[f"/cas/{digest.hex}"]), digest

    out = cli(["publish", str(release.path), "--to", faulty.url], cli_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"published {manifest.digest} (4 blobs) to {faulty.url}"
    assert faulty.stored[f"/cas/{manifest.digest.hex}"] == release.raw
    for digest, size in blobs:
        assert verifies(digest.hex, size, faulty.stored.get(f"/cas/{digest.hex}")), digest


# -- killed between blob upload and artifact push: OCI registry -----------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_oci_publish_killed_before_the_artifact_leaves_none_and_a_rerun_completes(
        registry, faulty, make_release, cli, cli_env, clean_env: Path, k: int) -> None:
    # The docker-registry cannot be told to hold a request, so the k-th blob is held on its way
    # in: it is only in an HTTP CAS given as `--from`, whose GET of it is held. Blobs 1..k-1 are
    # in the registry by then (one upload at a time), the rest and the artifact are not.
    release = make_release(n=4)
    manifest = Manifest.from_path(release.path)
    blobs = list(manifest.blobs)
    held = blobs[k - 1][0]
    fill_local(clean_env, {h: data for h, data in release.blobs.items() if h != held.hex})
    faulty.stored[f"/cas/{held.hex}"] = release.blobs[held.hex]
    arrived, release_held = threading.Event(), threading.Event()
    faulty.script(f"/cas/{held.hex}", [("hold", arrived, release_held), ("ok",)])
    repo = registry.repo()
    args = ["publish", str(release.path), "--to", f"{repo}:v1", "--from", faulty.url]

    try:
        kill_when_held(args, sequential(cli_env), arrived)
    finally:
        release_held.set()

    target = OciLayer(repo)
    assert target.get_manifest("v1") is None
    assert registry.requests("PUT", f"/{repo.split('/', 3)[3]}/manifests/") == 0
    found = {digest: target.read(digest, size) for digest, size in [*blobs, (manifest.digest, len(release.raw))]}
    assert [d for d, data in found.items() if data is not None] == [d for d, _ in blobs[:k - 1]]
    for digest, size in blobs[:k - 1]:
        assert verifies(digest.hex, size, found[digest]), digest

    out = cli(args, cli_env)
    assert out.returncode == 0, out.stderr
    assert f"({len(blobs)} blobs, {len(blobs) + 1 - (k - 1)} uploaded, {k - 1} already there)" in out.stdout
    artifact = Digest.parse(out.stdout.strip().splitlines()[-1].split("@", 1)[1])
    assert target.get_manifest("v1") is not None and target.get_manifest("v1")[0] == artifact
    assert verifies(manifest.digest.hex, len(release.raw), target.read(manifest.digest, len(release.raw)))
    for digest, size in blobs:
        assert verifies(digest.hex, size, target.read(digest, size)), digest

