# Sourced by tools/gpu_issue*.sh on the GPU host: the carried wheels installed into /tmp/site, PYTHONPATH set, the
# versions printed. $OUT: where results go (the device tool's output folder).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())"
# the project's dependencies the GPU image lacks travel as wheels: say which are missing before a test fails on it
python3 -c "import importlib.util as u; m=[n for n in ('diffusers','torchsde','trampoline') if not u.find_spec(n)]; \
m and print('missing on this host:', *m, '(here: bash ../shared/gpu/wheels.sh torchsde trampoline; carry .whl)')"
