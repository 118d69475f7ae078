"""Loopback helpers shared by the tests that start real servers (nginx, BuildGrid): those of
tools/local_services.py, the module tools/cache_local.sh and tools/rbe_local.sh run, so a test's
server and its configuration are the ones the scripts start."""

from __future__ import annotations

import sys
from pathlib import Path

# tools/ is no package: put it on the path, last, so none of its files shadows another module.
TOOLS = Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.append(str(TOOLS))

import local_services  # noqa: E402
from local_services import find_nginx, free_port, nginx_conf, wait_for_port  # noqa: E402

__all__ = ["find_nginx", "free_port", "local_services", "nginx_conf", "wait_for_port"]
