#!/usr/bin/env bash
# The freshness tables in docs/FRESHNESS.md: the Mooncake conversation trace and the 43
# mini-swe-agent trajectories, at the source's read rate (87 ms per 1,000) and at this project's
# H200 rate (docs/results/read-rate-512-h200-r2-fixed.json, the fla-triton kernels, revision 2), idle only and idle + 2 % share.
# Usage: bash experiments/replay_tables.sh [DATA_DIR]   (default ../shared/data); outputs in out/.
set -euo pipefail
data=${1:-../shared/data}
mkdir -p out
shadow replay-ledger "$data/mooncake/conversation_trace.jsonl" --read-ms-per-1k 87 \
  --read-rate-json docs/results/read-rate-512-h200-r2-fixed.json --plot out/replay-mooncake.png --csv out/replay-mooncake.csv \
  --json | tee out/replay-mooncake.txt | tail -14
shadow replay-ledger "$data/trajectories/mini-swe-agent" --read-ms-per-1k 87 \
  --read-rate-json docs/results/read-rate-512-h200-r2-fixed.json --plot out/replay-trajectories.png \
  --csv out/replay-trajectories.csv --write-ledger out/trajectories.ledger.jsonl \
  --json | tee out/replay-trajectories.txt | tail -14
