#!/usr/bin/env bash
# Issue 34 on the GPU host: GPU tests (graphs, samplers and live previews under CUDA graphs) and the preview-cost
# benchmark (bench/preview_cost.py: bursts with previews every step / every 4 steps against none, bucket 16).
# Usage: bash tools/gpu_issue34.sh tests cost   (env: COST_PRESET, COST_N, COST_SIZE, TESTS_S, COST_S)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-300} python3 -m pytest -q -x -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_samplers_gpu.py \
             tests/gpu/test_previews_gpu.py -p no:cacheprovider 2>&1 | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -8 ;;
    cost) timeout ${COST_S:-400} python3 -m diffgraph.bench.throughput --model ${COST_PRESET:-random:sd15} \
            --sizes ${COST_SIZE:-512x512} --preview-cost ${COST_N:-64} --json "$OUT/preview_cost.json" 2>&1 \
            | grep -v Warning | tee "$OUT/preview_cost.log" | tail -8 ;;
  esac
done
