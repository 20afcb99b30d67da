#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (Release, portable) from the llama.cpp sources vendored in PyPI's
# llama-cpp-python sdist, and install it under $SHADOW_LLAMA_HOME/bin.
#
#   bash experiments/build_llama_server.sh            # CPU, from the sdist; prints the binary's path as its last line
#   bash experiments/build_llama_server.sh pack DIR   # the vendored sources, packed for a device machine:
#                                                     #   DIR/llama.cpp-VERSION.tar.xz (about 5 MB)
#   bash experiments/build_llama_server.sh cuda [TAR] # CUDA (sm_90: H100, H200) from a pack (default
#                                                     #   .carry/llama-src/llama.cpp-VERSION.tar.xz); prints the path
#   bash experiments/build_llama_server.sh cpu-from-pack [TAR]   # the CPU build from a pack (checks a pack builds)
#   bash experiments/build_llama_server.sh cuda-cross [TAR]      # the CUDA build (sm_90) on a machine with no GPU or
#                                                     #   CUDA, from NVIDIA's PyPI wheels (cuda_toolkit_from_wheels.sh):
#                                                     #   the runtime linked in, cuBLAS and the driver needed where
#                                                     #   it runs (about 40 min on 2 cores beside other work: its last line said 2,374 s on 2026-12-08,
#                                                     #   2,438 s in docs/BENCHMARKS.md)
#
# Idempotent: when $SHADOW_LLAMA_HOME/bin/llama-server already runs (`--version`), nothing is built.
# SHADOW_LLAMA_HOME defaults to ~/.cache/shadow/engines/llama-server-VERSION (CPU) and
# ~/.cache/shadow/engines/llama-server-VERSION-cuda (CUDA) and ...-VERSION-packed (cpu-from-pack). Portable: GGML_NATIVE=OFF (x86-64:
# AVX2/FMA/F16C, no -march=native), static libraries, no OpenMP, no curl/OpenSSL, no web UI, so a
# cached binary runs on another CPU of the same arch. Needs cmake, a C++17 compiler, pip (the sdist
# only); ninja when present; CUDA: nvcc. About 15-20 min on 2 cores (CPU); CUDA with 16 jobs about
# 3 min on an H100's host. SHADOW_LLAMA_JOBS: build jobs (2; CUDA 16). SHADOW_LLAMA_BUILD_TIMEOUT:
# seconds the build may take before it is stopped (CUDA 300; CPU none). SHADOW_LLAMA_CONFIGURE_ONLY=1:
# stop after cmake's configure (nothing installed).
# A pack leaves out what llama-server's build never reads: the models, docs, tests, benches,
# examples, conversion scripts, the web UI's tests and every ggml backend but CPU and CUDA.
set -euo pipefail

VERSION=0.3.36
MODE=${1:-cpu}
case $MODE in
  cpu|pack) SUFFIX= ;;
  cpu-from-pack) SUFFIX=-packed ;;
  cuda) SUFFIX=-cuda ;;
  cuda-cross) SUFFIX=-cuda-cross ;;
  *) echo "usage: build_llama_server.sh [cpu | pack DIR | cuda [TAR] | cuda-cross [TAR] | cpu-from-pack [TAR]]" >&2; exit 2 ;;
esac
SDIST_HOME="$HOME/.cache/shadow/engines/llama-server-$VERSION"
HOME_DIR="${SHADOW_LLAMA_HOME:-$HOME/.cache/shadow/engines/llama-server-$VERSION$SUFFIX}"
BIN="$HOME_DIR/bin/llama-server"
PACK_NAME="llama.cpp-$VERSION.tar.xz"

sdist() {  # the sdist's path, downloaded once
  local dir="${SHADOW_LLAMA_SDIST_DIR:-$SDIST_HOME/sdist}"
  mkdir -p "$dir"
  local path="$dir/llama_cpp_python-$VERSION.tar.gz"
  if [ ! -s "$path" ]; then
    echo "downloading llama-cpp-python==$VERSION (sdist) ..." >&2
    python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$dir" >&2
  fi
  echo "$path"
}

if [ "$MODE" = pack ]; then
  dest=${2:?pack needs a folder}
  mkdir -p "$dest"
  if [ -s "$dest/$PACK_NAME" ]; then echo "$dest/$PACK_NAME"; exit 0; fi
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  tar -xzf "$(sdist)" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  excludes=()
  for d in models docs tests benches examples media gguf-py conversion .github .devops pocs tools/ui/tests; do
    excludes+=(--exclude="llama.cpp/$d"); done
  for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
    excludes+=(--exclude="llama.cpp/ggml/src/ggml-$b"); done
  tar --anchored "${excludes[@]}" -C "$tmp/llama_cpp_python-$VERSION/vendor" -cJf "$tmp/$PACK_NAME" llama.cpp
  mv "$tmp/$PACK_NAME" "$dest/$PACK_NAME"
  echo "packed $(du -h "$dest/$PACK_NAME" | cut -f1) of llama.cpp sources" >&2
  echo "$dest/$PACK_NAME"
  exit 0
fi

if [ -x "$BIN" ] && { [ "$MODE" = cuda-cross ] || "$BIN" --version >/dev/null 2>&1; }; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$HOME_DIR/bin"
WORK="$(mktemp -d "$HOME_DIR/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
if [ "$MODE" = cpu ]; then
  SDIST="$(sdist)"
  tar -xzf "$SDIST" -C "$WORK"
  SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
else
  PACK="${2:-.carry/llama-src/$PACK_NAME}"
  [ -s "$PACK" ] || { echo "no packed sources at $PACK: run 'bash experiments/build_llama_server.sh pack .carry/llama-src' first" >&2; exit 1; }
  tar -xJf "$PACK" -C "$WORK"
  SRC="$WORK/llama.cpp"
fi
[ -f "$SRC/tools/server/server.cpp" ] || { echo "no llama.cpp server sources in ${SDIST:-$PACK}" >&2; exit 1; }

GPU=()
JOBS="${SHADOW_LLAMA_JOBS:-2}"
LIMIT="${SHADOW_LLAMA_BUILD_TIMEOUT:-0}"
if [ "$MODE" = cuda ]; then
  GPU=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  JOBS="${SHADOW_LLAMA_JOBS:-16}"
  LIMIT="${SHADOW_LLAMA_BUILD_TIMEOUT:-300}"
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "no nvcc: the CUDA build needs the CUDA toolkit" >&2; exit 1; }
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
elif [ "$MODE" = cuda-cross ]; then
  TOOLKIT=$(bash "$(dirname "$0")/cuda_toolkit_from_wheels.sh" | tail -n 1)
  # no RPATH (the running machine's own libraries), the runtime static (no wheel's libcudart needed there)
  GPU=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$TOOLKIT/bin/nvcc"
       -DCMAKE_CUDA_HOST_COMPILER="$(command -v g++)" -DCUDAToolkit_ROOT="$TOOLKIT"
       -DCUDA_cudart_LIBRARY="$TOOLKIT/lib/libcudart_static.a" -DCMAKE_CUDA_RUNTIME_LIBRARY=Static -DCMAKE_SKIP_RPATH=ON)
  export PATH=$TOOLKIT/bin:$PATH
fi
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
  -DLLAMA_BUILD_COMMIT="llama-cpp-python-$VERSION" "${GPU[@]}" >&2
echo "configured in $(( $(date +%s) - start )) s" >&2
if [ "${SHADOW_LLAMA_CONFIGURE_ONLY:-0}" = 1 ]; then
  echo "configure only: nothing built" >&2
  exit 0
fi
BUILD=(cmake --build "$WORK/build" --target llama-server -j "$JOBS")
if [ "$LIMIT" -gt 0 ]; then BUILD=(timeout "$LIMIT" "${BUILD[@]}"); fi
"${BUILD[@]}" >&2 || { echo "the build failed or passed ${LIMIT} s (exit $?)" >&2; exit 1; }
install -m 0755 "$WORK/build/bin/llama-server" "$BIN.tmp"
if [ "$MODE" = cuda-cross ]; then  # it cannot run here (no driver): stripped for the carry, not run
  strip "$BIN.tmp"; mv "$BIN.tmp" "$BIN"
  echo "built llama-server (cuda-cross) in $(( $(date +%s) - start )) s with -j$JOBS; it needs $(readelf -d "$BIN" \
    | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | paste -sd' ' -) where it runs" >&2
  echo "$BIN"; exit 0
fi
mv "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "built llama-server ($MODE) in $(( $(date +%s) - start )) s with -j$JOBS" >&2
echo "$BIN"
