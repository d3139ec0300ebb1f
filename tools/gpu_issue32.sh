#!/usr/bin/env bash
# Issue 32 on the GPU host (with carry [".whl"], which holds digits.npz: the training digits where scikit-learn is
# not installed):
#   bash tools/gpu_issue32.sh train   # the digits outline ControlNet (tools/train_digits_control.py) -> $OUT/outline
#   bash tools/gpu_issue32.sh tests   # the GPU tests of the ControlNet rows (graph tier)
set -uo pipefail
. tools/gpu_setup.sh
case "${1:-train}" in
  train)
    python3 tools/train_digits_control.py --device cuda --steps "${CONTROL_STEPS:-6000}" \
      --batch "${CONTROL_BATCH:-256}" --budget "${CONTROL_BUDGET:-240}" --lr "${CONTROL_LR:-3e-4}" --data .whl/digits.npz --out "$OUT/outline" ;;
  tests)
    python3 -m pytest -q -x tests/gpu -k control 2>&1 | tail -20 ;;
esac
