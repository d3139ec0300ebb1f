#!/usr/bin/env bash
# Session 46 on the GPU host (carry [".whl"]): bash tools/gpu_session46.sh STAGE...
#   diag: where DeepCache's graphed steps part from the eager ones (tools/diag_deepcache_graph.py, SD1.5 fp32);
#   tests: the step caches' GPU tests. Results under $OUT as they come.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    diag) timeout ${DIAG_S:-400} python3 tools/diag_deepcache_graph.py --variants ${VARIANTS:-eager,graphed,emulated} \
            ${DIAG_ARGS:-} --out "$OUT/diag.jsonl" > "$OUT/diag.log" 2>&1
          echo "[diag rc=$?]"; grep -v '"table"' "$OUT/diag.jsonl"; grep -E "Error|error" "$OUT/diag.log" | tail -3 ;;
    tests) timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu ${TESTS:-tests/gpu/test_step_cache_gpu.py} \
             -p no:cacheprovider -s > "$OUT/gtests.log" 2>&1
           echo "[tests rc=$?]"; grep -E "^(FAILED|ERROR)|passed|failed|levels|Error" "$OUT/gtests.log" | tail -12 ;;
  esac
done
