#!/usr/bin/env bash
# Session 45 on the GPU host (carry [".whl"]): bash tools/gpu_session45.sh STAGE...
#   tests: the step caches' GPU tests; graph: bench_step_cache in graph mode (SD1.5, SDXL); compile15 / compilexl:
#   the compile tier (SD1.5 / SDXL); sfmem: bench_single_file_memory to cuda. Results under $OUT as they come.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu tests/gpu/test_step_cache_gpu.py \
             tests/gpu/test_token_cache_gpu.py -p no:cacheprovider -s > "$OUT/gtests.log" 2>&1
           echo "[tests rc=$?]"; grep -E "^(FAILED|ERROR)|passed|failed|levels|Error" "$OUT/gtests.log" | tail -12 ;;
    graph) timeout ${GRAPH_S:-200} python3 tools/bench_step_cache.py --cases random:sd15@512,random:sdxl@1024 \
             --steps 20 --caches off,auto,deepcache:3 --repeats 5 --out "$OUT/step_cache_graph.json" \
             > "$OUT/graph.log" 2>&1; echo "[graph rc=$?]"; grep -v "^{" "$OUT/graph.log" | grep -v "captured on first" | tail -8 ;;
    compile15|compilexl) case=$([ $what = compile15 ] && echo random:sd15@512 || echo random:sdxl@1024)
           timeout ${COMPILE_S:-300} python3 tools/bench_step_cache.py --cases $case --steps 20 \
             --caches off,auto,deepcache:3 --repeats 5 --compile --out "$OUT/step_cache_$what.json" \
             > "$OUT/$what.log" 2>&1; echo "[$what rc=$?]"; grep -v "^{" "$OUT/$what.log" | grep -v "captured on first" | tail -6 ;;
    sfmem) timeout 150 python3 tools/bench_single_file_memory.py --device cuda > "$OUT/sfmem.log" 2>&1
           echo "[sfmem rc=$?]"; tail -4 "$OUT/sfmem.log" ;;
  esac
done
