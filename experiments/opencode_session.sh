#!/usr/bin/env bash
# A real client: opencode (from npm) drives `shadow serve` (embedded, random tiny weights) through
# a multi-request session; the shadow reads it, and a question about the session is answered.
# Usage: bash experiments/opencode_session.sh [PORT]   (needs node/npm; installs opencode-ai here)
set -euo pipefail
port=${1:-8771}
work=$(mktemp -d)
npm install --prefix "$work/oc" --no-audit --no-fund opencode-ai@1.18.33 >/dev/null
shadow serve --port "$port" --grid 128 --journal "$work/journal.jsonl" > "$work/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
mkdir -p "$work/project" "$work/home"
cat > "$work/project/opencode.json" <<JSON
{"\$schema": "https://opencode.ai/config.json",
 "provider": {"shadow": {"npm": "@ai-sdk/openai-compatible", "name": "shadow serve",
   "options": {"baseURL": "http://127.0.0.1:$port/v1"},
   "models": {"tiny": {"name": "tiny", "limit": {"context": 200000, "output": 64}}}}},
 "model": "shadow/tiny", "small_model": "shadow/tiny"}
JSON
for i in $(seq 1 50); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 0.2; done
cd "$work/project"
export HOME=$work/home XDG_CONFIG_HOME=$work/home/.config XDG_DATA_HOME=$work/home/.local/share XDG_CACHE_HOME=$work/home/.cache
"$work/oc/node_modules/.bin/opencode" run "Write hello world in Python." > "$work/run1.log"
"$work/oc/node_modules/.bin/opencode" run -c "Now add a docstring." > "$work/run2.log"
"$work/oc/node_modules/.bin/opencode" run -c "And a test." > "$work/run3.log"
sleep 1
session=$(curl -s "http://127.0.0.1:$port/v1/shadow/status" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sessions"][0]["name"])')
curl -s "http://127.0.0.1:$port/v1/shadow/status" | python3 -m json.tool | head -40
curl -s "http://127.0.0.1:$port/v1/shadow/ask" -d "{\"session\": \"$session\", \"question\": \"Is this a coding task? A yes, B no\", \"choices\": [\"A\", \"B\"]}"
echo
echo "weights are random: the answer means nothing; what it shows is that the session was read and asked."
