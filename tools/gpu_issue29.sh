#!/usr/bin/env bash
# Issue 29 on the GPU host: GPU tests (graph tier, edits, LoRA, a full-size single file) and the single-file load
# benchmark (tools/bench_single_file.py: an SDXL / SD1.5 file against its folder). Usage: bash tools/gpu_issue29.sh tests load models
# models: tools/bench_models.py (two resident models alternating vs one alone; memory accounting), SD1.5 and SDXL
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-300} python3 -m pytest -q -x -m gpu tests/gpu/test_single_file_gpu.py tests/gpu/test_graphs_gpu.py \
             tests/gpu/test_lora_gpu.py tests/gpu/test_edits_gpu.py tests/gpu/test_device_affinity.py -p no:cacheprovider 2>&1 \
             | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -8 ;;
    load) DIFFGRAPH_CACHE=/tmp/dgcache timeout ${LOAD_S:-420} python3 tools/bench_single_file.py \
            --presets ${LOAD_PRESETS:-random:sdxl,random:sd15} --work /tmp/ckpt --json "$OUT/single_file.json" 2>&1 \
            | grep -v Warning | tee "$OUT/single_file.log" | tail -12 ;;
    models) for preset in ${MODELS_PRESETS:-random:sd15 random:sdxl}; do
              timeout ${MODELS_S:-300} python3 tools/bench_models.py --preset $preset --requests ${MODELS_N:-30} \
                --json "$OUT/models_${preset#random:}.json" 2>&1 | grep -v Warning | tee "$OUT/models_${preset#random:}.log" \
                | tail -5
            done ;;
  esac
done
