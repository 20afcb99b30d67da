#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only, Release, portable) from the llama.cpp sources vendored
# in PyPI's llama-cpp-python sdist, and install it under $SHADOW_LLAMA_HOME/bin.
#
#   bash experiments/build_llama_server.sh        # prints the binary's path as its last line
#
# Idempotent: when $SHADOW_LLAMA_HOME/bin/llama-server already runs (`--version`), nothing is built.
# Portable: GGML_NATIVE=OFF (x86-64: AVX2/FMA/F16C, no -march=native), static libraries, no OpenMP,
# no curl/OpenSSL, no web UI, so a cached binary runs on another CPU of the same arch.
# Needs cmake, a C++17 compiler, pip; ninja when present. About 15-20 min on 2 cores.
set -euo pipefail

VERSION=0.3.36
HOME_DIR="${SHADOW_LLAMA_HOME:-$HOME/.cache/shadow/engines/llama-server-$VERSION}"
BIN="$HOME_DIR/bin/llama-server"
JOBS="${SHADOW_LLAMA_JOBS:-2}"

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$HOME_DIR/sdist" "$HOME_DIR/bin"
SDIST="$HOME_DIR/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -s "$SDIST" ]; then
  echo "downloading llama-cpp-python==$VERSION (sdist) ..." >&2
  python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$HOME_DIR/sdist" >&2
fi

WORK="$(mktemp -d "$HOME_DIR/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/server.cpp" ] || { echo "no llama.cpp server sources in $SDIST" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
start=$(date +%s)
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_COMMIT="llama-cpp-python-$VERSION" >&2
cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2
install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "built llama-server in $(( $(date +%s) - start )) s with -j$JOBS" >&2
echo "$BIN"
