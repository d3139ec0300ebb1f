"""Consistency-model sampler plans: LCM and TCD, one row a step on VP latents.

Owns the plan functions (`PLANS`, read by `samplers.make_plan`) of

- `lcm`: LCMScheduler (Luo et al. 2023): D = c_skip * x + c_out * x0, with the boundary-condition scalings of the
  step's timestep scaled by 10 (`timestep_scaling`), then x_next = alpha_prev * D + sigma_prev * noise, D itself at
  the last step;
- `tcd`: TCDScheduler (Zheng et al. 2024) with gamma `eta` (0.3, its step's default): D = x0, the step goes by DDIM
  to s = floor((1 - gamma) * t_prev), then forward to t_prev with fresh noise (none at the last step, which ends at
  s = 0, nor anywhere with gamma 0).

Both walk the distillation's grid, not the model's timestep spacing: the n timesteps evenly picked from the 50
(`original_inference_steps`) timesteps 1000 / 50 * k - 1, so they take schedule "default" only and at most 50 steps
(diffusers refuses more). Noise is drawn at every row but the last. `sigmas` are the VE sigmas sqrt((1 - abar) /
abar) of each row's state, then where x ends (0 for LCM, timestep 0 for TCD); they serve image-to-image noising and
inpainting, and are infinite at timestep 999 of a zero terminal SNR schedule (as DDIM's).

From step `start` the rows are the full plan's (the rows share no state), as diffusers' LCMScheduler / TCDScheduler
run `timesteps[start:]` after `set_begin_index(start)` in a pipeline that cuts its schedule by strength (the Stable
Diffusion image-to-image pipelines, LCM-LoRA's usual setting). diffusers' own LatentConsistencyModelImg2ImgPipeline
instead passes `strength` to set_timesteps and runs all n steps on the first int(50 * strength) grid timesteps; a
plan knows its start step, not the strength, so it does not take that route.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .schedules import NoiseSchedule
from .table import PlanParts, cut, denoiser, table

ORIGINAL_STEPS = 50       # LCMScheduler / TCDScheduler original_inference_steps: the distillation's grid
TIMESTEP_SCALING = 10.0   # LCMScheduler timestep_scaling (c_skip, c_out of t * 10)
SIGMA_DATA = 0.5
TCD_GAMMA = 0.3           # TCDScheduler.step's eta


def grid_timesteps(noise: NoiseSchedule, n: int, sampler: str) -> np.ndarray:
    """The n timesteps of LCMScheduler.set_timesteps (TCD alike): every (50 / n)-th of the 50 grid timesteps."""
    n_train = noise.num_train_timesteps
    if n_train < ORIGINAL_STEPS:
        raise ValueError(f"sampler {sampler!r} needs num_train_timesteps >= {ORIGINAL_STEPS} (its distillation grid "
                         f"has {ORIGINAL_STEPS} timesteps), got {n_train}; use another sampler")
    if n > ORIGINAL_STEPS:
        raise ValueError(f"sampler {sampler!r} takes at most {ORIGINAL_STEPS} steps (its distillation grid, "
                         f"original_inference_steps), got num_steps {n}; use 1..{ORIGINAL_STEPS}")
    grid = (np.arange(1, ORIGINAL_STEPS + 1) * (n_train // ORIGINAL_STEPS) - 1)[::-1]
    picks = np.floor(np.linspace(0, ORIGINAL_STEPS, num=n, endpoint=False)).astype(np.int64)
    return grid[picks].astype(np.float64)


def _ve_sigma(abar: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):  # zero terminal SNR: abar 0 at the top timestep is an infinite VE sigma
        return np.sqrt((1 - abar) / abar)


def _boundary_scalings(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LCMScheduler.get_scalings_for_boundary_condition_discrete: (c_skip, c_out) of timesteps t."""
    scaled = t * TIMESTEP_SCALING
    return SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2), scaled / np.sqrt(scaled**2 + SIGMA_DATA**2)


def _lcm_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    t = grid_timesteps(noise, n, "lcm")
    ac = noise.alphas_cumprod()
    ac_t, ac_next = ac[t.astype(np.int64)], ac[np.append(t[1:], t[-1]).astype(np.int64)]
    p, q = denoiser(noise.prediction_type, np.sqrt(ac_t), np.sqrt(1 - ac_t), ve=False)
    c_skip, c_out = _boundary_scalings(t)
    last = np.arange(n) == n - 1
    b = np.where(last, 1.0, np.sqrt(ac_next))
    d = np.where(last, 0.0, np.sqrt(1 - ac_next))
    coefs = table(t, np.ones(n), c_out * p + c_skip, c_out * q, 0.0, b, d=d)
    sigmas = np.append(_ve_sigma(ac_t), 0.0)
    return cut(PlanParts(t, sigmas, coefs, 1.0, ve=False, noise_steps=~last), start)


def _tcd_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    gamma = TCD_GAMMA if eta is None else float(eta)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"tcd's gamma (eta) must be in [0, 1], got {gamma}; pass a value in that range")
    t = grid_timesteps(noise, n, "tcd")
    t_prev = np.append(t[1:], 0.0)
    # diffusers: torch.floor((1 - eta) * prev_timestep).long(), in float32 on the int64 timestep tensor
    t_s = torch.floor((1 - gamma) * torch.from_numpy(t_prev.astype(np.int64))).long().numpy()
    ac = noise.alphas_cumprod()
    ac_t, ac_prev, ac_s = ac[t.astype(np.int64)], ac[t_prev.astype(np.int64)], ac[t_s]
    alpha, sigma_vp = np.sqrt(ac_t), np.sqrt(1 - ac_t)
    p, q = denoiser(noise.prediction_type, alpha, sigma_vp, ve=False)
    # the DDIM step from t to s: alpha_s * D + sigma_s * eps, eps = (x - alpha * D) / sigma_vp
    a = np.sqrt(1 - ac_s) / sigma_vp
    b = np.sqrt(ac_s) - a * alpha
    draws = (np.arange(n) < n - 1) & (gamma > 0)
    forward = np.where(draws, np.sqrt(ac_prev / ac_s), 1.0)  # then to t_prev, with (1 - abar_prev / abar_s) of noise
    d = np.where(draws, np.sqrt(np.maximum(1 - ac_prev / ac_s, 0.0)), 0.0)
    coefs = table(t, np.ones(n), p, q, forward * a, forward * b, d=d)
    sigmas = np.append(_ve_sigma(ac_t), _ve_sigma(ac[t_s[-1:]]))
    return cut(PlanParts(t, sigmas, coefs, 1.0, ve=False, noise_steps=draws if draws.any() else None), start)


PLANS: dict[str, Callable[..., PlanParts]] = {
    "lcm": _lcm_plan,
    "tcd": _tcd_plan,
}
