#!/usr/bin/env bash
# Cross-build llama-server for one aarch64 CPU profile (make arm), cached like the
# x86 build.
#
#   engine/build-arm.sh CACHE_DIR PYTHON VERSION SHA256 PROFILE MARCH
#
# PROFILE names the build (dotprod, armv8, i8mm), MARCH is its -march
# (GGML_CPU_ARM_ARCH, with GGML_NATIVE=OFF). The source, its sha256 check and the
# build itself are engine/build.sh's; this adds the aarch64 toolchain
# (engine/aarch64-linux-gnu.cmake, Debian's g++-aarch64-linux-gnu and its
# sysroot /usr/aarch64-linux-gnu) and qemu-user to run the result's --version, and
# slmguard's engine patch (engine/grammar-max-work.patch, as every build has it).
# The binary lands in CACHE_DIR/llama-server-VERSION-aarch64-PROFILE-KEY/bin,
# KEY hashing the version, the sdist hash, the flags, the toolchain file and the
# patch; the path is printed on the last line.
set -euo pipefail

cache=$1 python=$2 version=$3 sha256=$4 profile=$5 march=$6
here=$(cd "$(dirname "$0")" && pwd)
toolchain="$here/aarch64-linux-gnu.cmake"
patches="$here/grammar-max-work.patch"
sysroot=/usr/aarch64-linux-gnu
for tool in aarch64-linux-gnu-g++ qemu-aarch64-static; do
  command -v "$tool" >/dev/null || {
    echo "engine: $tool is missing (Debian: g++-aarch64-linux-gnu qemu-user-static; make arm-tools)" >&2
    exit 1
  }
done

args=(-DGGML_NATIVE=OFF "-DGGML_CPU_ARM_ARCH=$march" -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
key=$(printf '%s' "$version $sha256 ${args[*]} $(sha256sum <"$toolchain") $(sha256sum <"$patches")" \
  | sha256sum | cut -c1-12)
out="$cache/llama-server-$version-aarch64-$profile-$key"
if [ ! -f "$out/.ok" ]; then
  mkdir -p "$cache"
  ENGINE_PATCHES="$patches" ENGINE_STRIP=aarch64-linux-gnu-strip \
    ENGINE_RUNNER="qemu-aarch64-static -cpu max -L $sysroot" \
    "$here/build.sh" "$out" "$python" "$version" "$sha256" "-DCMAKE_TOOLCHAIN_FILE=$toolchain" "${args[@]}" >&2
  printf 'profile %s\nmarch %s\nsysroot %s\n' "$profile" "$march" "$sysroot" >>"$out/BUILD.txt"
  touch "$out/.ok"
fi
echo "$out"
