#!/usr/bin/env bash
# Issue 33 on the GPU host (carry [".whl"]): the fp8 GPU tests, tools/probe_fp8.py's parts, the compile tier's GPU
# tests (ctests) and the tiers side by side (tiers: bench throughput --tiers $TIERS, default graph,compile).
#   bash tools/gpu_issue33.sh tests widths step gtests ctests tiers tierswarm start vae kernels atops
#   (atops: tools/probe_autotune_ops.py, max-autotune on the family's largest GEMMs / convolutions one at a time:
#   PRESET, ROWS, TOP; read the log with tools/autotune_gain.py)
#   (gtests: every GPU test but the compile tier's and fp8's, which ctests and tests run)
#   (kernels: tools/probe_fp8_kernels.py, whether fp8 attention / fp8 convolutions would pay: PRESET, ROWS)
#   (start: a cold compile-tier start, one image, then starts in fresh processes on the warm cache: traced or loaded)
#   (env: PRESET, ROWS, MIN_FEATURES, TIER="--compile" or "", TIERS, BURST, SIZE; vae: VAE_PRESET, VAE_SIZE, VAE_VARIANTS;
#   TIERS_ARGS: more bench throughput flags, e.g. --no-vae-upcast;
#   *_S limits; CSE=1: step also times fp8 with each shared input quantised once; TIERS_CACHE=.cc keeps the tiers'
#   compile caches in the (git-ignored) tree, which a warm device machine keeps between calls: an autotuned compile
#   cut short by a call's limit resumes in the next)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    tests) timeout ${TESTS_S:-120} python3 -m pytest -q -x -m gpu tests/gpu/test_fp8_gpu.py -p no:cacheprovider 2>&1 \
             | grep -E "assert|Error|passed|failed" | tail -12 ;;
    widths) timeout ${WIDTHS_S:-150} python3 tools/probe_fp8.py widths --rows ${ROWS:-16} ${TIER---compile} 2>&1 \
              | grep -v Warning | tail -12 ;;
    step) timeout ${STEP_S:-360} python3 tools/probe_fp8.py step --preset ${PRESET:-random:sd15} --rows ${ROWS:-16} \
            --min-features ${MIN_FEATURES:-640} ${TIER---compile} --split ${CSE:+--cse} 2>&1 \
            | grep -v Warning | tail -22 ;;
    gtests) timeout ${GTESTS_S:-240} python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
              --ignore tests/gpu/test_compile_gpu.py --ignore tests/gpu/test_fp8_gpu.py 2>&1 \
              | grep -E "assert|Error|passed|failed|PASS|FAIL" | tee "$OUT/gtests.log" | tail -14 ;;
    ctests) timeout ${CTESTS_S:-420} python3 -m pytest -q -x -m gpu tests/gpu/test_compile_gpu.py -p no:cacheprovider \
              2>&1 | grep -E "assert|Error|passed|failed" | tail -12 ;;
    tiers|tierswarm)  # tierswarm: the same run again over $TIERS_CACHE (set it), so every start is warm
      [ $what = tierswarm ] && [ -z "${TIERS_CACHE:-}" ] && { echo "tierswarm needs TIERS_CACHE"; continue; }
      timeout ${TIERS_S:-420} python3 -m diffgraph.bench.throughput --model ${PRESET:-random:sd15} \
             --sizes ${SIZE:-512x512} --tiers ${TIERS:-graph,compile} --burst ${BURST:-64} \
             ${TIERS_CACHE:+--compile-cache $TIERS_CACHE} ${TIERS_ARGS:-} --json "$OUT/$what.json" 2>&1 \
             | tee "$OUT/$what.full.log" | grep -v -E "Warning|AUTOTUNE|triton_|strides:|dtypes:|SingleProcess" \
             | tee "$OUT/$what.log" | tail -14 ;;
    start) timeout ${START_S:-540} python3 -m diffgraph.bench.latency --cases ${PRESET:-random:sdxl}@${START_SIZE:-1024} \
             --images 1 --buckets ${START_BUCKETS:-2} --repeats 3 --contenders diffgraph_compile --json "$OUT/start.json" \
             2>&1 | grep -v Warning | grep -E "compile tier|fresh|cold|warm|rror" | cut -c1-1200 | tail -12 ;;
    vae) for upcast in "" --no-vae-upcast; do  # SDXL's decoder in fp32 (today's), then fp16: layout and bucket
           timeout ${VAE_S:-270} python3 tools/probe_vae_layout.py --model ${VAE_PRESET:-random:sdxl} \
             --size ${VAE_SIZE:-1024x1024} \
             --buckets 1,2,4 --variants ${VAE_VARIANTS:-dynamic,force,static} $upcast --json "$OUT/vae${upcast:+_fp16}.json" 2>&1 \
             | grep -v Warning | tail -7
         done ;;
    atops) timeout ${ATOPS_S:-200} python3 tools/probe_autotune_ops.py --preset ${PRESET:-random:sdxl} --rows ${ROWS:-16} \
             --top ${TOP:-10} 2>&1 | grep -v Warning | tee "$OUT/atops.log" | grep "^probe" ;;
    kernels) timeout ${KERNELS_S:-300} python3 tools/probe_fp8_kernels.py --preset ${PRESET:-random:sdxl} \
               --rows ${ROWS:-16} 2>&1 | grep -v Warning | tee "$OUT/kernels.log" | tail -40 ;;
  esac
done
