#!/usr/bin/env bash
# Session 43 on the GPU host (carry [".whl"]):
#   bash tools/gpu_session43.sh bench tests   (env: BENCH_S, STAGES, TESTS_S, TESTS)
# bench: tools/bench_zimage.py's STAGES -> $OUT/zimage.json; tests: the gpu-marked TESTS (pytest paths / -k).
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    bench) timeout ${BENCH_S:-400} python3 tools/bench_zimage.py --out "$OUT" \
             --stages ${STAGES:-baseline,compiled,compile_sat,ceiling} > "$OUT/bench.log" 2>&1
           echo "[bench rc=$?]"; python3 -c "import json,sys; d=json.load(open('$OUT/zimage.json')); \
print(json.dumps({k: v for k, v in d.items()})[:4000])"; grep -iE "error|Traceback" "$OUT/bench.log" | head -5 ;;
    tests) timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu ${TESTS:-tests/gpu} -p no:cacheprovider \
             > "$OUT/gtests.log" 2>&1
           echo "[tests rc=$?]"; grep -E "^(FAILED|ERROR)|passed|failed|assert" "$OUT/gtests.log" | tail -12 ;;
  esac
done
