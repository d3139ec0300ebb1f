#!/usr/bin/env bash
# Issue 30 on the GPU host: GPU tests (graph tier, compile tier with long prompts) and the prompt-mix benchmark
# (step replays at 1/3/6 prompt windows, images/s with 30% long prompts). Usage: bash tools/gpu_issue30.sh tests ctests mix graphs
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-240} python3 -m pytest -q -x -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_lora_gpu.py \
             tests/gpu/test_edits_gpu.py tests/gpu/test_device_affinity.py -p no:cacheprovider 2>&1 \
             | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -8 ;;
    ctests) DIFFGRAPH_TEST_OUT=$OUT timeout ${TESTS_S:-400} python3 -m pytest -q -x -m gpu tests/gpu/test_compile_gpu.py \
             -p no:cacheprovider -s 2>&1 | grep -v Warning | tee "$OUT/gpu_ctests.log" | tail -30 ;;
    mix) timeout ${MIX_S:-420} python3 -m diffgraph.bench.throughput --sizes 512x512 ${TIER:---compile} \
           --compile-cache /tmp/cc --prompt-mix ${MIX_N:-64} --json "$OUT/prompt_mix.json" 2>&1 \
           | grep -v Warning | tee "$OUT/prompt_mix.log" | tail -16 ;;
    graphs) timeout ${GRAPHS_S:-200} python3 tools/probe_prompt_graphs.py 2>&1 | grep -v Warning | tee "$OUT/prompt_graphs.log" \
             | tail -20 ;;
  esac
done
