#!/usr/bin/env bash
# The MMDiT families on the GPU host (carry [".whl"]): bash tools/gpu_dit.sh STAGE...
#   klein | qwen | edit: tools/bench_dit.py for that family (STAGES, BENCH_S, REPEAT, SATURATE from the environment);
#   tests: the token families' GPU tests (TESTS, TESTS_K, TESTS_S). Results under $OUT as they come.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    klein|qwen|edit)
      timeout ${BENCH_S:-400} python3 -u tools/bench_dit.py --family $what --out "$OUT" \
        --stages ${STAGES:-compile,mixed,baseline,ceiling,fp8} --repeat ${REPEAT:-3} --saturate ${SATURATE:-16} \
        > "$OUT/$what.log" 2>&1
      echo "[$what rc=$?]"; grep -E "^(baseline|ceiling|compile|lightning|mixed|fp8) |Error|error" "$OUT/$what.log" \
        | cut -c1-1200 | tail -12 ;;
    tests)
      timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu ${TESTS:-tests/gpu/test_flux2_gpu.py tests/gpu/test_qwen_image_gpu.py} \
        -k "${TESTS_K:-True}" -p no:cacheprovider -s > "$OUT/gtests.log" 2>&1
      echo "[tests rc=$?]"; grep -E "^(FAILED|ERROR)|passed|failed|levels|Error" "$OUT/gtests.log" | tail -14 ;;
  esac
done
