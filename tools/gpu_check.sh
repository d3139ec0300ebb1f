#!/usr/bin/env bash
# Runs on the GPU host (the `device` tool): GPU tests, then the benchmarks. Logs and JSON go to $OUT.
#   bash tools/gpu_check.sh [tests] [ctests] [tests1] [ab] [latency] [compile] [compilexl] [throughput] [info] [probecompile] [mixed] [probe] [firstuse] [imports] [regime] [saturation]
# tests1: the GPU tests with every engine on cuda:1 (2-GPU host; test_device_affinity checks GPU 0 stays untouched)
# ab: bench latency (graph tier, 1 image) of the tree in .old/src (an older commit, `git archive REV src | tar -x -C
# .old`, carried) and of src/, alternated twice in one call: the before/after comparison of a refactor
# lora: tools/bench_lora.py step (bucket-16 step cost with adapters, max rank 16 and 64); loraload: bench_lora.py load
# (a rank-32 SDXL adapter loaded while requests step) and bench throughput --loras 8 over 4 slots at saturation
# ctests: the compile tier's GPU tests; compile / compilexl: bench latency with diffgraph_compile beside diffusers
# (eager, + torch.compile), the graph tier, SD1.5 512 (1 and 4 images, 5 buckets, cold and two fresh-process starts) /
# SDXL 1024 (1 image, buckets 1,2,4, cold start only): one 10-minute device command each
# mixed: tools/probe_mixed_fidelity.py (MIXED_VARIANTS): 20 mixed digits requests together vs alone over several bucket
# paths, per compile variant (the compile tier as shipped, cuDNN attention, the graph tier)
# probecompile: tools/probe_compile_layout.py (PROBE_GROUPS: sd15, sdxl, engine, engineforce, enginexl), layout and attention with
# compile on (PROBE_WAIT_FILE: time nothing until that file exists, e.g. while ctests run beside it)
# edits: bench throughput at saturation (step mode, 512x512) without and with half the trace edits (issue 15)
# dp60: tools/bench_dp.py (DP_LABEL, DP_RATE, DP_FLAGS): 60 s seeded traces, saturation and 80% of it twice, step figures
# dp: diffgraph serve over one replica (cuda:0) and over two (cuda:0,cuda:1), bench serve at 10 requests/s per GPU
# plots: bench throughput (step vs request mode over the default rates) and bench serve (a rate sweep over HTTP)
# with --plot: the PNGs for BENCHMARKS.md
# regime: step vs request mode between their capacities, long traces (p99 target; REGIME_RATE, REGIME_SEED); saturation: step mode at 3x
# for 30 s with the window work measure (the 0.9 target).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
# byte-compile what was just installed, as a plain `pip install` does: otherwise the first import of diffusers
# compiles its sources and the cold-start figure measures the install method, not diffgraph
python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
for what in "$@"; do
  case $what in
    info) python3 -m diffgraph.cli info --model random:sd15 --verify 2>&1 | grep -v Warning | tee "$OUT/info.log" ;;
    probe) python3 tools/probe_layout.py 2>&1 | grep -v Warning | tee "$OUT/probe.log" ;;
    firstuse) python3 tools/probe_first_use.py 2>&1 | grep -v Warning | tee "$OUT/first_use.log" ;;
    imports) python3 -X importtime -c "from diffusers import AutoencoderKL, UNet2DConditionModel; from transformers import CLIPTextModel" 2> "$OUT/importtime.log"
             sort -t'|' -k2 -n -r "$OUT/importtime.log" | head -25 ;;
    lora) python3 tools/bench_lora.py step 2>&1 | grep -v Warning | tee "$OUT/bench_lora_step.log" ;;
    loraload) python3 tools/bench_lora.py load 2>&1 | grep -v Warning | tee "$OUT/bench_lora_load.log"
              python3 -m diffgraph.bench.throughput --sizes 512x512 --steps 20 --samplers euler --rates ${LORA_RATE:-20} \
                --duration ${LORA_DURATION:-10} --modes step --loras 8 --max-loras 4 --max-lora-rank 16 \
                --json "$OUT/bench_lora_throughput.json" 2>&1 | grep -v Warning | tee "$OUT/bench_lora_throughput.log" ;;
    tests) python3 -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -v Warning ;;
    tests1) DIFFGRAPH_TEST_DEVICE=cuda:1 python3 -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_cuda1.log" | grep -v Warning ;;
    ab) for round in 1 2; do for tree in old new; do
          src=$([ $tree = old ] && echo "$PWD/.old/src" || echo "$PWD/src")
          PYTHONPATH=/tmp/site:$src python3 -m diffgraph.bench.latency --cases random:sd15@512,random:sdxl@1024 --images 1 \
            --repeats 5 --contenders diffgraph_graph --json "$OUT/ab_${tree}_${round}.json" > "$OUT/ab_${tree}_${round}.log" 2>&1
          grep -E "^random|diffgraph_graph|Error|error" "$OUT/ab_${tree}_${round}.log" | sed "s/^/[$tree $round] /"
        done; done ;;
    latency) python3 -m diffgraph.bench.latency --repeats 3 --contenders diffusers,diffgraph_eager,diffgraph_graph --json "$OUT/bench_latency.json" 2>&1 | grep -v Warning | tee "$OUT/bench_latency.log" ;;
    compile) timeout ${COMPILE_LIMIT:-560} python3 -u -m diffgraph.bench.latency --cases random:sd15@512 --images 1,4 \
               --diffusers-compile-images 1 --contenders diffusers,diffusers_compile,diffgraph_graph,diffgraph_compile \
               --json "$OUT/bench_latency_compile.json" > "$OUT/bench_compile.log" 2>&1   # unbuffered: kept on a timeout
             grep -v Warning "$OUT/bench_compile.log" | tail -c 9000 ;;
    compilexl) timeout ${COMPILE_LIMIT:-560} python3 -u -m diffgraph.bench.latency --cases random:sdxl@1024 --images 1 \
               --buckets 1,2,4 --no-fresh-starts --contenders diffusers,diffusers_compile,diffgraph_graph,diffgraph_compile \
               --json "$OUT/bench_latency_compile_xl.json" > "$OUT/bench_compile_xl.log" 2>&1   # unbuffered
               grep -v Warning "$OUT/bench_compile_xl.log" | tail -c 9000 ;;
    mixed) timeout ${COMPILE_LIMIT:-560} python3 -u tools/probe_mixed_fidelity.py ${MIXED_VARIANTS:-force cudnn graph} \
             > "$OUT/probe_mixed.log" 2>&1; grep -v Warning "$OUT/probe_mixed.log" | grep -v "verify" | tail -c 6000 ;;
    probecompile) timeout ${COMPILE_LIMIT:-560} python3 -u tools/probe_compile_layout.py ${PROBE_GROUPS:-sd15} \
               > "$OUT/probe_compile.log" 2>&1; grep -v Warning "$OUT/probe_compile.log" | tail -c 6000 ;;
    ctests) DIFFGRAPH_TEST_OUT=$OUT python3 -m pytest -q -s -m gpu tests/gpu/test_compile_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_compile_tests.log" | grep -v Warning ;;
    regime) python3 -m diffgraph.bench.throughput --duration 60 --rates ${REGIME_RATE:-3.0} --seed ${REGIME_SEED:-0} --modes step,request --json "$OUT/bench_regime.json" 2>&1 | grep -v Warning | tee "$OUT/bench_regime.log" ;;
    saturation) python3 -m diffgraph.bench.throughput --duration 30 --rates 11.1 --modes step,step:0/0 --json "$OUT/bench_saturation.json" 2>&1 | grep -v Warning | tee "$OUT/bench_saturation.log" ;;
    plots) python3 -m diffgraph.bench.throughput --duration 12 --modes step,request --json "$OUT/bench_plot_throughput.json" \
             --plot "$OUT/bench_throughput.png" 2>&1 | grep -v Warning | tee "$OUT/bench_plot_throughput.log"
           python3 -m diffgraph.server.cli --model random:sd15 --device cuda --port 8100 --log-level warning --no-access-log &
           server=$!
           python3 -c "import httpx, time
while True:
    try:
        if httpx.get('http://127.0.0.1:8100/ready', timeout=5).status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(0.5)"
           python3 -m diffgraph.bench.serve --url http://127.0.0.1:8100 --rate 2,4,6,8 --duration 12 \
             --mix 512x512/20:3,512x512/30:1 --json "$OUT/bench_plot_serve.json" --plot "$OUT/bench_serve.png" \
             2>&1 | grep -E '"rate"|images_per_s|"p99"' | tee "$OUT/bench_plot_serve.log"
           kill -TERM $server; wait $server ;;
    dp) for devs in cuda:0 cuda:0,cuda:1; do   # one replica, then two (one per GPU), at the same overload
          n=$(echo $devs | tr ',' '\n' | wc -l); rate=$((n * 10))
          python3 -m diffgraph.server.cli --model random:sd15 --devices $devs --port 8200 --log-level warning \
            --no-access-log --max-queue 100000 &
          server=$!
          python3 -c "import httpx, time
while True:
    try:
        r = httpx.get('http://127.0.0.1:8200/ready', timeout=5)
        if r.status_code == 200 and all(x['state'] == 'ready' for x in r.json()['replicas']): break
    except (httpx.TransportError, KeyError, ValueError): pass
    time.sleep(0.5)"
          python3 -m diffgraph.bench.serve --url http://127.0.0.1:8200 --rate $rate --duration 15 --mix 512x512/20 \
            --json "$OUT/dp_$n.json" > /dev/null 2>&1
          python3 -c "import json; r = json.load(open('$OUT/dp_$n.json')); print('$devs', 'rate', r['rate'], 'ok', r['ok'], '/', r['sent'], 'images/s %.2f' % r['images_per_s'], 'p50 %.2f p99 %.2f s' % (r['latency_s']['p50'], r['latency_s']['p99']), 'errors', r['errors'])"
          kill -TERM $server; wait $server
        done ;;
    dp60) python3 tools/bench_dp.py --label "$DP_LABEL" --sat-rate "$DP_RATE" --json "$OUT/dp60_$DP_LABEL.json" -- $DP_FLAGS \
            2>&1 | grep -v Warning | tee "$OUT/dp60_$DP_LABEL.log" ;;
    edits) python3 -m diffgraph.bench.throughput --sizes 512x512 --duration 30 --rates ${EDIT_RATE:-11.1} --modes step \
             --edit-fraction 0.5 --json "$OUT/bench_edits.json" 2>&1 | grep -v Warning | tee "$OUT/bench_edits.log" ;;
    throughput) python3 -m diffgraph.bench.throughput --duration 15 --json "$OUT/bench_throughput.json" 2>&1 | grep -v Warning | tee "$OUT/bench_throughput.log" ;;
  esac
done
