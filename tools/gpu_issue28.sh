#!/usr/bin/env bash
# Issues 28 and 35 on the GPU host: GPU tests after the engine changes (preempted batch rows under CUDA graphs, LoRA
# host copies read again at admission, edit preprocessing at submit), and the process hop: the same saturating HTTP
# load (tools/bench_dp.py: SD1.5 512x512 20 steps) on an in-process engine (tools/serve_in_process.py) and on
# `diffgraph serve`'s own layout, one replica process (the output thread, results without their inputs).
# jobs / mixed: issue 35's targets (tools/bench_jobs.py): a job against the same requests at once, and interactive
# requests at 1/s beside a running job.
# Usage: bash tools/gpu_issue28.sh tests hop jobs mixed   (env: TESTS_S, GPU_TESTS, HOP_RATE, HOP_S, JOBS_N, MIXED_N)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-420} python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/gpu/test_graphs_gpu.py \
             tests/gpu/test_lora_gpu.py tests/gpu/test_edits_gpu.py tests/gpu/test_samplers_gpu.py} -p no:cacheprovider \
             2>&1 | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -8 ;;
    hop) for label in inproc replica; do
           flags=(); [ $label = inproc ] && flags=(--in-process)
           timeout ${HOP_S:-280} python3 tools/bench_dp.py --label $label --sat-rate ${HOP_RATE:-14} --duration 30 \
             --repeats 1 --json "$OUT/hop_$label.json" "${flags[@]}" 2>&1 | grep -v Warning | tail -3
         done ;;
    jobs) timeout ${JOBS_S:-540} python3 tools/bench_jobs.py cost --n ${JOBS_N:-1000} ${JOBS_FLAGS:-} --json "$OUT/jobs_cost.json" 2>&1 \
            | grep -v Warning | tail -3 ;;
    mixed) timeout ${MIXED_S:-540} python3 tools/bench_jobs.py mixed --n ${MIXED_N:-600} --rate 1 \
             --json "$OUT/jobs_mixed.json" 2>&1 | grep -v Warning | tail -3 ;;
  esac
done
