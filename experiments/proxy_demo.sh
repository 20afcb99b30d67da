#!/usr/bin/env bash
# `shadow ab` through a proxy: an engine in a process of its own (this project's embedded engine,
# its own shadow off: `serve --no-shadow`, speaking vLLM's dialect), `shadow serve --upstream` in
# front of it in another process on the same device, and `shadow ab` through the proxy, which
# switches the proxy's shadow off and on. The engine never pauses for the proxy's shadow: what
# the proxy's reading costs the engine's decode is what this measures.
# Usage: [MODEL=tiny GENERATOR=tiny DEVICE=cpu PROMPT=2000 OUTPUT=32 RUNS=3 SHARE= PROXY_ARGS=] bash experiments/proxy_demo.sh OUTDIR
set -euo pipefail
out=${1:-out}; mkdir -p "$out"
model=${MODEL:-tiny}; generator=${GENERATOR:-$model}; device=${DEVICE:-cpu}
engine_port=${ENGINE_PORT:-8791}; port=${PORT:-8790}
shadow serve --no-shadow --model "$model" --generator-model "$generator" --device "$device" --port "$engine_port" \
  > "$out/engine.log" 2>&1 &
engine=$!
shadow serve --upstream "http://127.0.0.1:$engine_port/v1" --model "$model" --device "$device" --port "$port" \
  ${SHARE:+--share "$SHARE"} ${PROXY_ARGS:-} > "$out/proxy.log" 2>&1 &
proxy=$!
trap 'kill $proxy $engine 2>/dev/null || true' EXIT
started=$(date +%s)
up() { curl -sf "http://127.0.0.1:$1/v1/shadow/status" | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["ready"] else 1)'; }
until up "$engine_port" && up "$port"; do
  if ! kill -0 $engine 2>/dev/null || ! kill -0 $proxy 2>/dev/null || [ $(( $(date +%s) - started )) -gt "${START_TIMEOUT:-600}" ]; then
    echo "engine or proxy did not come up"; tail -n 20 "$out/engine.log" "$out/proxy.log"; exit 1
  fi
  sleep 0.5
done
echo "engine and proxy up after $(( $(date +%s) - started )) s"
curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'x-session-id: warmup' \
  -d "{\"messages\": [{\"role\": \"user\", \"content\": \"$(printf 'warm up the kernels %.0s' $(seq 1 400))\"}], \"max_tokens\": 8}" > /dev/null
sleep 3
timeout "${AB_TIMEOUT:-900}" shadow ab --url "http://127.0.0.1:$port/v1" --prompt-tokens "${PROMPT:-2000}" \
  --output-tokens "${OUTPUT:-32}" --runs "${RUNS:-3}" --pause 1.5 --plot "$out/ab.png" --csv "$out/ab.csv" --json \
  > "$out/ab.txt" 2> >(tee "$out/ab.log" >&2) || echo "ab exit $? (1: over the gate)"
tail -n 1 "$out/ab.txt" > "$out/ab.json"
curl -s "http://127.0.0.1:$port/v1/shadow/status" > "$out/proxy-status.json"
kill -TERM $proxy $engine; wait $proxy $engine || true
tail -n 4 "$out/ab.txt" | cut -c1-600
