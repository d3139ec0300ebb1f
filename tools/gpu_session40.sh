#!/usr/bin/env bash
# Session 40 on the GPU host (carry [".whl", ".old"]; .old/src = `git archive c08ca74 src`, the tree before this
# session): the GPU tests, and the compile tier's old/new pair (issue 62's "within 2%": one image and a burst's
# images/s, old and new alternating, each over its own kept compile cache).
#   bash tools/gpu_session40.sh gtests pair focus   (env: GTESTS_S, PAIR_S per run, ROUNDS, BURST, TREES, FOCUS_S)
#   (focus: tests/gpu/test_edits_gpu.py on the new and the old tree, whole logs kept; the token family's GPU test)
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
for what in "$@"; do
  case $what in
    gtests) timeout ${GTESTS_S:-300} python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
              --ignore tests/gpu/test_compile_gpu.py --ignore tests/gpu/test_fp8_gpu.py 2>&1 \
              | grep -E "assert|Error|passed|failed|PASS|FAIL" | tee "$OUT/gtests.log" | tail -14 ;;
    pair) for round in $(seq ${ROUNDS:-1}); do
            for tree in ${TREES:-old new}; do
              src=$([ $tree = old ] && echo "$PWD/.old/src" || echo "$PWD/src")
              PYTHONPATH=/tmp/site:$src timeout ${PAIR_S:-280} python3 -m diffgraph.bench.throughput \
                --model random:sd15 --sizes 512x512 --tiers compile --burst ${BURST:-64} \
                --compile-cache "/tmp/cc_$tree" --json "$OUT/pair_${tree}_${round}.json" \
                > "$OUT/pair_${tree}_${round}.log" 2>&1
              echo "[$tree round $round rc=$?]"
              grep -v -E "Warning|AUTOTUNE|triton_|strides:|dtypes:|SingleProcess" "$OUT/pair_${tree}_${round}.log" \
                | tail -6
            done
          done ;;
    focus) for tree in new old; do  # the edits test (whole log) on both trees, then the token family's on the new
             src=$([ $tree = old ] && echo "$PWD/.old/src" || echo "$PWD/src")
             PYTHONPATH=/tmp/site:$src timeout ${FOCUS_S:-200} python3 -m pytest -q -x -m gpu \
               tests/gpu/test_edits_gpu.py -p no:cacheprovider > "$OUT/edits_$tree.log" 2>&1
             echo "[edits $tree rc=$?]"; grep -E "passed|failed" "$OUT/edits_$tree.log" | tail -2
           done
           timeout ${FOCUS_S:-200} python3 -m pytest -q -m gpu tests/gpu/test_token_family_gpu.py -p no:cacheprovider \
             > "$OUT/token.log" 2>&1; echo "[token rc=$?]"; grep -E "Error|passed|failed" "$OUT/token.log" | tail -6 ;;
  esac
done
