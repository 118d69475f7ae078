#!/usr/bin/env bash
# A remote-execution cluster on loopback, from tools/local_services.py: PostgreSQL, BuildGrid
# (Execution, Bots, CAS, action cache) and a buildbox worker in the sid root of
# tools/bootstrap_bazel7.sh (which installs all of them). Needs root (the worker's mount namespace).
#   tools/rbe_local.sh start [--dir DIR] [--port N] [--jobs N] [--root SID_ROOT]
#       prints --remote_executor=grpc://127.0.0.1:PORT and --remote_cache=... (the same server)
#   tools/rbe_local.sh status|stop [--dir DIR]
# State (pids, ports, configs, logs, the CAS) lives under --dir, else $CUBINSTORE_LOCAL_SERVICES,
# else ~/.cache/cubinstore/local-services; never in the checkout.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
PYTHON=python3
[ -x "$HERE/../.venv/bin/python" ] && PYTHON="$HERE/../.venv/bin/python"
exec "$PYTHON" "$HERE/local_services.py" rbe "$@"
