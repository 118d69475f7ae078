#!/usr/bin/env python3
"""A remote cache and a remote-execution cluster on loopback, for Bazel's `--remote_cache` and
`--remote_executor`: nginx with WebDAV (Bazel's HTTP cache protocol, `PUT`/`GET
<base>/ac/<hex>` and `<base>/cas/<hex>`), BuildGrid (REAPI over gRPC), PostgreSQL for BuildGrid's
scheduler and a buildbox worker (casd + worker) in the Debian sid root of
tools/bootstrap_bazel7.sh.

    tools/cache_local.sh start|stop|status [--dir DIR] [--port N] [--prefix NAME]
    tools/rbe_local.sh   start|stop|status [--dir DIR] [--port N] [--jobs N] [--root SID_ROOT]

(both run this file: `local_services.py cache|rbe ...`). `start` prints the Bazel flags, one a
line, on stdout. The tests import the same classes and configurations, so a test's server is
the one these scripts start.

Each server runs in the foreground from a configuration generated under its own directory, in a
process group of its own; `stop` signals that group. The scripts keep pids, ports, configs and
logs under `--dir`, else $CUBINSTORE_LOCAL_SERVICES, else the user's cache directory; never in
the checkout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60
STOP_WAIT_S = 15
STATE_SCHEMA = 1
DIR_ENV = "CUBINSTORE_LOCAL_SERVICES"
SID_ROOT_ENV = "CUBINSTORE_SID_ROOT"
DEFAULT_SID_ROOT = "/var/lib/cubinstore/sid"


class ServerError(Exception):
    """A local server did not start or stop, or a request to it failed."""


# -- loopback ---------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """True once 127.0.0.1:``port`` accepts connections; False if ``proc`` exits or ``deadline`` passes."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# -- configurations -----------------------------------------------------------------------------------

def nginx_conf(workdir: Path, port: int, root: Path, access_log: Path, *, slow_location: bool = False) -> str:
    """An nginx config: a WebDAV (PUT) file server for ``root`` on 127.0.0.1:``port``, every
    path under ``workdir``. The access log has ``METHOD URI STATUS BYTES`` a line.
    ``slow_location`` adds ``/slow/``, the same tree sent at 1 MB/s (for timeout tests)."""
    # As root the workers would run as nobody and could not write `root`.
    user = "user root;" if os.geteuid() == 0 else ""
    dav = "dav_methods PUT DELETE MKCOL; create_full_put_path on; dav_access user:rw group:r all:r;"
    temps = "\n".join(f"  {kind}_temp_path {workdir}/tmp_{kind};"
                      for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    slow = f"    location /slow/ {{ limit_rate 1m; {dav} }}\n" if slow_location else ""
    return f"""{user}
daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 512; }}
http {{
  log_format cas '$request_method $uri $status $body_bytes_sent';
  access_log {access_log} cas;
{temps}
  client_max_body_size 0;
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {root};
{slow}    location / {{ {dav} }}
  }}
}}
"""


def buildgrid_cache_conf(port: int, cas: Path) -> str:
    """BuildGrid with a disk CAS, an in-memory action cache and ByteStream: a REAPI remote cache."""
    return f"""server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
storages:
  - !disk-storage &cas
    path: {cas}
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


def buildgrid_execution_conf(port: int, cas: Path, database_url: str) -> str:
    """BuildGrid as a remote-execution front end: CAS, action cache, and the Execution and Bots
    services over an SQL scheduler at ``database_url``."""
    return f"""server:
  - !channel
    address: "127.0.0.1:{port}"
    insecure-mode: true
connections:
  - !sql-connection &sql
    connection-string: {database_url}
    pool-size: 10
    max-overflow: 20
storages:
  - !disk-storage &cas
    path: {cas}
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
# make it see UNAVAILABLE. The pool's size is also gRPC's limit of concurrent RPCs; past it every
# call (the worker's too) gets RESOURCE_EXHAUSTED. The first remote build uploads the toolkit's and
# CUTLASS's headers at once and went past 500 (a CI-style run on 2 cores, 2026-12-06).
thread-pool-size: 2000
limiter: !limiter
  concurrent-request-limit: 0
"""


# -- processes ----------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks) of `pid`, or None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[2]), int(fields[19])


def _group_alive(pgid: int, start_time: int) -> bool:
    """Whether the process group `pgid` that began at `start_time` still has a live process.

    While any process of a group lives, Linux hands out no new process its id; so a leader
    with that pid but another start time means the group is gone."""
    leader = _stat(pgid)
    if leader is not None:
        return leader[2] == start_time and leader[0] != "Z"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None and found[1] == pgid and found[0] != "Z":
                return True
    return False


class Server:
    """One server: a foreground process in a process group of its own, started from a
    configuration written under `workdir`, its output in `workdir/console.log`."""

    name = "server"
    # SIGTERM then SIGKILL; a server whose clean stop is another signal says so.
    stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.pid = 0
        self.start_time = 0
        self.proc: subprocess.Popen[bytes] | None = None  # only in the process that started it
        self.console = workdir / "console.log"

    def _argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def _log_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:] if self.console.exists() else ""

    def start(self, port: int = 0) -> None:
        """Starts the server on `port`, or on a free port when 0."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv: list[str] = []
        for _attempt in range(3 if port == 0 else 1):  # a free port can be taken between probe and bind
            candidate = port or free_port()
            argv = self._argv(candidate)
            with open(self.console, "ab") as console:  # the child keeps its own copy
                proc = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
            stat = _stat(proc.pid)
            self.proc, self.pid, self.start_time = proc, proc.pid, stat[2] if stat else 0
            if wait_for_port(candidate, proc, time.monotonic() + START_TIMEOUT_S):
                self.port = candidate
                logger.info("%s listening on 127.0.0.1:%d (pid %d)", self.name, candidate, proc.pid)
                return
            self.stop()
        raise ServerError(f"{self.name} did not start ({' '.join(argv)}):\n{self._log_tail()}")

    def running(self) -> bool:
        if self.pid == 0:
            return False
        if self.proc is not None:
            self.proc.poll()  # reaps our own child: the group is judged by what is left of it
        return _group_alive(self.pid, self.start_time)

    def stop(self) -> None:
        """Signals the server's process group (the one start() made: its own processes only)
        until nothing of it is left."""
        if self.pid == 0:
            return
        for sig in self.stop_signals:
            if not self.running():
                break
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + STOP_WAIT_S
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.running():
            raise ServerError(f"{self.name} (process group {self.pid}) is still running after "
                              f"{', '.join(s.name for s in self.stop_signals)}")
        self.pid = self.start_time = 0
        self.proc = None

    # What the command line keeps between `start` and `stop`.
    def record(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start_time": self.start_time, "port": self.port,
                "workdir": str(self.workdir)}

    def restore(self, record: dict[str, object]) -> None:
        pid, start_time, port = record.get("pid"), record.get("start_time"), record.get("port")
        if not all(isinstance(v, int) and v >= 0 for v in (pid, start_time, port)):
            raise ServerError(f"bad state record for {self.name}: {record!r}")
        self.pid, self.start_time, self.port = int(pid), int(start_time), int(port)  # type: ignore[arg-type]


class NginxCache(Server):
    """nginx serving and accepting (PUT) files under `data`: a Bazel HTTP remote cache."""

    name = "nginx"

    def __init__(self, workdir: Path, nginx: Path, *, slow_location: bool = False) -> None:
        super().__init__(workdir)
        self.nginx = nginx
        self.slow_location = slow_location
        self.data = workdir / "data"
        self.access_log = workdir / "access.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self, port: int) -> list[str]:
        self.data.mkdir(exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_conf(self.workdir, port, self.data, self.access_log, slow_location=self.slow_location))
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


class BuildGridCache(Server):
    """BuildGrid with a disk CAS, an in-memory action cache and ByteStream: a REAPI remote cache."""

    name = "BuildGrid"

    def __init__(self, workdir: Path, bgd: Path) -> None:
        super().__init__(workdir)
        self.bgd = bgd

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def _config(self, port: int) -> str:
        return buildgrid_cache_conf(port, self.workdir / "cas")

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


class PostgreSQL(Server):
    """A throwaway PostgreSQL cluster on 127.0.0.1, trust authentication, for BuildGrid's scheduler.

    PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user, in a
    directory that user can reach (not under a root-only home or temporary tree)."""

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
        return buildgrid_execution_conf(port, self.workdir / "cas", self.database_url)

    def _argv(self, port: int) -> list[str]:
        proc = subprocess.run([str(self.bgd), "migrate", "apply", self.database_url], capture_output=True,
                              text=True, timeout=300, cwd=self.workdir)
        if proc.returncode != 0:
            raise ServerError(f"bgd migrate apply exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return super()._argv(port)

    def completed_actions(self, database: PostgreSQL) -> int:
        """How many jobs the scheduler marked completed (rows of BuildGrid's jobs table)."""
        argv = database._as_user([str(database.bindir / "psql"), "-h", "127.0.0.1",
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


# buildbox's gRPC retries (casd's and the worker's): UNAVAILABLE by default, and a server past its
# limit of concurrent RPCs too; the delay doubles from 250 ms, 8 times.
_BUSY_RETRY = "--retry-limit=8 --retry-delay=250 --retry-on-code=RESOURCE_EXHAUSTED"


class BuildboxWorker(Server):
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
        # Both retry a busy server (RESOURCE_EXHAUSTED) with backoff, about a minute in all: a
        # worker whose UpdateBotSession fails four times in a row exits, and the build then waits
        # for it until Bazel's own timeout.
        script = (
            f'buildbox-casd --cas-remote="$0" --bind=127.0.0.1:"$1" --bind=unix:/worker/casd.sock {_BUSY_RETRY} '
            '--quota-high=4G --reserved=1G /worker/cache & '
            'while [ ! -S /worker/casd.sock ]; do sleep 0.1; done; '
            f'exec buildbox-worker --bots-remote="$0" --cas-remote=unix:/worker/casd.sock {_BUSY_RETRY} '
            '--buildbox-run=/usr/bin/buildbox-run-hosttools --concurrent-jobs="$2" --max-wait-time=2 '
            '--platform OSFamily=linux cubinstore-test-worker'
        )
        return in_worker_root(self.root, self.workdir, ["/bin/sh", "-c", script, self.server, str(port),
                                                        str(self.jobs)])


# -- OCI registries (Debian's docker-registry, the CNCF distribution registry) ----------------------

def registry_conf(port: int, storage: Path, *, tls: tuple[Path, Path] | None = None, htpasswd: Path | None = None,
                  proxy_of: str | None = None, token: dict[str, str] | None = None) -> str:
    """A distribution registry config: filesystem storage under ``storage`` on 127.0.0.1:``port``,
    deletes allowed (tests garbage-collect blobs), access log on the console. ``tls``: (certificate,
    key); ``htpasswd``: basic auth against that bcrypt file; ``token``: the Bearer token flow
    (realm, service, issuer, rootcertbundle); ``proxy_of``: a pull-through cache of that registry."""
    lines = [
        "version: 0.1",
        "log:",
        "  level: warn",
        "  formatter: text",
        "  accesslog:",
        "    disabled: false",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {storage}",
        "  delete:",
        "    enabled: true",
        "  maintenance:",
        "    uploadpurging:",
        "      enabled: false",
        "http:",
        f"  addr: 127.0.0.1:{port}",
        # The secret signs upload-session state; random per start, never a committed value.
        f"  secret: {os.urandom(16).hex()}",
    ]
    if tls is not None:
        lines += ["  tls:", f"    certificate: {tls[0]}", f"    key: {tls[1]}"]
    if htpasswd is not None:
        lines += ["auth:", "  htpasswd:", "    realm: cubinstore-test", f"    path: {htpasswd}"]
    elif token is not None:
        lines += ["auth:", "  token:", *(f"    {k}: {v}" for k, v in token.items())]
    if proxy_of is not None:
        lines += ["proxy:", f"  remoteurl: {proxy_of}"]
    return "\n".join(lines) + "\n"


def make_test_ca(workdir: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for ``host`` (an IP SAN) signed by it, made with
    openssl at start (no key is ever committed): (ca.pem, server.pem, server.key)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (workdir / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = workdir / "server.ext"
    ext.write_text(f"subjectAltName=IP:{host}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\n")
    openssl = shutil.which("openssl") or "/usr/bin/openssl"
    steps = [
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
         "-subj", "/CN=cubinstore test CA", "-keyout", str(ca_key), "-out", str(ca)],
        [openssl, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={host}",
         "-keyout", str(key), "-out", str(csr)],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-days", "2", "-extfile", str(ext), "-out", str(cert)],
    ]
    for argv in steps:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ServerError(f"{' '.join(argv[:3])} exited with {proc.returncode}: {proc.stderr}")
    return ca, cert, key


def bcrypt_htpasswd(path: Path, user: str, password: str) -> None:
    """An htpasswd file with ``user``'s bcrypt hash (the only scheme the registry accepts), made
    with the C library's crypt (libxcrypt does bcrypt) or, failing that, apache2-utils' htpasswd."""
    hashed = ""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # removed in Python 3.13: htpasswd below then

        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH)) or ""
    except (ImportError, AttributeError, OSError):
        pass
    if not hashed.startswith("$2"):
        tool = shutil.which("htpasswd")
        if tool is None:
            raise ServerError("cannot make a bcrypt hash: no crypt module with bcrypt and no htpasswd (apache2-utils)")
        proc = subprocess.run([tool, "-nbB", user, password], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ServerError(f"htpasswd exited with {proc.returncode}: {proc.stderr}")
        hashed = proc.stdout.strip().split(":", 1)[1]
    path.write_text(f"{user}:{hashed}\n")
    path.chmod(0o600)


class Registry(Server):
    """Debian's docker-registry (CNCF distribution) on loopback, data under `workdir/data`.

    ``tls`` serves HTTPS with a certificate from a CA made at start (``ca`` is its PEM);
    ``user``/``password`` turn on htpasswd basic auth; ``proxy_of`` makes it a pull-through
    cache of that registry URL; ``token`` (realm, service, issuer, rootcertbundle) the Bearer
    token flow."""

    name = "docker-registry"

    def __init__(self, workdir: Path, registry: Path, *, tls: bool = False, user: str | None = None,
                 password: str | None = None, proxy_of: str | None = None,
                 token: dict[str, str] | None = None) -> None:
        super().__init__(workdir)
        self.registry = registry
        self.tls = tls
        self.user, self.password = user, password
        self.proxy_of = proxy_of
        self.token = token
        self.data = workdir / "data"
        self.ca: Path | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    def _argv(self, port: int) -> list[str]:
        self.data.mkdir(exist_ok=True)
        tls = None
        if self.tls:
            self.ca, cert, key = make_test_ca(self.workdir / "tls")
            tls = (cert, key)
        htpasswd = None
        if self.user is not None:
            htpasswd = self.workdir / "htpasswd"
            bcrypt_htpasswd(htpasswd, self.user, self.password or "")
        conf = self.workdir / "config.yml"
        conf.write_text(registry_conf(port, self.data, tls=tls, htpasswd=htpasswd, proxy_of=self.proxy_of,
                                      token=self.token))
        return [str(self.registry), "serve", str(conf)]

    def blob(self, hex_digest: str) -> Path:
        """Where the registry keeps a blob's bytes (its filesystem driver's layout)."""
        return self.data / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"

    def requests(self, method: str, path_part: str = "") -> int:
        """How many `method` requests whose path holds ``path_part`` the access log shows so far.
        A line is written once its response is sent: a caller that must see its last request
        awaits a later one's line first (tests/helpers/registry.py does)."""
        count = 0
        for line in self._log_tail_all().splitlines():
            match = re.search(r'"([A-Z]+) (\S+) HTTP/[0-9.]+"', line)
            if match and match.group(1) == method and path_part in match.group(2):
                count += 1
        return count

    def _log_tail_all(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""


def find_registry() -> Path | None:
    """Debian's docker-registry (tools/bootstrap.sh installs it), else `registry` on PATH."""
    found = shutil.which("docker-registry") or shutil.which("registry")
    return Path(found) if found else None


def find_skopeo() -> Path | None:
    found = shutil.which("skopeo")
    return Path(found) if found else None


# -- finding the programs -------------------------------------------------------------------------------

def find_nginx() -> Path | None:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin:/usr/local/sbin")
    return Path(found) if found else None


def find_bgd() -> Path | None:
    """BuildGrid's CLI: the checkout's `.venv-buildgrid` (tools/bootstrap.sh), else PATH."""
    local = REPO_ROOT / ".venv-buildgrid" / "bin" / "bgd"
    if local.exists():
        return local
    found = shutil.which("bgd")
    return Path(found) if found else None


def find_postgres() -> Path | None:
    """Debian's PostgreSQL server binary directory (tools/bootstrap_bazel7.sh installs it)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return found[-1].parent if found else None


def sid_root() -> Path:
    return Path(os.environ.get(SID_ROOT_ENV) or DEFAULT_SID_ROOT)


# -- the command line: tools/cache_local.sh and tools/rbe_local.sh ---------------------------------

def state_dir(given: str | None) -> Path:
    """--dir, else $CUBINSTORE_LOCAL_SERVICES, else <user cache dir>/cubinstore/local-services;
    never inside the checkout (its files would reach Bazel's view of the workspace)."""
    raw = given or os.environ.get(DIR_ENV) or ""
    if raw:
        path = Path(raw).expanduser()
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(cache) / "cubinstore" / "local-services"
    path = path.resolve()
    if path == REPO_ROOT or REPO_ROOT in path.parents:
        raise ServerError(f"state directory {path} is inside the checkout {REPO_ROOT}: "
                          f"give --dir or ${DIR_ENV} outside it")
    return path


def _require(found: Path | None, what: str) -> Path:
    if found is None:
        raise ServerError(what)
    return found


class Stack:
    """The servers one script starts, in start order, and the state file that names them."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.dir = base / kind
        self.state_file = self.dir / "state.json"

    def load(self) -> dict | None:
        try:
            raw = self.state_file.read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) > 1 << 20:
            raise ServerError(f"{self.state_file}: larger than 1 MiB; not a state file of this tool")
        try:
            state = json.loads(raw)
        except ValueError as exc:
            raise ServerError(f"{self.state_file}: not JSON ({exc}); remove it once nothing runs") from exc
        if not isinstance(state, dict) or state.get("schema") != STATE_SCHEMA or state.get("kind") != self.kind \
                or not isinstance(state.get("servers"), list) or not isinstance(state.get("flags"), list):
            raise ServerError(f"{self.state_file}: expected schema {STATE_SCHEMA} state of '{self.kind}'")
        return state

    def save(self, servers: Sequence[Server], flags: list[str], extra: dict[str, str]) -> None:
        state = {"schema": STATE_SCHEMA, "kind": self.kind, "servers": [s.record() for s in servers],
                 "flags": flags, **extra}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    def recorded(self, state: dict) -> list[Server]:
        servers = []
        for record in state["servers"]:
            if not isinstance(record, dict) or not isinstance(record.get("name"), str):
                raise ServerError(f"{self.state_file}: bad server record {record!r}")
            server = Server(Path(str(record.get("workdir", self.dir))))
            server.name = record["name"]
            server.stop_signals = PostgreSQL.stop_signals if record["name"] == PostgreSQL.name else Server.stop_signals
            server.restore(record)
            servers.append(server)
        return servers


def _start_cache(stack: Stack, args: argparse.Namespace) -> tuple[list[Server], list[str], dict[str, str]]:
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", args.prefix) or args.prefix in (".", ".."):
        raise ServerError(f"--prefix '{args.prefix}': expected 1-64 of A-Z a-z 0-9 . _ -")
    nginx = _require(find_nginx(), "nginx not found (tools/bootstrap.sh installs nginx-light)")
    server = NginxCache(stack.dir / "nginx", nginx)
    server.start(args.port)
    return [server], [f"--remote_cache={server.url}/{args.prefix}"], {"data": str(server.data)}


def _start_rbe(stack: Stack, args: argparse.Namespace) -> tuple[list[Server], list[str], dict[str, str]]:
    bgd = _require(find_bgd(), "BuildGrid's bgd not found (tools/bootstrap.sh installs .venv-buildgrid)")
    postgres = _require(find_postgres(), "PostgreSQL not found (tools/bootstrap_bazel7.sh installs it)")
    root = Path(args.root) if args.root else sid_root()
    if not (root / ".cubinstore-ready").exists():
        raise ServerError(f"no worker root at {root} (run tools/bootstrap_bazel7.sh or pass --root)")
    if args.jobs < 1:
        raise ServerError(f"--jobs {args.jobs}: expected at least 1")
    stack.dir.mkdir(parents=True, exist_ok=True)
    # As root the cluster belongs to the postgres user, which cannot enter a root-only home.
    pgdir = Path(tempfile.mkdtemp(prefix="cubinstore-pg-")) if os.geteuid() == 0 else stack.dir / "postgres"
    database = PostgreSQL(pgdir, postgres)
    extra = {"postgres_dir": str(pgdir)}
    started: list[Server] = []

    def started_one(server: Server) -> None:
        # Recorded at once: a start killed half-way leaves what `stop` needs to end it.
        started.append(server)
        stack.save(started, [], extra)

    try:
        database.start()
        started_one(database)
        server = BuildGridExecution(stack.dir / "buildgrid", bgd, database.url)
        server.start(args.port)
        started_one(server)
        worker = BuildboxWorker(stack.dir / "worker", root, server.port, jobs=args.jobs)
        worker.start()
        started_one(worker)
    except BaseException:
        for s in reversed(started):
            s.stop()
        stack.state_file.unlink(missing_ok=True)
        if os.geteuid() == 0:
            shutil.rmtree(pgdir, ignore_errors=True)
        raise
    flags = [f"--remote_executor={server.url}", f"--remote_cache={server.url}"]
    return started, flags, extra


def _start_registry(stack: Stack, args: argparse.Namespace) -> tuple[list[Server], list[str], dict[str, str]]:
    binary = _require(find_registry(), "docker-registry not found (tools/bootstrap.sh installs Debian's docker-registry)")
    server = Registry(stack.dir / "registry", binary)
    server.start(args.port)
    # What cubinstore takes: CUBINSTORE_REMOTE=oci://HOST:PORT/REPO, publish --to oci://HOST:PORT/REPO[:TAG].
    return [server], [f"oci://{server.host}"], {"data": str(server.data)}


def _start(stack: Stack, args: argparse.Namespace) -> int:
    state = stack.load()
    if state is not None:
        servers = stack.recorded(state)
        if all(s.running() for s in servers):
            print(f"{stack.kind}: already running (state in {stack.dir})", file=sys.stderr)
            print("\n".join(state["flags"]))
            return 0
        raise ServerError(f"{stack.kind}: a previous start in {stack.dir} is partly running or stale: "
                          f"run `stop` first")
    stack.dir.mkdir(parents=True, exist_ok=True)
    starters = {"cache": _start_cache, "rbe": _start_rbe, "registry": _start_registry}
    servers, flags, extra = starters[stack.kind](stack, args)
    stack.save(servers, flags, extra)
    for s in servers:
        print(f"{stack.kind}: {s.name} on 127.0.0.1:{s.port} (pid {s.pid}, logs in {s.workdir})", file=sys.stderr)
    print("\n".join(flags))
    return 0


def _stop(stack: Stack) -> int:
    state = stack.load()
    if state is None:
        print(f"{stack.kind}: nothing started from {stack.dir}", file=sys.stderr)
        return 0
    for server in reversed(stack.recorded(state)):  # workers before the server before its database
        server.stop()
        print(f"{stack.kind}: stopped {server.name}", file=sys.stderr)
    pgdir = state.get("postgres_dir")
    if isinstance(pgdir, str) and Path(pgdir).name.startswith("cubinstore-pg-") and os.geteuid() == 0:
        shutil.rmtree(pgdir, ignore_errors=True)
    stack.state_file.unlink()
    return 0


def _status(stack: Stack) -> int:
    state = stack.load()
    if state is None:
        print(f"{stack.kind}: not started (state directory {stack.dir})")
        return 3
    servers = stack.recorded(state)
    for server in servers:
        word = "running" if server.running() else "NOT running"
        print(f"{stack.kind}: {server.name} {word}: 127.0.0.1:{server.port}, pid {server.pid}, "
              f"logs in {server.workdir}")
    print("\n".join(state["flags"]))
    return 0 if all(s.running() for s in servers) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="local_services.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("cache", "rbe", "registry"),
                        help="the nginx cache, the remote-execution stack, or an OCI registry (prints oci://HOST:PORT)")
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("--dir", help=f"state directory (default ${DIR_ENV}, else ~/.cache/cubinstore/local-services)")
    parser.add_argument("--port", type=int, default=0, help="port of nginx, BuildGrid or the registry (default: a free one)")
    parser.add_argument("--prefix", default="cache", help="cache: the URL path the cache lives under")
    parser.add_argument("--jobs", type=int, default=2, help="rbe: actions the worker runs at once")
    parser.add_argument("--root", help=f"rbe: the worker's root (default ${SID_ROOT_ENV}, else {DEFAULT_SID_ROOT})")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: expected 0 (any free port) to 65535")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        stack = Stack(args.kind, state_dir(args.dir))
        if args.command == "start":
            return _start(stack, args)
        if args.command == "stop":
            return _stop(stack)
        return _status(stack)
    except ServerError as exc:
        print(f"{args.kind} {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
