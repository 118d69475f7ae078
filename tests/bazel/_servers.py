"""Remote caches a test starts on loopback: nginx with WebDAV (Bazel's HTTP cache protocol:
`PUT`/`GET <base>/ac/<hex>` and `<base>/cas/<hex>`) and BuildGrid (REAPI over gRPC).

Each server runs in the foreground from a generated configuration under its own work
directory, in its own process group, and is stopped by `stop()`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from helpers.net import free_port, nginx_conf, wait_for_port

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60


class ServerError(Exception):
    """A cache server did not start or a request to it failed."""


class _Server:
    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.console = workdir / "console.log"

    def _argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def _log_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:] if self.console.exists() else ""

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(3):  # a free port can be taken between the probe and the bind
            port = free_port()
            argv = self._argv(port)
            with open(self.console, "ab") as console:
                proc = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
            if wait_for_port(port, proc, time.monotonic() + START_TIMEOUT_S):
                self.proc, self.port = proc, port
                logger.info("%s listening on 127.0.0.1:%d (pid %d)", self.name, port, proc.pid)
                return
            self._terminate(proc)
        raise ServerError(f"{self.name} did not start ({' '.join(argv)}):\n{self._log_tail()}")

    # SIGTERM then SIGKILL; a server whose clean stop is another signal says so.
    stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        # The group is the one start() created for this server: its own processes only.
        for sig, wait in ((s, 15) for s in self.stop_signals):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        proc.poll()

    def stop(self) -> None:
        if self.proc is not None:
            self._terminate(self.proc)
            self.proc = None


class NginxCache(_Server):
    """nginx serving and accepting (PUT) files under `data`: a Bazel HTTP remote cache."""

    name = "nginx"

    def __init__(self, workdir: Path, nginx: Path) -> None:
        super().__init__(workdir)
        self.nginx = nginx
        self.data = workdir / "data"
        self.access_log = workdir / "access.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self, port: int) -> list[str]:
        self.data.mkdir(exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_conf(self.workdir, port, self.data, self.access_log))
        return [str(self.nginx), "-p", str(self.workdir), "-c", str(conf), "-e", str(self.workdir / "error.log")]

    def _log_tail(self) -> str:
        error_log = self.workdir / "error.log"
        errors = error_log.read_text(errors="replace")[-2000:] if error_log.exists() else ""
        return super()._log_tail() + errors

    def blob(self, hex_digest: str) -> Path:
        return self.data / "cas" / hex_digest

    def action_results(self) -> list[Path]:
        ac = self.data / "ac"
        return sorted(p for p in ac.iterdir() if p.is_file()) if ac.is_dir() else []

    def requests(self, method: str) -> int:
        """How many `method` requests nginx has logged so far."""
        if not self.access_log.exists():
            return 0
        return sum(1 for line in self.access_log.read_text().splitlines() if line.split(" ", 1)[0] == method)


class BuildGridCache(_Server):
    """BuildGrid with a disk CAS, an in-memory action cache and ByteStream: a REAPI remote cache."""

    name = "BuildGrid"

    def __init__(self, workdir: Path, bgd: Path) -> None:
        super().__init__(workdir)
        self.bgd = bgd

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def _config(self, port: int) -> str:
        return f"""server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
storages:
  - !disk-storage &cas
    path: {self.workdir / "cas"}
caches:
  - !lru-action-cache &ac
    storage: *cas
    max-cached-refs: 100000
    allow-updates: true
    cache-failed-actions: false
instances:
  - name: ''
    services:
      - !action-cache
        cache: *ac
      - !cas
        storage: *cas
      - !bytestream
        storage: *cas
"""

    def _argv(self, port: int) -> list[str]:
        (self.workdir / "cas").mkdir(exist_ok=True)
        conf = self.workdir / "buildgrid.yml"
        conf.write_text(self._config(port))
        return [str(self.bgd), "server", "start", str(conf)]

    def download(self, blobs: dict[str, int], dest: Path) -> dict[str, bytes]:
        """Fetches blobs (hex digest -> size) over gRPC with BuildGrid's client (`bgd cas
        download-file`, ByteStream/CAS reads); returns hex digest -> bytes."""
        dest.mkdir(parents=True, exist_ok=True)
        pairs: list[str] = []
        for hex_digest, size in blobs.items():
            pairs += [f"{hex_digest}/{size}", str(dest / hex_digest)]
        argv = [str(self.bgd), "cas", "--remote", f"http://127.0.0.1:{self.port}", "download-file", *pairs]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=self.workdir)
        if proc.returncode != 0:
            raise ServerError(f"bgd cas download-file exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return {hex_digest: (dest / hex_digest).read_bytes() for hex_digest in blobs}


# -- remote execution: PostgreSQL, BuildGrid with a scheduler, buildbox workers ---------------------

def find_postgres() -> Path | None:
    """Debian's PostgreSQL server binary directory (tools/bootstrap_bazel7.sh installs it)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return found[-1].parent if found else None


class PostgreSQL(_Server):
    """A throwaway PostgreSQL cluster on 127.0.0.1, trust authentication, for BuildGrid's scheduler.

    PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user, in a
    directory of its own outside pytest's root-only temporary tree."""

    name = "PostgreSQL"
    # SIGINT is PostgreSQL's fast shutdown; SIGTERM waits for BuildGrid's pooled connections.
    stop_signals = (signal.SIGINT, signal.SIGKILL)

    def __init__(self, workdir: Path, bindir: Path) -> None:
        super().__init__(workdir)
        self.bindir = bindir
        self.data = workdir / "data"
        self.user = "postgres" if os.geteuid() == 0 else ""

    def _as_user(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--", *argv] if self.user else argv

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _argv(self, port: int) -> list[str]:
        if not (self.data / "PG_VERSION").exists():
            if self.user:
                shutil.chown(self.workdir, self.user)
            proc = subprocess.run(self._as_user([str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                                                 "--auth=trust", "--no-sync", "-E", "UTF8"]),
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise ServerError(f"initdb exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return self._as_user([str(self.bindir / "postgres"), "-D", str(self.data), "-h", "127.0.0.1",
                              "-p", str(port), "-k", str(self.workdir), "-c", "fsync=off",
                              "-c", "max_connections=200"])


class BuildGridExecution(BuildGridCache):
    """BuildGrid as a remote-execution cluster's front end: CAS, action cache, and the Execution
    and Bots services over an SQL scheduler (PostgreSQL). Workers connect to the same port."""

    name = "BuildGrid (execution)"

    def __init__(self, workdir: Path, bgd: Path, database_url: str) -> None:
        super().__init__(workdir, bgd)
        self.database_url = database_url

    def _config(self, port: int) -> str:
        return f"""server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
connections:
  - !sql-connection &sql
    connection-string: {self.database_url}
    pool-size: 10
    max-overflow: 20
storages:
  - !disk-storage &cas
    path: {self.workdir / "cas"}
caches:
  - !lru-action-cache &ac
    storage: *cas
    max-cached-refs: 100000
    allow-updates: true
    cache-failed-actions: false
schedulers:
  - !sql-scheduler &scheduler
    sql: *sql
    storage: *cas
    action-cache: *ac
    poll-interval: 0.2
    bot-poll-interval: 0.2
    property-set: !dynamic-property-set
      match-property-keys: []
      wildcard-property-keys: []
instances:
  - name: ''
    services:
      - !action-cache
        cache: *ac
      - !execution
        scheduler: *scheduler
      - !cas
        storage: *cas
      - !bytestream
        storage: *cas
# Bazel 7 opens many concurrent streams (uploads, Execute, WaitExecution): the default limits
# make it see UNAVAILABLE.
thread-pool-size: 500
limiter: !limiter
  concurrent-request-limit: 0
"""

    def _argv(self, port: int) -> list[str]:
        proc = subprocess.run([str(self.bgd), "migrate", "apply", self.database_url], capture_output=True,
                              text=True, timeout=300, cwd=self.workdir)
        if proc.returncode != 0:
            raise ServerError(f"bgd migrate apply exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return super()._argv(port)

    def completed_actions(self, database: PostgreSQL) -> int:
        """How many jobs the scheduler marked completed (rows of BuildGrid's jobs table)."""
        argv = database._as_user([str(database.bindir.parent / "bin" / "psql"), "-h", "127.0.0.1",
                                  "-p", str(database.port), "-U", "postgres", "-At", "-c",
                                  "SELECT count(*) FROM jobs WHERE stage = 4"])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ServerError(f"psql exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return int(proc.stdout.strip())


# Runs a command in the sid root as the root of a private mount namespace (pivot_root, not
# chroot: bubblewrap cannot make namespaces inside a chroot), with the root's own files, an
# empty /tmp and one host directory, WORKDIR, at /worker: no /usr/local/cuda, no workspace, no
# home directory of the host. $0 = root, $1 = workdir, the rest = the command.
_WORKER_SANDBOX = (
    'mount --bind "$0" "$0" && mkdir -p "$0/worker" "$0/.host" && mount --bind "$1" "$0/worker" '
    '&& mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && mount -t tmpfs tmpfs "$0/tmp" '
    '&& cd "$0" && pivot_root . .host && /usr/bin/umount -l /.host && shift && exec "$@"'
)
WORKER_DIR = "/worker"  # where a worker's files are inside its root


def in_worker_root(root: Path, workdir: Path, argv: list[str]) -> list[str]:
    """`argv` as run inside the worker's view of the machine (see _WORKER_SANDBOX), with a
    minimal environment."""
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _WORKER_SANDBOX,
            str(root), str(workdir), "/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "LANG=C.UTF-8",
            f"HOME={WORKER_DIR}", *argv]


class BuildboxWorker(_Server):
    """A remote-execution worker: buildbox-casd (the worker's local CAS, proxying BuildGrid's)
    and buildbox-worker polling BuildGrid's Bots service, in one worker root (casd stages each
    job's input tree with FUSE, which only its own mount namespace sees). Each job runs in its
    staged input tree with buildbox-run-hosttools: the isolation is the worker root itself.
    (buildbox-run-bubblewrap makes the input tree the job's `/`, so the dynamic loader and the
    host compiler on /usr/bin are missing unless every action ships a system image.)"""

    name = "buildbox-worker"

    def __init__(self, workdir: Path, root: Path, server_port: int, jobs: int = 2) -> None:
        super().__init__(workdir)
        self.root = root
        self.server = f"http://127.0.0.1:{server_port}"
        self.jobs = jobs

    def _argv(self, port: int) -> list[str]:
        (self.workdir / "cache").mkdir(exist_ok=True)
        # casd listens on `port` too, so start() sees it ready; the worker talks to its socket.
        script = (
            'buildbox-casd --cas-remote="$0" --bind=127.0.0.1:"$1" --bind=unix:/worker/casd.sock '
            '--quota-high=4G --reserved=1G /worker/cache & '
            'while [ ! -S /worker/casd.sock ]; do sleep 0.1; done; '
            'exec buildbox-worker --bots-remote="$0" --cas-remote=unix:/worker/casd.sock '
            '--buildbox-run=/usr/bin/buildbox-run-hosttools --concurrent-jobs="$2" --max-wait-time=2 '
            '--platform OSFamily=linux cubinstore-test-worker'
        )
        return in_worker_root(self.root, self.workdir, ["/bin/sh", "-c", script, self.server, str(port),
                                                        str(self.jobs)])
