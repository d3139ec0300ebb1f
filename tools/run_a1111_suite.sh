#!/usr/bin/env bash
# Runs a test folder written for AUTOMATIC1111's web API, unchanged, against `diffgraph serve` on the CPU: its own
# API tests (its repository's test/ folder) or the ControlNet extension's tests/web_api (Mikubill's, or Forge's
# extensions-builtin/sd_forge_controlnet/tests), in their CI mode (FORGE_CQ_TEST=True: 3 steps, small images).
# Those files are AGPL-licensed: keep the copy outside this repository (README, "AUTOMATIC1111 clients").
#
# usage: tools/run_a1111_suite.sh SUITE_DIR [pytest arguments...]
#   e.g. tools/run_a1111_suite.sh /work/a1111-tests/test
#        tools/run_a1111_suite.sh /work/cn-tests/forge/extensions-builtin/sd_forge_controlnet/tests
# environment:
#   PORT (7860: the ControlNet suites call localhost:7860 whatever --base-url says), MODEL (random:tiny),
#   CONTROLNETS (control_v11p_sd15_canny: tiny ControlNets made from the model's UNet, named as the suites look
#   them up; empty: none), PYTHON (the repository's .venv, else python3), SERVE_ARGS (more `serve` flags).
# The server's log is written to output.txt in the suite's parent folder, where the ControlNet suites read it (as
# their CI tees it). The pytest plugin pytest-base-url (the suites' `base_url` fixture) is installed into a cache
# folder when missing. Exit status: pytest's.
set -euo pipefail

suite=$(cd "${1:?usage: tools/run_a1111_suite.sh SUITE_DIR [pytest arguments...]}" && pwd)
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
port=${PORT:-7860}
model=${MODEL:-random:tiny}
python=${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/diffgraph-a1111-suite
work=$(dirname "$suite")
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}:$cache/deps"

if ! "$python" -c "import pytest_base_url" 2>/dev/null; then
    "$python" -m pip install -q --no-deps --target "$cache/deps" "pytest-base-url~=2.0"
fi

serve_args=(--model "$model" --device cpu --host 127.0.0.1 --port "$port")
if [ -n "${CONTROLNETS-control_v11p_sd15_canny}" ]; then
    nets=$(mktemp -d)
    PYTHONPATH="$PYTHONPATH:$repo/tests" "$python" - "$model" "$nets" ${CONTROLNETS-control_v11p_sd15_canny} <<'EOF'
import sys
from control_util import make_controlnet
from diffgraph import Engine
model, folder, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with Engine(model=model, device="cpu", dtype="fp32") as engine:
    for i, name in enumerate(names):
        make_controlnet(engine.model.denoiser, f"{folder}/{name}", seed=10 + i)
EOF
    serve_args+=(--controlnet-dir "$nets")
fi

"$python" -m diffgraph.cli serve "${serve_args[@]}" ${SERVE_ARGS:-} > "$work/output.txt" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; [ -n "${nets:-}" ] && rm -rf "$nets"' EXIT
for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/ready" > /dev/null && break
    kill -0 "$server" 2>/dev/null || { tail -20 "$work/output.txt"; exit 1; }
    sleep 0.5
done

cd "$work"
FORGE_CQ_TEST=${FORGE_CQ_TEST:-True} "$python" -m pytest -v -rfEs --tb=line -p no:cacheprovider \
    --continue-on-collection-errors --base-url "http://127.0.0.1:$port" --verify-base-url "$suite" "$@"
