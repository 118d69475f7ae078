#!/usr/bin/env bash
# Installs the Bazel 7 toolchain that tools/bazel7 runs, then exits. Idempotent: a second run
# only checks. Run after tools/bootstrap.sh (it uses .venv's pip). Needs root (debootstrap,
# chroot). The one Bazel >= 6 that Debian ships is sid's bazel-bootstrap, which needs sid's
# glibc, so everything lives in a Debian sid root (default /var/lib/cubinstore/sid,
# $CUBINSTORE_SID_ROOT):
#   - debootstrap (host, Debian) makes a minbase sid root from the mirror apt uses here;
#   - sid: bazel-bootstrap 7.7.1 (plus libblake3-0, which it needs and does not declare),
#     gcc-14 (sid's default gcc is newer than nvcc accepts), buildbox (casd, worker, runners)
#     and bubblewrap for the remote-execution tests;
#   - PyPI: the CUDA 13.5 nvcc wheels (CUDA 13.0's headers do not compile against sid's glibc)
#     and the nvidia-cutlass headers, into <root>/opt/cubinstore/site.
# Pinned versions, else the distribution's. Also installs PostgreSQL on the host (BuildGrid's
# scheduler for the remote-execution tests) and psycopg2 into .venv-buildgrid.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=${CUBINSTORE_SID_ROOT:-/var/lib/cubinstore/sid}
SITE=/opt/cubinstore/site
DEBOOTSTRAP_DEB=1.0.128+nmu2+deb12u2
POSTGRESQL_DEB=15+248+deb12u1
SID_DEBS=(
  bazel-bootstrap=7.7.1+ds-8+b1
  libblake3-0=1.8.2-1
  gcc-14=14.4.0-3
  g++-14=14.4.0-3
  buildbox=1.4.30+dfsg-1+b1
  bubblewrap=0.13.1-1
)
WHEELS=(
  nvidia-cuda-nvcc==13.5.37
  nvidia-cuda-crt==13.5.37
  nvidia-nvvm==13.5.37
  nvidia-cuda-runtime==13.5.37
  nvidia-cuda-cccl==13.3.5.0.6
  nvidia-cutlass==4.2.0.0
)
# The root is complete when its stamp names exactly these pins.
STAMP="$ROOT/.cubinstore-ready"
WANT="${SID_DEBS[*]} ${WHEELS[*]}"

log() { printf 'bootstrap_bazel7: %s\n' "$*" >&2; }

apt_install() {  # apt_install PACKAGE VERSION (host): the pinned version, else the distribution's
  local pkg=$1 version=$2
  dpkg -s "$pkg" >/dev/null 2>&1 && return 0
  [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq; APT_UPDATED=1; }
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg=$version" >/dev/null; then
    log "$pkg=$version is no longer served; installing the distribution's $pkg"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
  fi
}

mirror() {  # the Debian archive the host's apt uses (not the security one)
  if [ -n "${CUBINSTORE_SID_MIRROR:-}" ]; then
    echo "$CUBINSTORE_SID_MIRROR"
    return
  fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' | grep -v security | head -1 || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" {print $2}' /etc/apt/sources.list 2>/dev/null | grep -v security | head -1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

in_root() {  # in_root COMMAND...: runs a command chrooted into the root, with /proc and /dev
  unshare --mount --propagation private -- /bin/sh -c \
    'mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && exec /usr/sbin/chroot "$0" "$@"' \
    "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"
}

sid_install() {  # sid_install PKG=VERSION...: each pinned version, else the distribution's
  local spec missing=()
  for spec in "$@"; do
    in_root dpkg -s "${spec%%=*}" >/dev/null 2>&1 || missing+=("$spec")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  in_root apt-get update -qq
  if ! in_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    log "a pinned sid package is no longer served (${missing[*]}); installing the distribution's"
    in_root apt-get install -y -qq --no-install-recommends "${missing[@]%%=*}" >/dev/null
  fi
}

apt_install postgresql "$POSTGRESQL_DEB"
if [ -x .venv-buildgrid/bin/python ]; then
  .venv-buildgrid/bin/python -m pip install -q --disable-pip-version-check -r requirements-buildgrid-rbe.txt
fi

if [ -e "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  log "ready: bazel-bootstrap $(in_root dpkg-query -W -f='${Version}' bazel-bootstrap) in $ROOT"
  exit 0
fi
[ "$(id -u)" = 0 ] || { log "needs root (debootstrap, chroot)"; exit 1; }
[ -x .venv/bin/python ] || { log "no .venv: run tools/bootstrap.sh first"; exit 1; }
rm -f "$STAMP"

apt_install debootstrap "$DEBOOTSTRAP_DEB"
if [ ! -e "$ROOT/etc/debian_version" ]; then
  log "debootstrap sid into $ROOT from $(mirror) (a few minutes)"
  rm -rf "$ROOT.partial"
  mkdir -p "$(dirname "$ROOT")"
  debootstrap --variant=minbase sid "$ROOT.partial" "$(mirror)" >/dev/null
  mv "$ROOT.partial" "$ROOT"
fi
# A snapshot mirror's sid Release file reads as expired.
echo 'Acquire::Check-Valid-Until "false";' > "$ROOT/etc/apt/apt.conf.d/99cubinstore"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
sid_install "${SID_DEBS[@]}"

# Headers and tools only: no Python runs them, so the host's pip installs them for any Python.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --upgrade \
  --target "$ROOT$SITE" "${WHEELS[@]}"
[ -x "$ROOT$SITE/nvidia/cu13/bin/nvcc" ] || { log "no nvcc in $ROOT$SITE/nvidia/cu13"; exit 1; }

echo "$WANT" > "$STAMP"
log "ready: Bazel 7, CUDA 13.5 and gcc-14 in $ROOT (tools/bazel7)"
