#!/usr/bin/env bash
# The freshness tables and figures in docs/FRESHNESS.md, from `shadow replay-ledger` runs of the read
# scheduler (shadow/core/schedule.py).
# Usage: bash experiments/replay_tables.sh [DATA_DIR] [STEP ...]   (DATA_DIR default ../shared/data)
#   the live service's limits: ledger live batches predict tiers dense calls ablation share-sweep fleet curve
#   the idealised replay (ids at once, no cap, no voice, one chunk cost): trajectories packed density
#     traj-fleet mooncake mooncake-fleet mooncake-routes
#   default: every step, in that order. Each step prints its commands; outputs in out/freshness-*.txt (the
#   last line of each is its JSON); `python3 experiments/freshness_plots.py` draws the figures from them.
# The trajectories' ledger (out/trajectories.ledger.jsonl: the 42 trajectories re-rendered and re-tokenised
# with the Qwen3.5 vocabulary) is written by the `ledger` step and read by the others.
set -euo pipefail
data=../shared/data
if [ $# -gt 0 ] && [ -d "$1" ]; then data=$1; shift; fi
steps=${*:-ledger live batches predict tiers dense calls ablation share-sweep fleet curve trajectories packed density traj-fleet mooncake mooncake-fleet mooncake-routes}
RATE=${RATE:-docs/results/batch/read-rate-h200-batches.json}  # a read-rate run's costs by depth and batch (RATE=... to choose)
RUN=$(basename "$RATE" .json)  # names the outputs charged by it
H200=7.3647  # ms per 1,000: docs/results/read-rate-512-h200-r2-fixed.json, one chunk at 16k (the idealised runs)
IDEAL="--ids embedded --cap-gib 0 --voice-share 0 --samples 0 --read-ms-per-1k $H200"
TRAJ=$data/trajectories/mini-swe-agent
MOON=$data/mooncake/conversation_trace.jsonl
LEDGER=out/trajectories.ledger.jsonl
mkdir -p out

run() {  # run NAME ARGS...: one replay-ledger command, echoed, its stdout kept in out/freshness-NAME.txt
  local name=$1; shift
  echo "== $name: shadow replay-ledger $*"
  local rc=0
  shadow replay-ledger "$@" --json > "out/freshness-$name.txt" || rc=$?
  grep -v '^{' "out/freshness-$name.txt" | tail -n 60
  if [ "$rc" -ne 0 ]; then echo "== $name: exit $rc (1: a check failed, its lines above)"; fi
  if [ "$rc" -gt 1 ]; then exit "$rc"; fi
}

for step in $steps; do
  case $step in
    ledger)  # the 42 sessions as they ran, to a ledger
      run ledger "$TRAJ" --samples 0 --write-ledger "$LEDGER" ;;
    live)  # the live service's defaults, packed to 24 and 29 active on one engine
      for k in 24 29; do
        run "live-$k" "$LEDGER" --pack "$k" --share 0.02 --solve-share "p99 ask wait <= 50 ms"
      done ;;
    batches)  # batched reads against one session a read, packed to 29, the live cap and no cap
      for cap in 4 0; do
        for b in 1 8; do
          run "batch-29-cap$cap-b$b" "$LEDGER" --pack 29 --share 0.02 --cap-gib "$cap" --batch "$b" \
            --solve-share "fresh >= 97 %"
        done
      done
      for b in 1 8; do  # charged by an H200 read-rate run's own chunk and batch costs at six depths
        run "batch-29-cap0-b$b-$RUN" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --batch "$b" \
          --read-rate-json "$RATE" --solve-share "fresh >= 97 %"
      done
      for ms in 25 50; do  # batches allowed to hold the device longer (batches of 8 at depth)
        run "batch-29-cap0-b8-$RUN-ms$ms" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --batch 8 --batch-ms "$ms" \
          --read-rate-json "$RATE" --solve-share "fresh >= 97 %"
      done
      # how fast the share's reads must be: one flat cost a chunk at every depth, no batches
      run "batch-29-cap0-flat" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --read-ms-per-1k 7.3647 \
        --read-ms-per-1k 6.5 --read-ms-per-1k 6 --read-ms-per-1k 5.5 --read-ms-per-1k 5 --read-ms-per-1k 4 ;;
    predict)  # what the next prompt keeps, predicted: the ledger imported with the template's rendering
              # (out/trajectories-template.ledger.jsonl), packed to 29, idle + 2 %, charged $RATE; the
              # shipped defaults and the dense recipe, with --predict (the default), --read-ahead, --no-predict
      TL=out/trajectories-template.ledger.jsonl
      [ -s "$TL" ] || run predict-ledger "$TRAJ" --samples 0 --chat-template "$data/templates/qwen3.5.jinja" --write-ledger "$TL"
      S="--pack 29 --share 0.02 --samples 300 --read-rate-json $RATE"
      D="$S --batch 8 --batch-read-ms 50 --batch-wait-ms 1000"
      for arm in "" "--no-predict"; do
        run "predict-defaults$(echo "$arm" | tr -d ' -')" "$TL" $S $arm
      done
      for arm in "" "--read-ahead" "--no-predict"; do
        for target in "fresh >= 97 %" "ready >= 97 %"; do
          run "predict-dense$(echo "$arm" | tr -d ' -')-$(echo "$target" | cut -d' ' -f1)" "$TL" $D $arm --solve-share "$target"
        done
      done
      run predict-dense-novoice "$TL" $D --voice-share 0 ;;
    tiers)  # the store's tiers at the shipped defaults (4 GiB cap, 32 GiB host tier, a disk), charged $RATE:
            # the Mooncake trace on 16 engines and the trajectories packed to 29, against no disk, no host tier, no cap
      for store in "" "--no-disk" "--host-cap-gib 0" "--host-cap-gib 0 --no-disk" "--cap-gib 0"; do
        tag=$(echo "default $store" | tr -d ' -')
        run "tiers-mooncake16-$tag" "$MOON" --engines 16 --share 0.02 --read-rate-json "$RATE" $store
        run "tiers-29-dense-$tag" "$LEDGER" --pack 29 --share 0.02 --batch 8 --batch-read-ms 50 --batch-wait-ms 1000 \
          --read-rate-json "$RATE" --samples 300 $store
      done ;;
    dense)  # runs, pieces and waiting for fuller batches, packed to 8 ... 29, no cap, idle + 2 %, charged $RATE
      for k in 8 16 24 29; do
        run "dense-$k-b1-$RUN" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0 --read-rate-json "$RATE" --samples 300
        run "dense-$k-b8-$RUN" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0 --batch 8 --read-rate-json "$RATE" --samples 300
        run "dense-$k-b8-pieces-$RUN" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0 --batch 8 --batch-read-ms 50 \
          --read-rate-json "$RATE" --samples 300
        run "dense-$k-b8-pieces-wait-$RUN" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0 --batch 8 --batch-read-ms 50 \
          --batch-wait-ms 1000 --read-rate-json "$RATE" --samples 300
      done
      run "dense-29-b8-pieces-wait-solve-$RUN" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --batch 8 --batch-read-ms 50 \
        --batch-wait-ms 1000 --read-rate-json "$RATE" --samples 300 --solve-share "fresh >= 97 %"
      run "dense-29-b1-solve-$RUN" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --read-rate-json "$RATE" --samples 300 \
        --solve-share "fresh >= 97 %"
      run "dense-29-b8-pieces-wait-cap4-$RUN" "$LEDGER" --pack 29 --share 0.02 --batch 8 --batch-read-ms 50 \
        --batch-wait-ms 1000 --read-rate-json "$RATE" --samples 300 ;;
    calls)  # the dense recipe packed to 29, charged each H200 device call's costs side by side (one arm a file)
      run "dense-calls" "$LEDGER" --pack 29 --share 0.02 --cap-gib 0 --batch 8 --batch-read-ms 50 --batch-wait-ms 1000 \
        --samples 300 --read-rate-json docs/results/batch/read-rate-h200-batches-desc.json \
        --read-rate-json docs/results/batch/read-rate-h200-batches-runs.json \
        --read-rate-json docs/results/batch/read-rate-h200-batches-3.json ;;
    ablation)  # what each limit costs, one at a time, at 24 and 29 active and a 2 % share
      for k in 24 29; do
        run "ablation-$k-ideal" "$LEDGER" --pack "$k" --share 0.02 $IDEAL --samples 1000
        run "ablation-$k-depth" "$LEDGER" --pack "$k" --share 0.02 --ids embedded --cap-gib 0 --voice-share 0
        run "ablation-$k-ids" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0 --voice-share 0
        run "ablation-$k-voice" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 0
        run "ablation-$k-disk" "$LEDGER" --pack "$k" --share 0.02 --disk
        run "ablation-$k-cap16" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 16
        run "ablation-$k-cap16-solve" "$LEDGER" --pack "$k" --share 0.02 --cap-gib 16 --solve-share "p99 ask wait <= 50 ms"
      done ;;
    share-sweep)  # freshness and ask wait against the share, live defaults and a 16 GiB cap
      for k in 24 29; do
        for cap in 4 16; do
          run "share-$k-cap$cap" "$LEDGER" --pack "$k" --cap-gib "$cap" --share 0.005 --share 0.01 --share 0.02 \
            --share 0.03 --share 0.05 --share 0.1
        done
      done ;;
    fleet)  # against the fleet size, each size checked against one engine more (affinity and rendezvous)
      for k in 24 29; do
        for n in 1 2 3 4 5; do
          run "fleet-$k-$n" "$LEDGER" --pack "$k" --engines "$n" --share 0.02 --check-fleet
          run "fleet-$k-$n-rendezvous" "$LEDGER" --pack "$k" --engines "$n" --route rendezvous --share 0.02 --check-fleet
        done
      done ;;
    curve)  # the share each target needs against the load, with no cap (the read time alone)
      for k in 4 8 16 24 29 32 48; do
        run "curve-$k-fresh" "$LEDGER" --pack "$k" --cap-gib 0 --samples 300 --solve-share "fresh >= 97 %"
        run "curve-$k-wait" "$LEDGER" --pack "$k" --cap-gib 0 --samples 300 --solve-share "p99 ask wait <= 50 ms"
      done ;;
    trajectories)  # idealised: the 42 sessions as they ran (about 3.5 active at once)
      run trajectories "$LEDGER" $IDEAL --read-ms-per-1k 87 --share 0.02 --share 0.05 --priorities all \
        --priorities none --solve-share 97 ;;
    packed)  # idealised: 24 active at once on one engine, the priorities side by side
      run packed "$LEDGER" --pack 24 $IDEAL --share 0.02 --share 0.05 --priorities all \
        --priorities none --priorities recent,oldest --priorities running,oldest --priorities running,recent \
        --priorities recent --priorities question,running,fewest,recent,oldest --solve-share 97 ;;
    density)  # idealised: freshness against density, 4 to 48 active at once on one engine
      for k in 4 8 16 24 32 48; do
        run "density-$k" "$LEDGER" --pack "$k" $IDEAL --share 0.02 --solve-share 97
      done ;;
    traj-fleet)  # idealised: 24 active at once over 2 and 4 engines
      for n in 2 4; do
        run "traj-fleet-$n" "$LEDGER" --pack 24 --engines "$n" $IDEAL --share 0.02 --solve-share 97
      done ;;
    mooncake)  # idealised: the conversation trace on one 32-slot engine
      run mooncake "$MOON" $IDEAL --read-ms-per-1k 87 --share 0.02 --share 0.05 --solve-share 97 ;;
    mooncake-fleet)  # idealised: on 2 to 16 engines of 32 slots, sessions kept on their engines
      for n in 2 4 8; do
        run "mooncake-$n" "$MOON" --engines "$n" $IDEAL --share 0.02 --share 0.05 --solve-share 97
      done
      run mooncake-16 "$MOON" --engines 16 $IDEAL --read-ms-per-1k 87 --share 0.02 --share 0.05 --solve-share 97 ;;
    mooncake-routes)  # idealised: 16 engines, other routes
      for route in hash round-robin; do
        run "mooncake-16-$route" "$MOON" --engines 16 --route "$route" $IDEAL --share 0.02 --share 0.05
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
