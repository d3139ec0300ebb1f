#!/usr/bin/env bash
# Z-Image on the GPU host (carry [".whl"]): its GPU tests and the token family's, then tools/bench_zimage.py.
#   bash tools/gpu_session41.sh tests bench   (env: TESTS_S, BENCH_S, STAGES)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-240} python3 -m pytest -q -m gpu tests/gpu/test_zimage_gpu.py \
             tests/gpu/test_token_family_gpu.py -p no:cacheprovider > "$OUT/gtests.log" 2>&1
           echo "[tests rc=$?]"; grep -E "assert|Error|passed|failed" "$OUT/gtests.log" | tail -12 ;;
    bench) timeout ${BENCH_S:-420} python3 tools/bench_zimage.py --out "$OUT" \
             --stages ${STAGES:-baseline,eager,graph,mixed,gguf} > "$OUT/bench.log" 2>&1
           echo "[bench rc=$?]"; grep -v -E "Warning|warn" "$OUT/bench.log" | tail -14 ;;
  esac
done
