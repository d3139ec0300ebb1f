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
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
)
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput

from .samplers import TRAILING_SCHEDULES, check_sampler
from .schedules import NoiseSchedule


class SigmaEulerAncestralDiscreteScheduler(EulerAncestralDiscreteScheduler):
    """Euler ancestral on the Karras, exponential or beta sigmas (and fractional timesteps) EulerDiscreteScheduler
    would use (`sigma_schedule`, a config entry).

    diffusers' EulerAncestralDiscreteScheduler has no sigma options; this takes the sigmas and timesteps from an
    EulerDiscreteScheduler of the same config, so euler and euler_a share one schedule.
    """

    sigma_schedule = "karras"

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        euler = EulerDiscreteScheduler.from_config(
            self.config, **(_EULER_DEFAULTS | {f"use_{self.sigma_schedule}_sigmas": True}))
        euler.set_timesteps(num_inference_steps, device=device)
        self.num_inference_steps = num_inference_steps
        self.sigmas = euler.sigmas.to("cpu")
        self.timesteps = euler.timesteps
        self._step_index = None
        self._begin_index = None


class KarrasDDIMScheduler(DDIMScheduler):
    """DDIM (eta=0) on the Karras timesteps DPMSolverMultistepScheduler(use_karras_sigmas=True) would use.

    diffusers' DDIMScheduler has no Karras option, and its step goes back a fixed num_train_timesteps // n;
    this one takes DPM-Solver's rounded Karras timesteps and steps from each to the next in that list (the
    last to `final_alpha_cumprod`). Rounding can repeat a timestep, so the step is found by counting steps
    (like diffusers' `_step_index`), not by looking the timestep up.
    """

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        dpm = DPMSolverMultistepScheduler.from_config(self.config, **(_DPM_DEFAULTS | {"use_karras_sigmas": True}))
        dpm.set_timesteps(num_inference_steps, device=device)
        self.num_inference_steps = len(dpm.timesteps)
        self.timesteps = dpm.timesteps
        self._step_index = None

    def step(
        self,
        model_output: torch.Tensor,
        timestep: int | torch.Tensor,
        sample: torch.Tensor,
        eta: float = 0.0,
        use_clipped_model_output: bool = False,
        generator: torch.Generator | None = None,
        variance_noise: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> DDIMSchedulerOutput | tuple:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if self._step_index is None:
            # First occurrence: a pipeline starts at the first of repeated timesteps.
            matches = (self.timesteps == timestep).nonzero()
            if len(matches) == 0:
                raise ValueError(f"timestep {timestep} is not one of this scheduler's timesteps")
            self._step_index = int(matches[0])
        i = self._step_index
        prev_timestep = int(self.timesteps[i + 1]) if i + 1 < len(self.timesteps) else -1

        # The same float32 arithmetic as DDIMScheduler.step (eta: its variance, one draw a step where eta > 0).
        alpha_prod_t = self.alphas_cumprod[int(timestep)]
        alpha_prod_t_prev = self.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else self.final_alpha_cumprod
        beta_prod_t = 1 - alpha_prod_t
        if self.config.prediction_type == "epsilon":
            pred_original_sample = (sample - beta_prod_t ** (0.5) * model_output) / alpha_prod_t ** (0.5)
            pred_epsilon = model_output
        elif self.config.prediction_type == "v_prediction":
            pred_original_sample = (alpha_prod_t**0.5) * sample - (beta_prod_t**0.5) * model_output
            pred_epsilon = (alpha_prod_t**0.5) * model_output + (beta_prod_t**0.5) * sample
        else:
            raise ValueError(f"prediction_type {self.config.prediction_type!r} is not supported; "
                             "use 'epsilon' or 'v_prediction'")
        std_dev_t = eta * ((1 - alpha_prod_t_prev) / beta_prod_t * (1 - alpha_prod_t / alpha_prod_t_prev)) ** 0.5
        direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * pred_epsilon
        prev_sample = alpha_prod_t_prev ** (0.5) * pred_original_sample + direction
        if eta > 0:
            noise = variance_noise if variance_noise is not None else torch.randn(
                model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
            prev_sample = prev_sample + std_dev_t * noise
        self._step_index += 1
        if not return_dict:
            return (prev_sample, pred_original_sample)
        return DDIMSchedulerOutput(prev_sample=prev_sample, pred_original_sample=pred_original_sample)


class _RowSigmas:
    """KDPM2's `sigmas` without the two trailing zeros its set_timesteps appends beyond the last evaluation: one
    sigma per evaluation and the final 0 (2n entries for n steps, as Heun's), which is all its step and add_noise
    read; so they compare with a plan's `sigmas`. The walk itself is the stock scheduler's."""

    def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
        super().set_timesteps(*args, **kwargs)  # type: ignore[misc]
        self.sigmas = self.sigmas[: len(self.timesteps) + 1]


class RowSigmasKDPM2DiscreteScheduler(_RowSigmas, KDPM2DiscreteScheduler):
    """KDPM2DiscreteScheduler with one sigma per evaluation (_RowSigmas)."""


class RowSigmasKDPM2AncestralDiscreteScheduler(_RowSigmas, KDPM2AncestralDiscreteScheduler):
    """KDPM2AncestralDiscreteScheduler with one sigma per evaluation (_RowSigmas)."""


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

_SIGMA_OFF: dict[str, Any] = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}

_UNIPC_DEFAULTS: dict[str, Any] = _SIGMA_OFF | {
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "disable_corrector": [],
    "final_sigmas_type": "zero",
    "thresholding": False,
    "use_flow_sigmas": False,
    "use_dynamic_shifting": False,
    "shift_terminal": None,
    "sigma_min": None,  # UniPC's Karras sigmas take these as their range; ours span the training sigmas
    "sigma_max": None,
}


_CLASSES: dict[str, tuple[str, dict[str, Any]]] = {  # sampler -> (diffusers class, its forced options)
    "euler": ("EulerDiscreteScheduler", _EULER_DEFAULTS),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", _DPM_DEFAULTS),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", _DPM_DEFAULTS | {"algorithm_type": "sde-dpmsolver++"}),
    "dpmpp_3m_sde": ("DPMSolverMultistepScheduler", _DPM_DEFAULTS | {"algorithm_type": "sde-dpmsolver++",
                                                                      "solver_order": 3}),
    "dpmpp_sde": ("DPMSolverSDEScheduler", _SIGMA_OFF),
    "heun": ("HeunDiscreteScheduler", _SIGMA_OFF),
    "dpm2": ("RowSigmasKDPM2DiscreteScheduler", _SIGMA_OFF),
    "dpm2_a": ("RowSigmasKDPM2AncestralDiscreteScheduler", _SIGMA_OFF),
    "lms": ("LMSDiscreteScheduler", _SIGMA_OFF),
    "unipc": ("UniPCMultistepScheduler", _UNIPC_DEFAULTS),
    "unipc_3": ("UniPCMultistepScheduler", _UNIPC_DEFAULTS | {"solver_order": 3}),
    "lcm": ("LCMScheduler", {"original_inference_steps": 50, "timestep_scaling": 10.0, "thresholding": False,
                             "clip_sample": False}),
    "tcd": ("TCDScheduler", {"original_inference_steps": 50, "timestep_scaling": 10.0, "thresholding": False,
                             "clip_sample": False}),
}

_OWN_CLASSES = {c.__name__: c for c in (RowSigmasKDPM2DiscreteScheduler, RowSigmasKDPM2AncestralDiscreteScheduler)}


def diffusers_scheduler(config: Mapping[str, Any], sampler: str, schedule: str):
    """The diffusers scheduler that walks the same latents as `make_plan(..., sampler, schedule, n)`."""
    import diffusers

    check_sampler(sampler, schedule)
    if schedule in TRAILING_SCHEDULES:  # ComfyUI's names for the default schedule on trailing timesteps
        config, schedule = dict(config) | {"timestep_spacing": "trailing", "steps_offset": 0}, "default"
    noise = NoiseSchedule.from_config(config)
    common = noise.diffusers_kwargs()
    flags = {f"use_{name}_sigmas": schedule == name for name in ("karras", "exponential", "beta")}
    # Drop the class name so from_config does not complain that the config belongs to another class.
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    if sampler == "euler_a":
        if schedule == "default":
            return EulerAncestralDiscreteScheduler.from_config(config, **common)
        sched = SigmaEulerAncestralDiscreteScheduler.from_config(config, **common)
        sched.sigma_schedule = schedule
        return sched
    if sampler == "ddim":
        cls = KarrasDDIMScheduler if schedule == "karras" else DDIMScheduler
        return cls.from_config(
            config, **common, set_alpha_to_one=noise.set_alpha_to_one, clip_sample=False, thresholding=False
        )
    if sampler == "plms":  # (PNDM's own set_alpha_to_one default is False; the schedule's is the model's)
        return diffusers.PNDMScheduler.from_config(config, **common, skip_prk_steps=True,
                                                   set_alpha_to_one=noise.set_alpha_to_one)
    name, forced = _CLASSES[sampler]
    cls = _OWN_CLASSES.get(name) or getattr(diffusers, name)
    if sampler in ("lcm", "tcd"):
        flags = {}
    return cls.from_config(config, **common, **(forced | flags))


def step_kwargs(scheduler: Any, generator: torch.Generator | None) -> dict[str, Any]:
    """The keyword arguments of `scheduler.step` that pass the noise generator (schedulers without noise take none)."""
    import inspect

    return {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}
