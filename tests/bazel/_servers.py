"""Remote caches a test starts on loopback: nginx with WebDAV (Bazel's HTTP cache protocol:
`PUT`/`GET <base>/ac/<hex>` and `<base>/cas/<hex>`) and BuildGrid (REAPI over gRPC).

Each server runs in the foreground from a generated configuration under its own work
directory, in its own process group, and is stopped by `stop()`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from _net import free_port, nginx_conf, wait_for_port

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

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes]) -> None:
        # The group is the one start() created for this server: its own processes only.
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
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
