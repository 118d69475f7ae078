"""tools/cache_local.sh and tools/rbe_local.sh: start prints the Bazel flags, status says what
runs, stop ends every process it started; state lives under --dir, never in the checkout.
(The other tests start the same servers through tools/local_services.py's classes.)"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.net import find_nginx, local_services

from ._workspace import REPO_ROOT, find_bgd
from .conftest import unavailable

pytestmark = pytest.mark.bazel

CACHE = REPO_ROOT / "tools" / "cache_local.sh"
RBE = REPO_ROOT / "tools" / "rbe_local.sh"


def _script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != local_services.DIR_ENV}
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300, env=env)


def _group_gone(pgid: int) -> bool:
    """No live process in process group `pgid` (a zombie left for a parent that does not reap
    counts as gone)."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return False
    return True


def _refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    if find_nginx() is None:
        unavailable("nginx not found (tools/bootstrap.sh installs nginx-light)")
    yield tmp_path
    _script(CACHE, "stop", "--dir", str(tmp_path))


def test_cache_local_start_prints_the_flag_serves_puts_and_stop_ends_nginx(cache_dir: Path) -> None:
    started = _script(CACHE, "start", "--dir", str(cache_dir), "--prefix", "team")
    assert started.returncode == 0, started.stderr
    (flag,) = started.stdout.splitlines()
    assert flag.startswith("--remote_cache=http://127.0.0.1:") and flag.endswith("/team"), flag
    url = flag.split("=", 1)[1]
    blob = b"a blob the cache keeps"
    hex_digest = hashlib.sha256(blob).hexdigest()
    urllib.request.urlopen(urllib.request.Request(f"{url}/cas/{hex_digest}", data=blob, method="PUT"),
                           timeout=30).close()
    with urllib.request.urlopen(f"{url}/cas/{hex_digest}", timeout=30) as got:
        assert got.read() == blob
    assert (cache_dir / "cache" / "nginx" / "data" / "team" / "cas" / hex_digest).read_bytes() == blob

    status = _script(CACHE, "status", "--dir", str(cache_dir))
    assert status.returncode == 0 and status.stdout.startswith("cache: nginx running: 127.0.0.1:"), status.stdout
    again = _script(CACHE, "start", "--dir", str(cache_dir))
    assert again.returncode == 0 and again.stdout.splitlines() == [flag], "a second start must reuse the first"

    state = json.loads((cache_dir / "cache" / "state.json").read_text())
    (nginx,) = state["servers"]
    stopped = _script(CACHE, "stop", "--dir", str(cache_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert _group_gone(nginx["pid"]) and _refuses(nginx["port"])
    after = _script(CACHE, "status", "--dir", str(cache_dir))
    assert after.returncode == 3 and after.stdout.startswith("cache: not started"), after.stdout


def test_cache_local_refuses_a_state_directory_inside_the_checkout() -> None:
    inside = REPO_ROOT / "local-services-must-not-exist"
    result = _script(CACHE, "start", "--dir", str(inside))
    assert result.returncode == 1
    assert result.stderr.startswith(f"cache start: state directory {inside} is inside the checkout"), result.stderr
    assert not inside.exists()


def test_cache_local_status_names_a_state_file_that_is_not_its_own(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "state.json").write_text('{"schema": 99}')
    result = _script(CACHE, "status", "--dir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.startswith(f"cache status: {tmp_path / 'cache' / 'state.json'}: expected schema 1"), \
        result.stderr


def test_rbe_local_starts_database_buildgrid_and_worker_and_stop_ends_them(tmp_path: Path) -> None:
    if find_bgd() is None:
        unavailable("BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    if local_services.find_postgres() is None:
        unavailable("PostgreSQL not found (tools/bootstrap_bazel7.sh installs it)")
    if not (local_services.sid_root() / ".cubinstore-ready").exists():
        unavailable(f"no worker root at {local_services.sid_root()} (run tools/bootstrap_bazel7.sh)")
    try:
        started = _script(RBE, "start", "--dir", str(tmp_path))
        assert started.returncode == 0, started.stderr
        executor, cache = started.stdout.splitlines()
        assert executor.startswith("--remote_executor=grpc://127.0.0.1:"), executor
        assert cache == executor.replace("--remote_executor=", "--remote_cache=")
        status = _script(RBE, "status", "--dir", str(tmp_path))
        assert status.returncode == 0, status.stdout
        names = [line.split(" running:")[0] for line in status.stdout.splitlines() if " running:" in line]
        assert names == ["rbe: PostgreSQL", "rbe: BuildGrid (execution)", "rbe: buildbox-worker"], status.stdout
        state = json.loads((tmp_path / "rbe" / "state.json").read_text())
    finally:
        stopped = _script(RBE, "stop", "--dir", str(tmp_path))
    assert stopped.returncode == 0, stopped.stderr
    for server in state["servers"]:
        assert _group_gone(server["pid"]), f"{server['name']} (pid {server['pid']}) still runs"
    assert _refuses(int(executor.rsplit(":", 1)[1]))
    assert not Path(state["postgres_dir"]).exists() or os.geteuid() != 0
    assert _script(RBE, "status", "--dir", str(tmp_path)).returncode == 3
