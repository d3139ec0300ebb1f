#!/usr/bin/env bash
# Issue 27 on the GPU host: GPU tests, the compile tier's latency of the old tree (.old/src, carried) and the new
# one alternated in one call, the guidance-mix throughput, and whether decoding beside the steps would pay (overlap:
# tools/probe_overlap.py, eager then compiled), and a request's image alone vs in a mixed batch with the decoder's
# group norms as shipped (force) and as Inductor lowers them (inductorgn: fidelity, tools/probe_mixed_fidelity.py).
# Usage: bash tools/gpu_issue27.sh tests ctests ab mix overlap fidelity
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-300} python3 -m pytest -q -x -m gpu tests/gpu/test_graphs_gpu.py tests/gpu/test_lora_gpu.py \
             tests/gpu/test_edits_gpu.py tests/gpu/test_device_affinity.py -p no:cacheprovider 2>&1 \
             | grep -v Warning | tee "$OUT/gpu_tests.log" | tail -15 ;;
    ctests) timeout ${TESTS_S:-400} python3 -m pytest -q -x -m gpu tests/gpu/test_compile_gpu.py -p no:cacheprovider 2>&1 \
             | grep -v Warning | tee "$OUT/gpu_ctests.log" | tail -15 ;;
    ab) for tree in old new; do
          src=$([ $tree = old ] && echo "$PWD/.old/src" || echo "$PWD/src")
          PYTHONPATH=/tmp/site:$src timeout 280 python3 -m diffgraph.bench.latency --cases random:sd15@512 --images 1 \
            --buckets 1,2 --repeats 5 --no-fresh-starts --contenders diffgraph_compile \
            --json "$OUT/ab_${tree}.json" > "$OUT/ab_${tree}.log" 2>&1
          grep -E "diffgraph_compile|rror" "$OUT/ab_${tree}.log" | head -8 | sed "s/^/[$tree] /"
        done ;;
    mix) timeout ${MIX_S:-420} python3 -m diffgraph.bench.throughput --sizes 512x512 --compile \
           --compile-cache /tmp/cc --guidance-mix ${MIX_N:-64} --json "$OUT/guidance_mix.json" 2>&1 \
           | grep -v Warning | tee "$OUT/guidance_mix.log" | tail -19 ;;
    overlap) for flag in "" --compile; do
               TORCHINDUCTOR_CACHE_DIR=/tmp/cc timeout $([ -n "$flag" ] && echo ${OVERLAP_S:-300} || echo 150) \
                 python3 tools/probe_overlap.py $flag --json "$OUT/overlap${flag:+_compiled}.json" \
                 2>&1 | grep -v Warning | tail -3
             done ;;
    fidelity) PROBE_SCHEDULES=${PROBE_SCHEDULES:-3} timeout ${FIDELITY_S:-300} python3 -u tools/probe_mixed_fidelity.py \
                ${FIDELITY_VARIANTS:-force inductorgn} 2>&1 | grep -v Warning | grep -v verify | tail -8 ;;
  esac
done
