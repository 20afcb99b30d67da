#!/usr/bin/env bash
# A CUDA 13.0 toolkit for building (not running) CUDA code on a machine with no GPU and no CUDA
# install: NVIDIA's own PyPI wheels (nvcc, crt, nvvm, the runtime, cccl, cuBLAS), laid out as CMake's
# FindCUDAToolkit expects, plus a link-time stub of the driver library (libcuda.so.1), which no
# wheel ships. The stub defines every function cuda.h declares and is never loaded: a binary
# linked against it needs the real driver where it runs.
#
#   bash experiments/cuda_toolkit_from_wheels.sh [DIR]   # prints the toolkit's root as its last line
#
# DIR defaults to ~/.cache/shadow/cuda-13.0-wheels. Idempotent (a finished toolkit is reused).
# Needs pip (PyPI) and a C compiler. The versions match a device with the 13.0 toolkit.
set -euo pipefail

DIR="${1:-$HOME/.cache/shadow/cuda-13.0-wheels}"
ROOT="$DIR/site/nvidia/cu13"
if [ -f "$DIR/.done" ]; then echo "$ROOT"; exit 0; fi
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
        nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14)
mkdir -p "$DIR"
python3 -m pip install -q --no-deps --no-compile --target "$DIR/site" "${WHEELS[@]}" >&2
[ -x "$ROOT/bin/nvcc" ] && [ -f "$ROOT/include/cuda.h" ] || { echo "no nvcc or cuda.h under $ROOT" >&2; exit 1; }

# the layout FindCUDAToolkit and nvcc.profile read: lib64/, unversioned .so names, lib64/stubs/
[ -e "$ROOT/lib64" ] || ln -s lib "$ROOT/lib64"
for lib in cudart cublas cublasLt nvvm; do
  versioned=$(cd "$ROOT/lib" && ls "lib$lib.so."* | head -n 1)
  [ -e "$ROOT/lib/lib$lib.so" ] || ln -s "$versioned" "$ROOT/lib/lib$lib.so"
done

# the driver's stub: every `CUresult cu...(` of the preprocessed cuda.h, as a function that fails
mkdir -p "$ROOT/lib/stubs" "$DIR/stub"
gcc -E -P -I "$ROOT/include" "$ROOT/include/cuda.h" > "$DIR/stub/cuda_pp.h"
python3 - "$DIR/stub/cuda_pp.h" "$DIR/stub/cuda_stub.c" <<'EOF'
import re, sys
names = sorted(set(re.findall(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(", open(sys.argv[1]).read())))
if len(names) < 100:
    sys.exit(f"only {len(names)} driver functions found in cuda.h")
with open(sys.argv[2], "w") as f:
    f.write("/* link-time stub of libcuda.so.1: never loaded */\n")
    f.writelines(f"int {n}(void) {{ return 999; }}\n" for n in names)
print(f"{len(names)} driver functions in the stub", file=sys.stderr)
EOF
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$DIR/stub/cuda_stub.c"
touch "$DIR/.done"
echo "$ROOT"
