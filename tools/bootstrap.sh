#!/usr/bin/env bash
# Installs what a fresh machine lacks to build //kernels:all and run the tests, then exits.
# Idempotent: a second run only checks. Everything is pinned; no download happens during a build.
#   - Debian: bazel-bootstrap (offline Bazel 4.2.3), nginx-light (WebDAV cache for the tests),
#     libnginx-mod-http-dav-ext (PROPFIND, which sccache's WebDAV backend needs: benchmarks/bench_nvcc_dropin.py),
#     docker-registry (the CNCF distribution registry: OCI release tests) and skopeo (their interop tests)
#   - npm: bazelisk and buildifier (package-lock.json); .bazeliskrc points bazelisk at the local Bazel
#   - PyPI: .venv with the test dependencies, the CUTLASS headers wheel and this package (with its C
#           helper, built by pip: a C compiler and Python's headers);
#           .venv-buildgrid with BuildGrid (a gRPC remote cache for the tests)
#   - tools/bootstrap_bazel7.sh: Bazel 7 (a Debian sid root), PostgreSQL, psycopg2 for BuildGrid
set -euo pipefail
cd "$(dirname "$0")/.."

BAZEL_DEB=4.2.3+ds-9
NGINX_DEB=1.22.1-9+deb12u11
NGINX_DAV_EXT_DEB=1:3.0.0-3
REGISTRY_DEB=2.8.2+ds1-1
SKOPEO_DEB=1.9.3+ds1-1+b10
CUTLASS_WHEEL=nvidia-cutlass==4.2.0.0
PYTHON=${PYTHON:-python3}

log() { printf 'bootstrap: %s\n' "$*" >&2; }

apt_install() {  # apt_install PACKAGE VERSION: the pinned version, else the distribution's
  local pkg=$1 version=$2
  dpkg -s "$pkg" >/dev/null 2>&1 && return 0
  [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq; APT_UPDATED=1; }
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg=$version" >/dev/null; then
    log "$pkg=$version is no longer served; installing the distribution's $pkg"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
  fi
}

apt_install bazel-bootstrap "$BAZEL_DEB"
apt_install nginx-light "$NGINX_DEB"
apt_install libnginx-mod-http-dav-ext "$NGINX_DAV_EXT_DEB"
apt_install docker-registry "$REGISTRY_DEB"
apt_install skopeo "$SKOPEO_DEB"
BAZEL_BIN=/usr/bin/bazel-4
[ -x "$BAZEL_BIN" ] || { log "no $BAZEL_BIN after installing bazel-bootstrap"; exit 1; }
# Debian's /usr/bin/bazel wrapper looks for /usr/bin/bazel-<.bazelversion>.
[ -e "/usr/bin/bazel-$(cat .bazelversion)" ] || ln -s "$BAZEL_BIN" "/usr/bin/bazel-$(cat .bazelversion)"

command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || [ -n "${CUDA_PATH:-}" ] \
  || { log "no CUDA toolkit: install CUDA 13 (nvcc) or set CUDA_PATH"; exit 1; }

# bazelisk can't download Bazel here: point it at the local binary (git-ignored, machine-specific).
[ -d node_modules/@bazel/bazelisk ] || npm ci --no-audit --no-fund --loglevel=error
echo "USE_BAZEL_VERSION=$BAZEL_BIN" > .bazeliskrc

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# Only the headers of the CUTLASS wheel are used: skip its Python dependencies.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "$CUTLASS_WHEEL"
# compat: a .pth path entry, not an import hook (every Python start, and so every cubinstore-nvcc call, skips ~8 ms)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . --config-settings editable_mode=compat
# That builds the optional C helper of a first load (setup.py); the tests run both of its paths.
.venv/bin/python -c "from cubinstore.internals import native; assert native.built()" 2>/dev/null \
  || { log "the C helper cubinstore/_core/_native.c did not build: install a C compiler and the headers of $("$PYTHON" --version) (python3-dev)"; exit 1; }

if [ ! -x .venv-buildgrid/bin/bgd ]; then
  "$PYTHON" -m venv .venv-buildgrid
  .venv-buildgrid/bin/python -m pip install -q --disable-pip-version-check -r requirements-buildgrid.txt
fi
# Bazel 7 in a Debian sid root, PostgreSQL and psycopg2 for the remote-execution tests: the
# README's two commands set up everything the suite needs (idempotent; a second run only checks).
tools/bootstrap_bazel7.sh
log "ready: $("$BAZEL_BIN" --version 2>/dev/null | head -1), $(.venv/bin/python --version)"
