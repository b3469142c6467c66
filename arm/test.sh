#!/usr/bin/env bash
# The pure-Python suite under aarch64 Python, in the emulated arm64 tree (make arm-test).
#
#   arm/test.sh TREE REPO OUT_DIR [PYTEST_ARGS...]
#
# Copies REPO's files (tracked and new, as git lists them) to TREE/src, makes a
# venv in the tree from PyPI's aarch64 wheels (cached in the tree, keyed by
# pyproject.toml), and runs pytest there in a private mount namespace (proc,
# sys and dev bound in; the mounts vanish with it). Default PYTEST_ARGS:
# -m "not engine and not cgroup". The tree runs with a clean environment (the
# host's SSL_CERT_FILE, REQUESTS_CA_BUNDLE and PIP_* would point pip at the
# tree's own CA bundle and folders it does not have). The junit report lands in
# OUT_DIR/pytest-aarch64.xml, the log beside it. Needs root (chroot).
set -euo pipefail

tree=$1 repo=$2 outdir=$3
shift 3
[ $# -gt 0 ] || set -- -m "not engine and not cgroup"
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
key=$(sha256sum <"$repo/pyproject.toml" | cut -c1-12)

rm -rf "$tree/src"
mkdir -p "$tree/src" "$tree/out"
(cd "$repo" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$tree/src"
# The host's trust store (it may hold a proxy's CA) and resolver, for pip.
cp /etc/ssl/certs/ca-certificates.crt "$tree/etc/ssl/certs/slmguard-host-ca.crt"
cp -L /etc/resolv.conf "$tree/etc/resolv.conf"
printf '%q ' "$@" >"$tree/out/pytest-args"

cat >"$tree/out/run.sh" <<SCRIPT
set -eu
export PIP_CERT=/etc/ssl/certs/slmguard-host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/root
uname -m
if [ ! -x /venv-$key/bin/pytest ]; then
  rm -rf /venv-$key
  python3 -m venv /venv-$key
  /venv-$key/bin/pip install -q --upgrade pip
  /venv-$key/bin/pip install -q -e '/src[serve,test]'
fi
/venv-$key/bin/python -c 'import platform, sys; print(platform.machine(), sys.version.split()[0])'
cd /src
eval "set -- \$(cat /out/pytest-args)"
/venv-$key/bin/python -m pytest -p no:cacheprovider -q -rfE --junitxml=/out/pytest-aarch64.xml "\$@"
SCRIPT

status=0
unshare --mount --fork sh -c '
  set -e
  mount --make-rprivate /
  mount -t proc proc "$1/proc"
  mount --rbind /sys "$1/sys"
  mount --rbind /dev "$1/dev"
  chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 /bin/sh /out/run.sh
' sh "$tree" 2>&1 | tee "$outdir/pytest-aarch64.log" || status=$?
mkdir -p "$outdir" && cp "$tree/out/pytest-aarch64.xml" "$outdir/" 2>/dev/null || true
exit "$status"
