#!/usr/bin/env bash
# The freshness tables in docs/FRESHNESS.md, from `shadow replay-ledger` runs of the read scheduler
# (shadow/core/schedule.py), at the source's read rate (87 ms per 1,000) and this project's H200 rate
# (docs/results/read-rate-512-h200-r2-fixed.json: 7.36 ms per 1,000, the fla-triton kernels, revision 2).
# Usage: bash experiments/replay_tables.sh [DATA_DIR] [STEP ...]   (DATA_DIR default ../shared/data;
#   steps: trajectories packed density traj-fleet mooncake mooncake-fleet mooncake-routes; default all).
# Each step prints its commands; outputs in out/freshness-*.txt (the last line of each is its JSON).
# The trajectories' ledger (out/trajectories.ledger.jsonl) is written by the first step and read by the next ones.
set -euo pipefail
data=../shared/data
if [ $# -gt 0 ] && [ -d "$1" ]; then data=$1; shift; fi
steps=${*:-trajectories packed density traj-fleet mooncake mooncake-fleet mooncake-routes}
H200=docs/results/read-rate-512-h200-r2-fixed.json
TRAJ=$data/trajectories/mini-swe-agent
MOON=$data/mooncake/conversation_trace.jsonl
LEDGER=out/trajectories.ledger.jsonl
mkdir -p out

run() {  # run NAME ARGS...: one replay-ledger command, echoed, its stdout kept in out/freshness-NAME.txt
  local name=$1; shift
  echo "== $name: shadow replay-ledger $*"
  shadow replay-ledger "$@" --json > "out/freshness-$name.txt"
  grep -v '^{' "out/freshness-$name.txt" | tail -n 40
}

for step in $steps; do
  case $step in
    trajectories)  # the 42 sessions as they ran (about 3.5 active at once)
      run trajectories "$TRAJ" --read-ms-per-1k 87 --read-rate-json "$H200" --share 0.02 --share 0.05 \
        --priorities all --priorities none --solve-share 97 --write-ledger "$LEDGER" ;;
    packed)  # 24 active at once on one engine: the priorities side by side, each step switched off, and the fewest step on
      run packed "$LEDGER" --pack 24 --read-rate-json "$H200" --share 0.02 --share 0.05 --priorities all \
        --priorities none --priorities recent,oldest --priorities running,oldest --priorities running,recent \
        --priorities recent --priorities question,running,fewest,recent,oldest --solve-share 97 ;;
    density)  # freshness against density: 4 to 48 active at once on one engine
      for k in 4 8 16 24 32 48; do
        run "density-$k" "$LEDGER" --pack "$k" --read-rate-json "$H200" --share 0.02 --solve-share 97
      done ;;
    traj-fleet)  # 24 active at once over 2 and 4 engines
      for n in 2 4; do
        run "traj-fleet-$n" "$LEDGER" --pack 24 --engines "$n" --read-rate-json "$H200" --share 0.02 --solve-share 97
      done ;;
    mooncake)  # the conversation trace on one 32-slot engine
      run mooncake "$MOON" --read-ms-per-1k 87 --read-rate-json "$H200" --share 0.02 --share 0.05 --solve-share 97 ;;
    mooncake-fleet)  # on 2 to 16 engines of 32 slots, sessions kept on their engines
      for n in 2 4 8; do
        run "mooncake-$n" "$MOON" --engines "$n" --read-rate-json "$H200" --share 0.02 --share 0.05 --solve-share 97
      done
      run mooncake-16 "$MOON" --engines 16 --read-ms-per-1k 87 --read-rate-json "$H200" --share 0.02 --share 0.05 \
        --solve-share 97 ;;
    mooncake-routes)  # 16 engines, other routes
      for route in hash round-robin; do
        run "mooncake-16-$route" "$MOON" --engines 16 --route "$route" --read-rate-json "$H200" --share 0.02 --share 0.05
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
