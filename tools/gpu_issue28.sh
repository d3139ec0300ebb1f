#!/usr/bin/env bash
# Issues 28 and 35 on the GPU host: GPU tests after the engine changes (preempted batch rows under CUDA graphs, LoRA
# host copies read again at admission, edit preprocessing at submit), and the process hop: the same saturating HTTP
# load (tools/bench_dp.py: SD1.5 512x512 20 steps) on an in-process engine and on one replica process
# (--devices cuda:0: the output thread, results without their inputs).
# Usage: bash tools/gpu_issue28.sh tests hop   (env: TESTS_S, HOP_RATE, HOP_S)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-420} python3 -m pytest -q -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_lora_gpu.py \
             tests/gpu/test_edits_gpu.py tests/gpu/test_samplers_gpu.py -p no:cacheprovider 2>&1 | grep -v Warning \
             | tee "$OUT/gpu_tests.log" | tail -8 ;;
    hop) for label in inproc replica; do
           flags=(); [ $label = replica ] && flags=(-- --devices cuda:0)
           timeout ${HOP_S:-280} python3 tools/bench_dp.py --label $label --sat-rate ${HOP_RATE:-14} --duration 30 \
             --repeats 1 --json "$OUT/hop_$label.json" "${flags[@]}" 2>&1 | grep -v Warning | tail -3
         done ;;
  esac
done
