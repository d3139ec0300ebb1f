"""Per-request sampler plans: a table of per-step coefficients, so rows at different steps share one batch.

diffusers' schedulers keep a hidden step index, so one instance cannot serve rows at different steps. Here
each request gets a `SamplerPlan` (computed once, on the CPU, in float64) whose row `i` holds every number
step `i` needs. The step function (graphs/) then does, per batch row, with `out` the guided model output:

    model_input = c_in * x                      # fed to the UNet with timestep t
    D           = p * x + q * out               # denoised prediction x0 (epsilon or v_prediction)
    x_next      = a * x + b * D + c * D_prev + d * noise

`D_prev` is the row's D of its previous step (zero at step 0); `noise` is standard normal, drawn only when
`plan.draws_noise`. `apply_step` below is that update for numpy arrays or torch tensors.

Image-to-image and inpainting rows start later in the same table (`start_plan`: diffusers' strength rule) from
the image's latents noised to their first state (`noising`). Inpainting rows then blend, after each update, the
known region back in, noised to the row's next state: x <- (1 - m) * (k * image + e * noise0) + m * x, with k
and e the columns KNOWN and KNOWN_NOISE (1 and 0 at the last step), as diffusers' inpainting pipelines do.

Each sampler works in the state space of its diffusers counterpart (Euler: VE latents x0 + sigma*eps;
DDIM, DPM-Solver++: VP latents), so every intermediate x equals diffusers' latents within float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from .schedules import (
    MAX_STEPS,
    SAMPLERS,
    SCHEDULES,
    NoiseSchedule,
    interp_sigmas,
    karras_sigmas,
    sigma_to_t,
    spaced_timesteps,
    to_f32,
)



class Coef(IntEnum):
    """Columns of `SamplerPlan.coefs`."""

    C_IN = 0
    T = 1
    P = 2
    Q = 3
    A = 4
    B = 5
    C = 6
    D = 7
    KNOWN = 8        # inpainting: the known region at the next state = KNOWN * image latents + KNOWN_NOISE * noise
    KNOWN_NOISE = 9


NUM_COEFS = len(Coef)


@dataclass(frozen=True)
class SamplerPlan:
    sampler: str
    schedule: str
    num_steps: int
    coefs: np.ndarray  # float64 [num_steps, NUM_COEFS]
    init_noise_sigma: float  # initial latents = randn * init_noise_sigma
    draws_noise: bool  # True: one noise tensor per step, every step (euler_a, as diffusers)
    timesteps: np.ndarray  # UNet timestep per step, == coefs[:, Coef.T]
    sigmas: np.ndarray  # VE sigma per state, num_steps + 1 entries (the last is where x ends)


def make_plan(noise: NoiseSchedule, sampler: str, schedule: str, num_steps: int) -> SamplerPlan:
    """The coefficient table of `sampler` on `schedule` for `num_steps` steps of `noise`."""
    check_sampler(sampler, schedule)
    max_steps = min(MAX_STEPS, noise.num_train_timesteps)
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or not 1 <= num_steps <= max_steps:
        raise ValueError(f"num_steps {num_steps!r} is out of range; use an integer in 1..{max_steps}")
    num_steps = int(num_steps)
    karras = schedule == "karras"
    if sampler in ("euler", "euler_a"):
        plan = _euler_plan(noise, num_steps, karras, ancestral=sampler == "euler_a")
    elif sampler == "dpmpp_2m":
        plan = _dpmpp_2m_plan(noise, num_steps, karras)
    else:
        plan = _ddim_plan(noise, num_steps, karras)
    timesteps, sigmas, coefs, init_noise_sigma = plan
    ve = sampler in VE_SAMPLERS
    for i in range(num_steps - 1):  # the last step blends the un-noised image latents: (1, 0)
        coefs[i, int(Coef.KNOWN)], coefs[i, int(Coef.KNOWN_NOISE)] = _noising(float(sigmas[i + 1]), ve)
    coefs[num_steps - 1, int(Coef.KNOWN)] = 1.0
    if not np.all(np.isfinite(coefs)):
        raise ValueError(
            f"num_steps {num_steps} gives a degenerate {sampler} schedule with timestep_spacing "
            f"{noise.timestep_spacing!r} (repeated timesteps); use fewer steps"
        )
    return SamplerPlan(
        sampler=sampler,
        schedule=schedule,
        num_steps=num_steps,
        coefs=coefs,
        init_noise_sigma=float(init_noise_sigma),
        draws_noise=sampler == "euler_a",
        timesteps=timesteps,
        sigmas=sigmas,
    )


VE_SAMPLERS = ("euler", "euler_a")  # their state is x0 + sigma * eps; the others' is alpha * x0 + sigma_vp * eps


def _noising(sigma: float, ve: bool) -> tuple[float, float]:
    """(k, e): a clean latent x0 noised to the state of VE sigma `sigma` is k * x0 + e * noise (the add_noise of
    the sampler's diffusers scheduler: Euler adds sigma * noise; DPM-Solver and DDIM mix with alpha)."""
    if ve:
        return 1.0, sigma
    alpha = 1.0 / float(np.sqrt(sigma * sigma + 1.0))
    return alpha, sigma * alpha


def noising(plan: SamplerPlan) -> tuple[float, float]:
    """(k, e) of the plan's first state: image-to-image rows start at k * image latents + e * noise."""
    return _noising(float(plan.sigmas[0]), plan.sampler in VE_SAMPLERS)


def strength_start(num_steps: int, strength: float) -> int:
    """The step an edit of `strength` starts at (diffusers' get_timesteps); num_steps - start may be 0."""
    init = min(int(num_steps * strength), num_steps)
    return max(num_steps - init, 0)


def start_plan(plan: SamplerPlan, start: int) -> SamplerPlan:
    """The rest of `plan` from step `start` on, for rows that begin there (image-to-image, inpainting). A
    multistep solver's first step is first order (diffusers' DPM-Solver starts with lower_order_nums 0)."""
    if not 0 <= start < plan.num_steps:
        raise ValueError(f"start {start} is outside the plan's {plan.num_steps} steps")
    if start == 0:
        return plan
    coefs = plan.coefs[start:].copy()
    if plan.sampler == "dpmpp_2m":
        sigma, sigma_next = float(plan.sigmas[start]), float(plan.sigmas[start + 1])
        alpha_next = 1.0 / np.sqrt(sigma_next**2 + 1.0)
        coefs[0, int(Coef.B)] = alpha_next * (1.0 - sigma_next / sigma)
        coefs[0, int(Coef.C)] = 0.0
    return SamplerPlan(sampler=plan.sampler, schedule=plan.schedule, num_steps=plan.num_steps - start, coefs=coefs,
                       init_noise_sigma=plan.init_noise_sigma, draws_noise=plan.draws_noise,
                       timesteps=plan.timesteps[start:], sigmas=plan.sigmas[start:])


def check_sampler(sampler: str, schedule: str) -> None:
    """ValueError unless (sampler, schedule) is a pair we implement."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not supported; use one of {', '.join(SAMPLERS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not supported; use one of {', '.join(SCHEDULES)}")


def apply_step(coefs: Any, x: Any, out: Any, d_prev: Any, noise: Any = None) -> tuple[Any, Any]:
    """One update for a batch: coefs [B, NUM_COEFS] (one row per batch row), x/out/d_prev [B, ...].

    Works on numpy arrays and torch tensors alike; returns (x_next, D). The reference for the graphed step.
    """
    shape = (-1,) + (1,) * (x.ndim - 1)

    def col(k: Coef) -> Any:
        return coefs[:, int(k)].reshape(shape)

    denoised = col(Coef.P) * x + col(Coef.Q) * out
    x_next = col(Coef.A) * x + col(Coef.B) * denoised + col(Coef.C) * d_prev
    if noise is not None:
        x_next = x_next + col(Coef.D) * noise
    return x_next, denoised


def _denoiser(prediction_type: str, alpha: np.ndarray, sigma_vp: np.ndarray, ve: bool) -> tuple:
    """(p, q) with D = p * x + q * out, for x = alpha * x0 + sigma_vp * eps (VP), or that over alpha (VE)."""
    if prediction_type == "epsilon":
        p, q = 1 / alpha, -sigma_vp / alpha
    else:  # v_prediction: v = alpha * eps - sigma_vp * x0  (Salimans & Ho 2022)
        p, q = alpha, -sigma_vp
    return (p * alpha if ve else p), q


def _table(t, c_in, p, q, a, b, c=0.0, d=0.0) -> np.ndarray:
    coefs = np.zeros((len(t), NUM_COEFS), dtype=np.float64)
    for k, v in ((Coef.C_IN, c_in), (Coef.T, t), (Coef.P, p), (Coef.Q, q), (Coef.A, a), (Coef.B, b),
                 (Coef.C, c), (Coef.D, d)):
        coefs[:, int(k)] = v
    return coefs


def _euler_plan(noise: NoiseSchedule, n: int, karras: bool, ancestral: bool):
    """Euler (Karras et al. 2022, Alg. 2 without churn) / Euler ancestral (k-diffusion), on VE latents."""
    train = noise.train_sigmas()
    t = to_f32(spaced_timesteps(noise, n, points=n, round_linspace=False))
    s = interp_sigmas(t, train)
    if karras:
        # EulerDiscreteScheduler: the Karras range is the spaced schedule's own ends; fractional timesteps.
        s = karras_sigmas(float(s[-1]), float(s[0]), n)
        t = to_f32(sigma_to_t(s, train))
    sig = to_f32(np.append(s, 0.0))
    sigma, sigma_next = sig[:-1], sig[1:]
    alpha = 1 / np.sqrt(sigma**2 + 1)
    p, q = _denoiser(noise.prediction_type, alpha, sigma * alpha, ve=True)
    if ancestral:
        sigma_down = sigma_next**2 / sigma  # == sqrt(sigma_next^2 - sigma_up^2)
        sigma_up = sigma_next * np.sqrt(1 - (sigma_next / sigma) ** 2)
        a = sigma_down / sigma
        coefs = _table(t, alpha, p, q, a, 1 - a, d=sigma_up)
    else:
        a = sigma_next / sigma
        coefs = _table(t, alpha, p, q, a, 1 - a)
    # diffusers computes init_noise_sigma on a float32 tensor.
    smax = np.float32(sig.max())
    init = smax if noise.timestep_spacing in ("linspace", "trailing") else np.sqrt(smax * smax + np.float32(1))
    return t, sig, coefs, float(init)


def _dpmpp_2m_plan(noise: NoiseSchedule, n: int, karras: bool):
    """DPM-Solver++(2M), Lu et al. 2022; first order at the first and last step (diffusers' defaults)."""
    train = noise.train_sigmas()
    if karras:
        t, s = _karras_vp_timesteps(noise, n)
        if n > 1 and t[0] == t[1]:
            # diffusers finds its first step by timestep and would start at step 1 of a repeated one.
            raise ValueError(f"dpmpp_2m with karras sigmas on this schedule repeats its first timestep at "
                             f"num_steps {n}; use fewer steps or schedule 'default'")
    else:
        t = spaced_timesteps(noise, n, points=n + 1, round_linspace=True)
        s = interp_sigmas(t, train)
    sig = to_f32(np.append(s, 0.0))
    sigma, sigma_next = sig[:-1], sig[1:]
    alpha = 1 / np.sqrt(sigma**2 + 1)
    alpha_next = 1 / np.sqrt(sigma_next**2 + 1)
    p, q = _denoiser(noise.prediction_type, alpha, sigma * alpha, ve=False)
    # First order (DPM-Solver++ 1 == DDIM): with lambda = -log(sigma), exp(-h) = sigma_next / sigma.
    a = (sigma_next * alpha_next) / (sigma * alpha)
    b1 = alpha_next * (1 - sigma_next / sigma)
    b, c = b1.copy(), np.zeros(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(1, n - 1):  # second order between the first and the last step
            r0 = np.log(sig[i - 1] / sig[i]) / np.log(sig[i] / sig[i + 1])  # h_prev / h
            b[i] = b1[i] * (1 + 0.5 / r0)
            c[i] = -b1[i] * 0.5 / r0
    return t, sig, _table(t, np.ones(n), p, q, a, b, c), 1.0


def _karras_vp_timesteps(noise: NoiseSchedule, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(integer timesteps, sigmas) of DPMSolverMultistepScheduler(use_karras_sigmas=True): the Karras
    sigmas span the whole training range and their timesteps are rounded (DDIM on Karras reuses them)."""
    train = noise.train_sigmas()
    s = karras_sigmas(float(train[0]), float(train[-1]), n)
    t = sigma_to_t(s, train)
    # Rounded, except for the cosine schedule, where diffusers truncates them on the cast to int64.
    t = np.floor(t) if noise.beta_schedule == "squaredcos_cap_v2" else t.round()
    return t, s


def _ddim_plan(noise: NoiseSchedule, n: int, karras: bool):
    """DDIM with eta=0, Song et al. 2021, on VP latents."""
    n_train = noise.num_train_timesteps
    if karras:
        # oracle.KarrasDDIMScheduler: DPM-Solver's Karras timesteps, each step going to the next of them.
        t, _ = _karras_vp_timesteps(noise, n)
        t_prev = np.append(t[1:], -1).astype(np.int64)
    else:
        t = spaced_timesteps(noise, n, points=n, round_linspace=True)
        if t.max() >= n_train or t.min() < 0:
            raise ValueError(
                f"num_steps {n} with timestep_spacing {noise.timestep_spacing!r} and steps_offset "
                f"{noise.steps_offset} reaches timestep {int(t.max())} >= num_train_timesteps; use fewer steps"
            )
        # diffusers steps back by num_train_timesteps // n whatever the spacing, not to the next timestep.
        t_prev = t.astype(np.int64) - n_train // n
    ac = noise.alphas_cumprod()
    final = 1.0 if noise.set_alpha_to_one else ac[0]
    ac_t = ac[t.astype(np.int64)]
    ac_prev = np.where(t_prev >= 0, ac[np.maximum(t_prev, 0)], final)
    alpha, sigma_vp = np.sqrt(ac_t), np.sqrt(1 - ac_t)
    alpha_prev, sigma_vp_prev = np.sqrt(ac_prev), np.sqrt(1 - ac_prev)
    p, q = _denoiser(noise.prediction_type, alpha, sigma_vp, ve=False)
    # x_prev = alpha_prev * D + sigma_prev * eps, with eps = (x - alpha * D) / sigma
    a = sigma_vp_prev / sigma_vp
    b = alpha_prev - a * alpha
    with np.errstate(divide="ignore"):  # zero terminal SNR: alpha 0 at the top timestep is an infinite VE sigma
        sig = np.append(sigma_vp / alpha, sigma_vp_prev[-1] / alpha_prev[-1])
    return t, sig, _table(t, np.ones(n), p, q, a, b), 1.0
