#!/usr/bin/env bash
# Issue 31 on the GPU host: GPU tests (graph tier and edits with the new samplers' rows) and the sampler-mix benchmark
# (bench/sampler_mix.py: every sampler mixed against all-euler of the same evaluations; 20-step heun against 39-step
# euler). Usage: bash tools/gpu_issue31.sh tests mix   (env: MIX_PRESET, MIX_N, MIX_SIZE, TESTS_S, MIX_S)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-300} python3 -m pytest -q -x -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_edits_gpu.py \
             tests/gpu/test_samplers_gpu.py -p no:cacheprovider 2>&1 | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -8 ;;
    mix) timeout ${MIX_S:-400} python3 -m diffgraph.bench.throughput --model ${MIX_PRESET:-random:sd15} \
           --sizes ${MIX_SIZE:-512x512} --sampler-mix ${MIX_N:-64} --json "$OUT/sampler_mix.json" 2>&1 \
           | grep -v Warning | tee "$OUT/sampler_mix.log" | tail -8 ;;
  esac
done
