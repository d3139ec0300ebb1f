#!/usr/bin/env bash
# Issue 28's fault tests, and tests/test_ray.py, N times in a row (default 3) with two CPU-bound processes loading
# the machine (as CI's 2-core machine is loaded). Stops at the first failing run. Usage: bash tools/loaded_runs.sh [N]
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
TESTS=(tests/test_failure_policy.py tests/test_replicas.py tests/test_engine_process.py tests/test_engine_memory.py
       tests/test_lora_host_memory.py tests/test_drain_long_step.py tests/test_submit_bounds.py tests/test_ray.py
       tests/test_ray_units.py "tests/test_server.py::test_an_image_over_max_pixels_is_a_400_naming_size_with_the_limit")
python3 -c "while True: pass" & a=$!
python3 -c "while True: pass" & b=$!
trap 'kill $a $b 2>/dev/null' EXIT
for i in $(seq 1 "${1:-3}"); do
  start=$(date +%s)
  python -m pytest -q -p no:cacheprovider --durations=6 "${TESTS[@]}" > "/tmp/loaded_run_$i.log" 2>&1
  rc=$?
  echo "run $i: rc=$rc, $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(tail -1 /tmp/loaded_run_$i.log)"
  [ $rc = 0 ] || exit $rc
done
