"""Sampling: training noise schedules and per-request sampler coefficient tables (pure, CPU, float64).

`make_plan(NoiseSchedule.from_config(cfg), sampler, schedule, steps)` gives a `SamplerPlan` whose rows drive
one batched update per step (see samplers.py). The diffusers oracle lives in `sampling.oracle` and is not
imported here, so the engine does not pull in diffusers' schedulers.
"""

from .samplers import NUM_COEFS, Coef, SamplerPlan, apply_step, check_sampler, make_plan
from .schedules import SAMPLERS, SCHEDULES, NoiseSchedule

__all__ = [
    "NUM_COEFS",
    "SAMPLERS",
    "SCHEDULES",
    "Coef",
    "NoiseSchedule",
    "SamplerPlan",
    "apply_step",
    "check_sampler",
    "make_plan",
]
