#!/usr/bin/env bash
# Issue 32 on the GPU host (with carry [".whl"], which holds digits.npz: the training digits where scikit-learn is
# not installed):
#   bash tools/gpu_issue32.sh train   # the digits outline ControlNet (tools/train_digits_control.py) -> $OUT/outline
#   bash tools/gpu_issue32.sh tests   # the GPU tests of the ControlNet rows (graph tier)
#   bash tools/gpu_issue32.sh bench   # the GPU tests, then tools/bench_control.py in the graph and compile tiers
#   bash tools/gpu_issue32.sh compile # the compile tier's ControlNet cases alone, then $GPU_TESTS (default: image prompts)
#                                     # (CONTROL_FLAGS=--force-layout: the ControlNet's compile with the layout forced)
set -uo pipefail
. tools/gpu_setup.sh
case "${1:-train}" in
  train)
    python3 tools/train_digits_control.py --device cuda --steps "${CONTROL_STEPS:-6000}" \
      --batch "${CONTROL_BATCH:-256}" --budget "${CONTROL_BUDGET:-240}" --lr "${CONTROL_LR:-3e-4}" --data .whl/digits.npz --out "$OUT/outline" ;;
  tests)
    python3 -m pytest -q -x tests/gpu -k control 2>&1 | tail -20 ;;
  bench)
    python3 -m pytest -q -x tests/gpu/test_control_gpu.py tests/gpu/test_ip_adapter_gpu.py 2>&1 | tail -8
    timeout "${GRAPH_S:-150}" python3 tools/bench_control.py --preset random:sd15 --steps 10 --rounds 3 \
      --image-prompts 2>&1 | tail -11
    timeout "${COMPILE_S:-300}" python3 tools/bench_control.py --preset random:sd15 --steps 10 --rounds 3 --compile \
      --image-prompts 2>&1 | grep -v Warning | tail -11 ;;
  compile)  # the compile tier's bench (buckets 4 and 16 only: the cases need no others), then the GPU tests named
    timeout "${COMPILE_S:-420}" python3 tools/bench_control.py --preset random:sd15 --steps 10 --rounds 3 --compile \
      --buckets 4,16 --cases "${CASES:-0,4,16}" ${CONTROL_FLAGS:-} 2>&1 | grep -v Warning | tail -11
    timeout "${TESTS_S:-150}" python3 -m pytest -q -x ${GPU_TESTS:-tests/gpu/test_ip_adapter_gpu.py} 2>&1 \
      | grep -E "assert|Error|passed|failed" | tail -12 ;;
esac
