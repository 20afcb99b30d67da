#!/usr/bin/env bash
# One device call on the H200: install the carried wheels, run the GPU tests, then the
# measurements recorded in docs/BENCHMARKS.md. Usage (from the repo root, on the device):
#   bash experiments/h200.sh [smoke|full]
# Needs .whl/ (../shared/tools/device-wheels.sh) and .carry/data/*.traj.json carried.
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 FLA_CACHE_RESULTS=1
export SHADOW_CACHE=/tmp/shadow-cache TRITON_CACHE_DIR=/tmp/triton-cache
shadow() { python3 -c 'from cli.main import main; main()' "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, triton, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "fla", fla.__version__)'

echo "== gpu tests"
timeout 300 python3 -m pytest -q -x tests/test_gpu.py tests/test_piecewise.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"

if [ "$mode" = smoke ]; then
  echo "== smoke read-rate (0.8B)"
  timeout 300 shadow read-rate --model qwen3.5-0.8b --device cuda --contexts 0,16384 --full-read-tokens 16384 \
    --ask-tokens 8192 --reference-tokens 4096 --repeats 3 --json 2>&1 | tail -20
  exit 0
fi

D=.carry/data
echo "== verify-exact on the H200 (0.8B shape, two real conversations over 40k tokens)"
timeout 400 shadow verify-exact --model qwen3.5-0.8b --device cuda --dtype auto --grid 512 --against-grid 2048 \
  --conversation $D/django__django-16950.traj.json --conversation $D/pytest-dev__pytest-6197.traj.json \
  --json > "$OUT/verify-exact-h200.txt" 2>&1; tail -c 1500 "$OUT/verify-exact-h200.txt"

echo "== read-rate (0.8B)"
timeout 500 shadow read-rate --model qwen3.5-0.8b --device cuda --grid 512 --grid 256 --grid 1024 --grid 2048 --grid 4096 \
  --contexts 0,16384,65536,100352 --repeats 7 --plot "$OUT/read-rate-h200.png" --csv "$OUT/read-rate-h200.csv" \
  --json > "$OUT/read-rate-h200.txt" 2>&1; tail -c 2500 "$OUT/read-rate-h200.txt"
