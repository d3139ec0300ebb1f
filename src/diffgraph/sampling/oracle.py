"""diffusers schedulers equivalent to our (sampler, schedule) pairs: the reference our plans are tested against.

Used by tests and by end-to-end comparisons (`pipe.scheduler = diffusers_scheduler(pipe.scheduler.config, ...)`):
the returned scheduler works in a stock pipeline call. It is built from the `NoiseSchedule` read from the
config, with every sampler-choosing option forced to the defaults `samplers.py` implements, so that the
config's leftovers (use_karras_sigmas, solver_order, sigma_min, ...) cannot make the two sides disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)

from .samplers import check_sampler
from .schedules import NoiseSchedule


class KarrasEulerAncestralDiscreteScheduler(EulerAncestralDiscreteScheduler):
    """Euler ancestral on the Karras sigmas (and fractional timesteps) EulerDiscreteScheduler would use.

    diffusers' EulerAncestralDiscreteScheduler has no `use_karras_sigmas`; this takes the sigmas and
    timesteps from an EulerDiscreteScheduler of the same config, so euler and euler_a share one schedule.
    """

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        euler = EulerDiscreteScheduler.from_config(self.config, **(_EULER_DEFAULTS | {"use_karras_sigmas": True}))
        euler.set_timesteps(num_inference_steps, device=device)
        self.num_inference_steps = num_inference_steps
        self.sigmas = euler.sigmas.to("cpu")
        self.timesteps = euler.timesteps
        self._step_index = None
        self._begin_index = None


_EULER_DEFAULTS: dict[str, Any] = {
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "sigma_min": None,
    "sigma_max": None,
    "timestep_type": "discrete",
    "final_sigmas_type": "zero",
}

_DPM_DEFAULTS: dict[str, Any] = {
    "algorithm_type": "dpmsolver++",
    "solver_order": 2,
    "solver_type": "midpoint",
    "lower_order_final": True,
    "euler_at_final": False,
    "final_sigmas_type": "zero",
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_lu_lambdas": False,
    "use_flow_sigmas": False,
    "lambda_min_clipped": -float("inf"),
    "variance_type": None,
    "thresholding": False,
    "use_dynamic_shifting": False,
}


def diffusers_scheduler(config: Mapping[str, Any], sampler: str, schedule: str):
    """The diffusers scheduler that walks the same latents as `make_plan(..., sampler, schedule, n)`."""
    check_sampler(sampler, schedule)
    noise = NoiseSchedule.from_config(config)
    common = noise.diffusers_kwargs()
    karras = schedule == "karras"
    # Drop the class name so from_config does not complain that the config belongs to another class.
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    if sampler == "euler":
        return EulerDiscreteScheduler.from_config(config, **common, **(_EULER_DEFAULTS | {"use_karras_sigmas": karras}))
    if sampler == "euler_a":
        cls = KarrasEulerAncestralDiscreteScheduler if karras else EulerAncestralDiscreteScheduler
        return cls.from_config(config, **common)
    if sampler == "dpmpp_2m":
        return DPMSolverMultistepScheduler.from_config(config, **common, **(_DPM_DEFAULTS | {"use_karras_sigmas": karras}))
    return DDIMScheduler.from_config(
        config, **common, set_alpha_to_one=noise.set_alpha_to_one, clip_sample=False, thresholding=False
    )
