#!/usr/bin/env bash
# An emulated Debian arm64 tree for `make arm-test`, cached.
#
#   arm/tree.sh CACHE_DIR [MIRROR]
#
# mmdebstrap bootstraps Debian bookworm for arm64 (minbase plus Python, the
# tools the suite shells out to: systemd-analyze, free, swapon, sysctl) from
# Debian's archive; its maintainer scripts run under qemu-user through
# binfmt_misc (qemu-user-static registers aarch64 with the F flag, so nothing
# is copied into the tree). The tree lands in CACHE_DIR/tree-KEY, KEY hashing
# this script; its path is printed on the last line. Needs root.
set -euo pipefail

cache=$1
mirror=${2:-http://deb.debian.org/debian}
suite=bookworm
packages=python3,python3-venv,systemd,procps,mount,ca-certificates
key=$(sha256sum <"$0" | cut -c1-12)
out="$cache/tree-$key"
if [ ! -x "$out/usr/bin/python3" ]; then
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || {
    echo "arm: aarch64 binaries do not run here (no binfmt_misc entry qemu-aarch64): make arm-tools" >&2
    exit 1
  }
  rm -rf "$out.tmp"
  mkdir -p "$cache"
  echo "arm: bootstrapping Debian $suite arm64 in $out (a few minutes, emulated)" >&2
  mmdebstrap --arch=arm64 --variant=minbase --include="$packages" \
    --dpkgopt=path-exclude=/usr/share/doc/* --dpkgopt=path-exclude=/usr/share/man/* \
    --dpkgopt=path-exclude=/usr/share/locale/* "$suite" "$out.tmp" "$mirror" >&2
  rm -f "$out.tmp"/var/cache/apt/archives/*.deb
  mv "$out.tmp" "$out"
fi
echo "$out"
