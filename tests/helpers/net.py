"""Loopback helpers shared by the tests that start real servers (nginx, BuildGrid)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


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
