"""The `cubinstore` command line, run as a real subprocess: exit codes and one-line reasons."""

from __future__ import annotations

import hashlib
import os
import pty
import select
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest
from cubinstore.store import HttpLayer, LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def upload(url: str, blobs: dict[str, bytes]) -> None:
    remote = HttpLayer(url)
    for hex_, data in blobs.items():
        remote.put(Digest(hex_), data)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("cubinstore: error: "), stderr
    return lines[0]


def fill_local(home: Path, blobs: dict[str, bytes]) -> LocalLayer:
    local = LocalLayer(home)
    for hex_, data in blobs.items():
        local.write(Digest(hex_), data)
    return local


# -- usage errors: exit 2 -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, reason",
    [
        ([], "cubinstore: error: cubinstore: the following arguments are required: COMMAND"),
        (["frobnicate"], "cubinstore: error: cubinstore: argument COMMAND: invalid choice: 'frobnicate'"),
        (["gc"], "cubinstore: error: cubinstore gc: the following arguments are required: --max-bytes"),
        (["gc", "--max-bytes", "lots"], "cubinstore: error: --max-bytes: expected a non-negative integer"),
        (["prefetch", "m.json", "--bogus"], "cubinstore: error: cubinstore: unrecognized arguments: --bogus"),
        (["prefetch", "sha256:1234"], "cubinstore: error: invalid digest length: 4, expected 64"),
        (["unpack", "x.tar", "--expect", "sha256:XYZ"], "cubinstore: error: invalid digest length: 3, expected 64"),
        (["publish", "sha256:" + "a" * 64, "--to", "ftp://host/cas"], "cubinstore: error: invalid remote URL 'ftp://host/cas'"),
    ],
)
def test_usage_errors_exit_2_with_one_line(cli, cli_env, args: list[str], reason: str) -> None:
    out = cli(args, cli_env)
    assert out.returncode == 2, out.stderr
    assert one_error_line(out.stderr).startswith(reason)


def test_help_exits_0(cli, cli_env) -> None:
    out = cli(["--help"], cli_env)
    assert out.returncode == 0 and "prefetch" in out.stdout and "publish" in out.stdout


# -- prefetch / ls / verify / stats ---------------------------------------------------------------

def test_prefetch_ls_verify_stats(nginx, make_release, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=4)
    url = nginx.base()
    upload(url, release.blobs)
    manifest = Manifest.from_path(release.path)

    out = cli(["ls", str(release.path)], cli_env)
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].split() == ["ID", "ARCH", "SIZE", "LOCAL"]
    assert [line.split()[-1] for line in out.stdout.splitlines()[1:]] == ["missing"] * 4

    out = cli(["prefetch", str(release.path), "--remote", url], cli_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"prefetched {manifest.digest}: 4 blobs, 4 downloaded")
    assert out.stderr == ""  # no progress bar when stderr is not a terminal

    out = cli(["ls", str(release.path)], cli_env)
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [(r[0], r[1], int(r[2]), r[3]) for r in rows] == sorted((k.id, k.arch, k.size, "ok") for k in manifest.kernels)

    out = cli(["prefetch", str(release.path), "--remote", url], cli_env)
    assert out.returncode == 0 and "0 downloaded" in out.stdout and "4 already local" in out.stdout

    out = cli(["verify"], cli_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"verified 5 entries in {clean_env}: 5 ok, 0 corrupt, 0 missing"

    out = cli(["stats"], cli_env)
    stats = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert out.returncode == 0
    assert stats["misses"] == "4" and stats["hits"] == "4" and stats["verification_failures"] == "0"
    assert int(stats["bytes_fetched"]) == sum(map(len, release.blobs.values()))
    assert stats["entries"] == "5"
    # How a first load checks and reads an entry here: this user's store, records; the C helper where built.
    from helpers.native import built_helper

    built_helper()
    assert stats["first_load_check"] == "records" and stats["first_load_read"] == stats["launch"] == "native"
    out = cli(["stats"], {**cli_env, "CUBINSTORE_VERIFY": "full", "CUBINSTORE_NATIVE": "0"})
    stats = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert stats["first_load_check"] == "sha256" and stats["first_load_read"] == stats["launch"] == "python"


def test_prefetch_only_the_requested_arch(nginx, make_release, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=4)
    url = nginx.base()
    upload(url, release.blobs)
    out = cli(["prefetch", str(release.path), "--remote", url, "--arch", "sm_80"], cli_env)
    assert out.returncode == 0, out.stderr
    manifest = Manifest.from_path(release.path)
    local = LocalLayer(clean_env)
    for k in manifest.kernels:
        assert local.status(k.digest, k.size) == ("ok" if k.arch == "sm_80" else "missing")
    out = cli(["prefetch", str(release.path), "--remote", url, "--arch", "sm_75"], cli_env)
    assert out.returncode == 2 and "manifest sha256:" in one_error_line(out.stderr) and "has archs sm_80, sm_90a" in out.stderr
    out = cli(["prefetch", str(release.path), "--arch", "sm75"], cli_env)
    assert out.returncode == 2 and one_error_line(out.stderr).startswith("cubinstore: error: invalid arch 'sm75'")


def test_prefetch_missing_blob_exits_1_naming_kernel_and_url(nginx, make_release, cli, cli_env) -> None:
    release = make_release(n=2)
    url = nginx.base()
    first, second = sorted(release.blobs)
    upload(url, {first: release.blobs[first]})
    out = cli(["prefetch", str(release.path), "--remote", url], cli_env)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0].startswith(f"cubinstore: error: sha256:{second} (axpy/") and f"remote {url}: miss" in lines[0]
    assert lines[-1].startswith("cubinstore: error: prefetch sha256:") and lines[-1].endswith("1 of 2 blobs failed")


def test_offline_prefetch_never_touches_the_network(nginx, make_release, cli, cli_env) -> None:
    release = make_release(n=1)
    url = nginx.base()
    upload(url, release.blobs)
    env = dict(cli_env, CUBINSTORE_OFFLINE="1", CUBINSTORE_REMOTE=url)
    out = cli(["prefetch", str(release.path), "--remote", url], env)
    assert out.returncode == 1
    assert "(no remote store: CUBINSTORE_OFFLINE is set)" in out.stderr
    (hex_,) = release.blobs
    assert nginx.requests("GET", hex_) == 0


def test_unreachable_remote_exits_1(make_release, cli, cli_env) -> None:
    release = make_release(n=1)
    env = dict(cli_env, CUBINSTORE_HTTP_RETRIES="1", CUBINSTORE_HTTP_CONNECT_TIMEOUT="0.5")
    out = cli(["prefetch", str(release.path), "--remote", "http://127.0.0.1:9/cache"], env)
    assert out.returncode == 1 and "failed after 2 attempts" in out.stderr and "Connection refused" in out.stderr


def test_progress_bar_on_a_terminal(nginx, make_release, cli_env) -> None:
    release = make_release(n=3)
    url = nginx.base()
    upload(url, release.blobs)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cubinstore", "prefetch", str(release.path), "--remote", url],
                            env=cli_env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    assert proc.returncode == 0
    assert b"\rprefetch [" in seen and b"3/3" in seen


def test_verify_quarantines_corrupt_entries_and_exits_1(make_release, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=3)
    local = fill_local(clean_env, release.blobs)
    victim, zeroed = sorted(release.blobs)[:2]
    path = local.path_for(Digest(victim))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    local.path_for(Digest(zeroed)).write_bytes(b"")
    out = cli(["verify"], cli_env)
    assert out.returncode == 1
    assert f"corrupt sha256:{victim}: digest mismatch" in out.stdout and f"corrupt sha256:{zeroed}" in out.stdout
    assert one_error_line(out.stderr) == f"cubinstore: error: verify: 2 corrupt and 0 missing entries in {clean_env}"
    assert not path.exists() and len(list(local.quarantine_dir.iterdir())) == 2
    # The manifest view now reports them missing; the store itself is clean again.
    out = cli(["verify", str(release.path)], cli_env)
    assert out.returncode == 1 and f"missing sha256:{victim}" in out.stdout
    assert cli(["verify"], cli_env).returncode == 0


def test_gc_evicts_least_recently_used_but_never_pinned(make_release, cli, cli_env, clean_env: Path) -> None:
    pinned_release = make_release(n=2, size=10_000)
    other = make_release(n=4, size=10_000)
    local = fill_local(clean_env, {**pinned_release.blobs, **other.blobs})
    # Oldest first: the pinned blobs are the oldest of all, so plain LRU would evict them first.
    now = time.time()
    order = sorted(pinned_release.blobs) + sorted(other.blobs)
    for age, hex_ in enumerate(order):
        os.utime(local.path_for(Digest(hex_)), (now - 10_000 + age, now - 10_000 + age))
    assert cli(["pin", str(pinned_release.path)], cli_env).returncode == 0
    listing = cli(["pin"], cli_env)
    assert listing.returncode == 0 and Manifest.from_path(pinned_release.path).digest.hex in listing.stdout
    pinned_bytes = sum(map(len, pinned_release.blobs.values())) + len(pinned_release.raw)
    newest = order[-1]
    limit = pinned_bytes + len(other.blobs[newest])
    out = cli(["gc", "--max-bytes", str(limit)], cli_env)
    assert out.returncode == 0, out.stderr
    remaining = {e.digest.hex for e in local.scan()[0]}
    assert set(pinned_release.blobs) <= remaining
    assert newest in remaining and not (set(other.blobs) - {newest}) & remaining
    assert Manifest.from_path(pinned_release.path).digest.hex in remaining
    # Unpinned, everything can go.
    assert cli(["unpin", str(pinned_release.path)], cli_env).returncode == 0
    assert cli(["unpin", str(pinned_release.path)], cli_env).returncode == 1
    assert cli(["gc", "--max-bytes", "0"], cli_env).returncode == 0
    assert local.scan()[0] == []


def test_pack_unpack_between_two_homes(make_release, cli, cli_env, clean_env: Path, tmp_path: Path) -> None:
    release = make_release(n=3)
    fill_local(clean_env, release.blobs)
    bundle = tmp_path / "release.tar"
    out = cli(["pack", str(release.path), str(bundle)], cli_env)
    assert out.returncode == 0, out.stderr
    digest = Manifest.from_path(release.path).digest
    offline_env = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "offline-host"), CUBINSTORE_OFFLINE="1")
    out = cli(["unpack", str(bundle), "--expect", str(digest), "--pin"], offline_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"unpacked {digest} (3 blobs)")
    # The offline host can now open the release by digest alone.
    out = cli(["ls", str(digest)], offline_env)
    assert out.returncode == 0 and out.stdout.count(" ok") == 3
    tampered = tmp_path / "tampered.tar"
    with tarfile.open(bundle) as tar:
        last = tar.getmembers()[-1]
    data = bytearray(bundle.read_bytes())
    data[last.offset_data + 10] ^= 0xFF  # inside the last blob's content
    tampered.write_bytes(bytes(data))
    out = cli(["unpack", str(tampered)], dict(offline_env, CUBINSTORE_HOME=str(tmp_path / "third")))
    assert out.returncode == 1 and one_error_line(out.stderr).startswith(f"cubinstore: error: bundle {tampered}")
    assert not (tmp_path / "third" / "v1" / "cas").exists()


def test_pack_from_a_full_local_store_imports_no_maintenance_or_fetch_code(make_release, cli_env, clean_env: Path,
                                                                            tmp_path: Path) -> None:
    # What a pack process loads is what it pays for at start-up: gc/pin/verify (_maint) and the
    # prefetch pool (_prefetch, queue) are for other commands, or for a blob the local store lacks.
    release = make_release(n=3)
    fill_local(clean_env, release.blobs)
    bundle = tmp_path / "release.tar"
    code = ("import sys\nfrom cubinstore.cli import main\n"
            f"status = main(['pack', {str(release.path)!r}, {str(bundle)!r}])\n"
            "print(status, sorted(m for m in sys.modules if m in ('cubinstore._release.maint', 'cubinstore._release.prefetch', 'queue')))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "0 []"
    with tarfile.open(bundle) as tar:
        assert len(tar.getmembers()) == 4  # the manifest and its three blobs


def test_publish_then_prefetch_on_a_second_store_root(nginx, make_release, cli, cli_env, tmp_path: Path) -> None:
    release = make_release(n=4)
    # A build tree as Bazel leaves it: the manifest under bazel-bin with the CUBINs beside it.
    tree = tmp_path / "ws" / "bazel-bin" / "kernels"
    (tree / "axpy").mkdir(parents=True)
    for i, data in enumerate(release.blobs.values()):
        (tree / "axpy" / f"kernel_{i}.cubin").write_bytes(data)
    manifest_path = tree / "manifest.json"
    shutil.copy(release.path, manifest_path)
    url = nginx.base()
    out = cli(["publish", str(manifest_path), "--to", url], cli_env)
    assert out.returncode == 0, out.stderr
    digest = Manifest.from_path(manifest_path).digest
    assert out.stdout.strip() == f"published {digest} (4 blobs) to {url}"
    for hex_ in release.blobs:
        assert nginx.requests("PUT", hex_) == 1 and nginx.requests("GET", hex_) == 1  # uploaded, read back
    assert nginx.file(url, digest.hex).read_bytes() == release.raw

    second = dict(cli_env, CUBINSTORE_HOME=str(tmp_path / "second-root"))
    out = cli(["prefetch", str(digest), "--remote", url], second)
    assert out.returncode == 0, out.stderr
    local = LocalLayer(tmp_path / "second-root")
    for hex_, data in release.blobs.items():
        assert local.path_for(Digest(hex_)).read_bytes() == data
    assert local.path_for(digest).read_bytes() == release.raw


def test_publish_detects_a_server_that_mangles_uploads(faulty, make_release, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=2)
    fill_local(clean_env, release.blobs)
    faulty.corrupt_puts = True
    out = cli(["publish", str(release.path), "--to", faulty.url], cli_env)
    assert out.returncode == 1
    assert "failed re-verification after upload" in out.stderr
    assert out.stderr.splitlines()[-1].endswith("2 problems; manifest not uploaded")
    digest = Manifest.from_path(release.path).digest
    assert f"/cas/{digest.hex}" not in faulty.stored


def test_publish_with_a_missing_blob_uploads_no_manifest(nginx, make_release, cli, cli_env, clean_env: Path) -> None:
    release = make_release(n=2)
    first = sorted(release.blobs)[0]
    fill_local(clean_env, {first: release.blobs[first]})
    url = nginx.base()
    out = cli(["publish", str(release.path), "--to", url], cli_env)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].endswith("1 problems; manifest not uploaded")
    digest = Manifest.from_path(release.path).digest
    assert nginx.requests("PUT", digest.hex) == 0


def test_ls_of_a_bad_manifest_exits_1_naming_the_field(cli, cli_env, tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    data = b"\x7fELF" * 10
    path.write_text('{"schema":"cubinstore/manifest/v1","kernels":[{"id":"a/sm_80","family":"a","params":{},'
                    '"arch":"sm_80","digest":"sha256:%s","size":0,"entries":{"k":[]},"target":"//a:b"}]}'
                    % hashlib.sha256(data).hexdigest())
    out = cli(["ls", str(path)], cli_env)
    assert out.returncode == 1
    assert one_error_line(out.stderr) == (
        f"cubinstore: error: invalid manifest {path}: kernels[0] (id 'a/sm_80').size: expected a positive integer (bytes), got 0")
    out = cli(["ls", str(tmp_path / "absent.json")], cli_env)
    assert out.returncode == 1 and one_error_line(out.stderr).startswith("cubinstore: error: cannot read manifest")


# -- credentials, FIFOs, failures reported whatever fails last ------------------------------------

SECRET = "s3cret"


@pytest.mark.parametrize("url", [
    f"http://user:{SECRET}@host:99999/cas", f"http://user:{SECRET}@host/cas?x=1", f"ftp://user:{SECRET}@host/cas",
    f"http://user:{SECRET}@host/c as", f"http://user:{SECRET}@/cas",
])
@pytest.mark.parametrize("where", ["--remote", "--to", "CUBINSTORE_REMOTE"])
def test_a_bad_remote_url_never_prints_its_password(make_release, cli, cli_env, url: str, where: str) -> None:
    release = make_release(n=1)
    env = dict(cli_env)
    if where == "--remote":
        args = ["-v", "prefetch", str(release.path), "--remote", url]
    elif where == "--to":
        args = ["-v", "publish", str(release.path), "--to", url]
    else:
        env["CUBINSTORE_REMOTE"] = url
        args = ["-v", "prefetch", str(release.path)]
    out = cli(args, env)
    assert out.returncode == 2, out.stderr
    assert SECRET not in out.stdout + out.stderr
    assert "cubinstore: error: invalid remote URL " in out.stderr


def test_offline_debug_log_never_prints_a_remote_password(make_release, cli, cli_env) -> None:
    release = make_release(n=1)
    env = dict(cli_env, CUBINSTORE_OFFLINE="1", CUBINSTORE_REMOTE=f"http://user:{SECRET}@127.0.0.1:9/cas")
    out = cli(["-v", "prefetch", str(release.path)], env)
    assert out.returncode == 1 and "CUBINSTORE_OFFLINE" in out.stderr
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.parametrize("command", [["ls"], ["prefetch"], ["pin"], ["verify"], ["unpin"], ["unpack"], ["pack", "OUT"]])
def test_a_fifo_as_manifest_or_bundle_is_refused_without_blocking(cli, cli_env, tmp_path: Path, command: list[str]) -> None:
    fifo = tmp_path / "release.fifo"
    os.mkfifo(fifo)
    args = [command[0], str(fifo), *[str(tmp_path / "out.tar") for _ in command[1:]]]
    start = time.monotonic()
    out = cli(args, cli_env, timeout=20)
    assert time.monotonic() - start < 15
    assert out.returncode == 1, out.stderr
    what = "bundle" if command[0] == "unpack" else "manifest"
    assert one_error_line(out.stderr).startswith(f"cubinstore: error: cannot read {what} {fifo}: it is a FIFO")


def test_prefetch_reports_every_blob_failure_even_when_storing_the_manifest_fails(nginx, make_release, cli, cli_env,
                                                                                  clean_env: Path) -> None:
    release = make_release(n=3)
    url = nginx.base()
    missing, *present = sorted(release.blobs)
    upload(url, {hex_: release.blobs[hex_] for hex_ in present})
    manifest_hex = Manifest.from_path(release.path).digest.hex
    (clean_env / "v1" / "cas" / manifest_hex[:2] / manifest_hex).mkdir(parents=True)  # storing the manifest fails
    out = cli(["prefetch", str(release.path), "--remote", url], cli_env)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert any(line.startswith(f"cubinstore: error: sha256:{missing} (axpy/") for line in lines), out.stderr
    assert any(line.endswith("1 of 3 blobs failed") for line in lines), out.stderr
    assert any(f"sha256:{manifest_hex}" in line and "Is a directory" in line for line in lines), out.stderr
