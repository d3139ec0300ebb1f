#!/usr/bin/env bash
# Step caching's speed targets on the GPU host (carry [".whl"]), one device call a stage:
#   bash tools/gpu_step_cache_targets.sh STAGE...    STAGE: sd15 | sdxl | zimage
# Each stage is one tools/bench_step_cache.py run on one engine (compile tier, graph mode), its modes in priority
# order; results go to $OUT/STAGE.jsonl as each finishes (a run cut by the timeout keeps them) and the summary is
# printed from that file. BUDGET_S (default 420): no mode starts later; LIMIT_S (default 560): the run's timeout.
# BUCKETS: the batch buckets (default: a guided one-image request runs unpadded in bucket 2).
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
BUDGET_S=${BUDGET_S:-420}; LIMIT_S=${LIMIT_S:-560}
for what in "$@"; do
  case $what in
    sd15) args=(--cases random:sd15@512 --steps 20 --mode one,saturation,half --caches off,auto,deepcache:3
                --repeats 10 --burst 32 --buckets ${BUCKETS:-1,2,8}) ;;
    sdxl) args=(--cases random:sdxl@1024 --steps 20 --mode one,saturation,half --caches off,auto,deepcache:3
                --repeats 5 --burst 16 --buckets ${BUCKETS:-1,2,4}) ;;
    # the base checkpoint's defaults: 50 steps, guidance 5 (CFG); the warm-ups at 8 steps meet every variant
    zimage) args=(--cases random:zimage-base@1024 --mode saturation,half,one --cache taylorseer:3
                  --caches off,taylorseer:3 --repeats 1 --burst 8 --warm-steps 8 --buckets 1,4) ;;
    *) echo "unknown stage $what (sd15, sdxl, zimage)"; continue ;;
  esac
  timeout "$LIMIT_S" python3 tools/bench_step_cache.py "${args[@]}" --compile --budget-s "$BUDGET_S" \
    --out "$OUT/$what.jsonl" > "$OUT/$what.log" 2>&1
  echo "[$what rc=$?]"
  python3 tools/bench_step_cache.py --summarize "$OUT/$what.jsonl"
done
