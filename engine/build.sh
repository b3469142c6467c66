#!/usr/bin/env bash
# Build llama.cpp's llama-server once per machine from the llama.cpp source that the
# pinned llama-cpp-python sdist vendors (a PyPI file, checked against its sha256).
#
#   engine/build.sh OUT_DIR PYTHON VERSION SHA256 CMAKE_ARGS...
#
# OUT_DIR receives bin/llama-server, VERSION.txt (the binary's --version) and
# BUILD.txt (the inputs). The build runs in OUT_DIR.tmp and is renamed into place
# at the end, so an interrupted build leaves no usable-looking directory. cmake
# and ninja come from PyPI into the virtualenv of PYTHON; the only system
# requirement is a C++ compiler.
#
# For a cross build (engine/build-arm.sh) two variables say how to handle a
# binary this machine cannot run: ENGINE_STRIP (the strip for its
# architecture) and ENGINE_RUNNER (the command that runs it, e.g. qemu-user,
# for --version). ENGINE_PATCHES names patch files (space-separated paths)
# applied to the llama.cpp source before the build (`patch -p1`), in order:
# engine/grammar-max-work.patch in every build (the Makefile's, build-arm.sh's),
# the Vulkan build's engine/vulkan-headers-1.3.239.patch; the caller's cache key
# must cover them.
set -euo pipefail

out=$1 python=$2 version=$3 sha256=$4
shift 4
tmp="$out.tmp"
bindir=$(cd "$(dirname "$python")" && pwd)

rm -rf "$tmp"
mkdir -p "$tmp/src"
echo "engine: downloading the llama-cpp-python $version sdist (about 77 MB) from PyPI"
"$python" -m pip --disable-pip-version-check download -q --no-binary :all: --no-deps \
  -d "$tmp/src" "llama-cpp-python==$version"
sdist=$(ls "$tmp"/src/llama_cpp_python-"$version".tar.gz)
have=$(sha256sum "$sdist" | cut -d' ' -f1)
if [ "$have" != "$sha256" ]; then
  echo "engine: $sdist has sha256 $have, expected $sha256: refusing to build it" >&2
  exit 1
fi
tar -xzf "$sdist" -C "$tmp/src"
llama="$tmp/src/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$llama/tools/server/server.cpp" ] || { echo "engine: no tools/server in $sdist" >&2; exit 1; }
for p in ${ENGINE_PATCHES:-}; do
  echo "engine: applying $(basename "$p")"
  patch -s -p1 -d "$llama" <"$p" || { echo "engine: $p does not apply to $sdist" >&2; exit 1; }
done

jobs=$(nproc 2>/dev/null || echo 2)
echo "engine: building llama-server with $jobs jobs (10-20 minutes on 2 cores)"
"$bindir/cmake" -S "$llama" -B "$tmp/build" -G Ninja -DCMAKE_MAKE_PROGRAM="$bindir/ninja" \
  -DCMAKE_BUILD_TYPE=Release "$@" >"$tmp/cmake.log" 2>&1 \
  || { tail -40 "$tmp/cmake.log" >&2; exit 1; }
"$bindir/cmake" --build "$tmp/build" --target llama-server -j "$jobs"

mkdir -p "$tmp/bin"
cp "$tmp/build/bin/llama-server" "$tmp/bin/llama-server"
"${ENGINE_STRIP:-strip}" "$tmp/bin/llama-server" 2>/dev/null || true
# shellcheck disable=SC2086 # ENGINE_RUNNER is a command and its arguments
${ENGINE_RUNNER:-} "$tmp/bin/llama-server" --version >"$tmp/VERSION.txt" 2>&1
printf 'llama-cpp-python %s\nsha256 %s\ncmake %s\npatches %s\n' "$version" "$sha256" "$*" \
  "${ENGINE_PATCHES:-none}" >"$tmp/BUILD.txt"
rm -rf "$tmp/src" "$tmp/build"
rm -rf "$out"
mv "$tmp" "$out"
echo "engine: $(head -1 "$out/VERSION.txt") in $out/bin/llama-server"
