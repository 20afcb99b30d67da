#!/usr/bin/env bash
# `shadow ab` and `shadow router-eval` end to end against a live `shadow serve` (embedded, random
# weights by default), writing their --json outputs for the notebook. On the CPU with tiny this
# shows the mechanics; on a GPU pass MODEL and GENERATOR (e.g. qwen3.5-0.8b and qwen3.5-4b).
# Usage: [MODEL=tiny GENERATOR=tiny DEVICE=cpu PROMPT=2000 OUTPUT=32 RUNS=3 TEMPLATE= VOICE= SHARE= SERVE_ARGS= NO_EVAL=] bash experiments/serve_demo.sh OUTDIR
set -euo pipefail
out=${1:-out}; mkdir -p "$out"
model=${MODEL:-tiny}; generator=${GENERATOR:-$model}; device=${DEVICE:-cpu}
port=${PORT:-8790}; work=$(mktemp -d)
# TEMPLATE: a Jinja chat template for the embedded generator (Qwen3.5's opens a think block: its
# turns reason, so the thinking lines and the voice run); VOICE=1: `ab --voice`
# SHARE: serve's --share (default 0.02); SERVE_ARGS: more serve options
shadow serve --model "$model" --generator-model "$generator" --device "$device" --port "$port" \
  --disk "$work/disk" --journal "$work/journal.jsonl" ${TEMPLATE:+--chat-template "$TEMPLATE"} \
  ${SHARE:+--share "$SHARE"} ${SERVE_ARGS:-} > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
started=$(date +%s)
until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
  if ! kill -0 $server 2>/dev/null || [ $(( $(date +%s) - started )) -gt "${START_TIMEOUT:-600}" ]; then
    echo "shadow serve did not come up; its log:"; tail -n 30 "$out/serve.log"; exit 1
  fi
  sleep 0.5
done
echo "serve up after $(( $(date +%s) - started )) s"
# warm-up: kernels autotune and the shadow captures its CUDA graphs before anything is timed
curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'x-session-id: warmup' \
  -d "{\"messages\": [{\"role\": \"user\", \"content\": \"$(printf 'warm up the kernels %.0s' $(seq 1 400))\"}], \"max_tokens\": 8}" > /dev/null
sleep 3
timeout "${AB_TIMEOUT:-900}" shadow ab --url "http://127.0.0.1:$port/v1" --prompt-tokens "${PROMPT:-2000}" \
  --output-tokens "${OUTPUT:-32}" --runs "${RUNS:-3}" --pause 1.5 ${VOICE:+--voice} --plot "$out/ab.png" --csv "$out/ab.csv" --json \
  > "$out/ab.txt" 2> >(tee "$out/ab.log" >&2) || status=$?
if [ "${status:-0}" = 124 ]; then  # timed out: every thread's stack of the server, into its log
  echo "ab timed out; the server's threads:"; kill -USR1 $server; sleep 2; tail -n 80 "$out/serve.log"; exit 1
fi
tail -n 1 "$out/ab.txt" > "$out/ab.json"
if [ -n "${NO_EVAL:-}" ]; then  # the A/B alone
  curl -s "http://127.0.0.1:$port/v1/shadow/status" > "$out/status.json" || true
  kill -TERM $server; wait $server || true; cp "$work/journal.jsonl" "$out/journal.jsonl" 2>/dev/null || true
  tail -n 4 "$out/ab.txt" | cut -c1-600; exit 0
fi
# labelled asks: a reference label per session (random labels: the mechanics, not the router)
python3 - "$port" <<'PY'
import httpx, random, sys
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
rng = random.Random(0)
for k in range(8):
    text = " ".join(rng.choice(["def", "fix", "test", "hello", "thanks", "why", "plot"]) for _ in range(300))
    httpx.post(base + "/chat/completions", headers={"x-session-id": f"demo-{k}"}, timeout=300,
               json={"messages": [{"role": "user", "content": text}], "max_tokens": 8})
    httpx.post(base + "/shadow/ask", timeout=300, json={
        "session": f"demo-{k}", "question": "Is this turn A (code) or B (chat)?", "choices": ["A", "B"],
        "reference": rng.choice("AAB"), "fresh": k % 2 == 0})
PY
kill -TERM $server; wait $server || true
cp "$work/journal.jsonl" "$out/journal.jsonl"  # every turn's status lines and the voice's attempts
shadow router-eval --journal "$work/journal.jsonl" --sessions "$work/disk" --model "$model" --device "$device" --json > "$out/router-eval.txt"
tail -n 1 "$out/router-eval.txt" > "$out/router-eval.json"
tail -n 3 "$out/ab.txt" "$out/router-eval.txt"
