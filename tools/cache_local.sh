#!/usr/bin/env bash
# A Bazel HTTP remote cache on loopback: nginx with WebDAV, from tools/local_services.py.
#   tools/cache_local.sh start [--dir DIR] [--port N] [--prefix NAME]   prints --remote_cache=...
#   tools/cache_local.sh status|stop [--dir DIR]
# State (pid, port, config, logs, the cached files) lives under --dir, else
# $CUBINSTORE_LOCAL_SERVICES, else ~/.cache/cubinstore/local-services; never in the checkout.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
PYTHON=python3
[ -x "$HERE/../.venv/bin/python" ] && PYTHON="$HERE/../.venv/bin/python"
exec "$PYTHON" "$HERE/local_services.py" cache "$@"
