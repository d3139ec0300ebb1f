"""The sampler and schedule names a request may ask for: plain data, no numpy or torch, so that the command
line can list them in `--help` without loading anything. `schedules.py` re-exports them."""

SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "ddim")
SCHEDULES = ("default", "karras")
