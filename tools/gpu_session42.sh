#!/usr/bin/env bash
# Session 42 on the GPU host (carry [".whl"]; digits_data.npz, scikit-learn's digits as an .npz, in the tree):
#   bash tools/gpu_session42.sh train tests bench   (env: TRAIN_S, TESTS_S, BENCH_S, STAGES)
# train: tools/train_digits_zimage.py -> $OUT/digits-zimage (scored on a machine with scikit-learn);
# tests: the Z-Image GPU tests but the compile tier's mixed rows (a known failure); bench: tools/bench_zimage.py.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    train) timeout ${TRAIN_S:-280} python3 tools/train_digits_zimage.py --device cuda --data digits_data.npz \
             --out "$OUT/digits-zimage" > "$OUT/train.log" 2>&1
           echo "[train rc=$?]"; grep -v -E "Warning|warn" "$OUT/train.log" | tail -8 ;;
    tests) timeout ${TESTS_S:-120} python3 -m pytest -q -m gpu tests/gpu/test_zimage_gpu.py tests/test_stream_load.py -k "False or flash or gpu" \
             -p no:cacheprovider > "$OUT/gtests.log" 2>&1
           echo "[tests rc=$?]"; grep -E "assert|Error|passed|failed" "$OUT/gtests.log" | tail -8 ;;
    bench) timeout ${BENCH_S:-240} python3 tools/bench_zimage.py --out "$OUT" \
             --stages ${STAGES:-graph,compile,compiled} > "$OUT/bench.log" 2>&1
           echo "[bench rc=$?]"; python3 -c "import json,sys; d=json.load(open('$OUT/zimage.json')); \
print(json.dumps({k: v for k, v in d.items() if not k.endswith('wall_s')})[:3000])" ;;
  esac
done
