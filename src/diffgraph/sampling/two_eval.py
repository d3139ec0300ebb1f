"""Two-evaluation sampler plans: Heun, DPM2 and DPM2 ancestral (the k-diffusion second-order samplers).

Owns the plan functions (`PLANS`, read by `samplers.make_plan`) of

- `heun`: HeunDiscreteScheduler (Karras et al. 2022, Alg. 1 without churn);
- `dpm2`: KDPM2DiscreteScheduler (k-diffusion's sample_dpm_2: the second evaluation at the log-midpoint sigma);
- `dpm2_a`: KDPM2AncestralDiscreteScheduler (sample_dpm_2_ancestral: DPM2 to sigma_down, then sigma_up of noise).

All on VE latents, on every schedule these classes take (default, karras, exponential, beta). A step is two rows, as
diffusers interleaves its timesteps: the first evaluates at sigma_k and moves x by Euler to the midpoint (Heun: to
sigma_{k+1}), keeping x in history slot H1; the second evaluates there and moves H1 to sigma_{k+1} (DPM2 ancestral:
to sigma_down, plus sigma_up * noise) with the second evaluation's derivative (Heun: the mean of both, the first from
P, its D). The last step is the first row alone, Euler to sigma 0: n steps are 2n - 1 rows, `step_index` 0, 0, 1, 1,
..., n - 1. `sigmas` are diffusers' `scheduler.sigmas` (s0, s1, s1, ..., s_{n-1}, s_{n-1}, 0), what its pipelines
noise an inpainting mask's known region to after each row, though a DPM2 second row's own state is at the midpoint.

From step `start` (image-to-image) a pipeline runs `timesteps[2 * start:]` after `set_begin_index(2 * start)`: the
steps share no state, so those rows are the full plan's from row 2 * start. The midpoint sigmas and timesteps are
computed with diffusers' float32 torch and numpy arithmetic, so that every timestep equals its value bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .multistep import ZERO_SNR_SAMPLERS
from .schedules import (
    NoiseSchedule,
    converted_sigmas,
    euler_init_sigma,
    euler_sigmas,
    interp_sigmas,
    sigma_to_t,
    spaced_timesteps,
    to_f32,
)
from .table import NUM_COEFS, Coef, PlanParts, denoiser, hist_col

_CLASS_NAMES = {"heun": "HeunDiscreteScheduler", "dpm2": "KDPM2DiscreteScheduler",
                "dpm2_a": "KDPM2AncestralDiscreteScheduler"}


@dataclass(frozen=True)
class _Steps:
    """A two-evaluation schedule of n steps. Step k evaluates at (t[k], sigmas[k]) and moves x to `first_to[k]`; for
    k < n - 1 its second row evaluates at (mid_t[k], mid_sigma[k]) and moves H1 by `dt[k]` along its derivative (Heun:
    the mean of both), adding `up[k]` of noise (DPM2 ancestral). `sigmas` has the final 0 (n + 1 entries)."""

    t: np.ndarray
    sigmas: np.ndarray
    first_to: np.ndarray
    mid_t: np.ndarray
    mid_sigma: np.ndarray
    dt: np.ndarray
    up: np.ndarray | None = None
    heun: bool = False


def _refuse_zero_snr(noise: NoiseSchedule, sampler: str) -> None:
    if noise.rescale_betas_zero_snr:
        raise ValueError(f"sampler {sampler!r} cannot run a zero terminal SNR schedule (rescale_betas_zero_snr): "
                         f"diffusers' {_CLASS_NAMES[sampler]} has no such option; use one of "
                         f"{', '.join(ZERO_SNR_SAMPLERS)}")


def _kdpm2_sigmas(noise: NoiseSchedule, n: int, schedule: str) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps, sigmas + 0) as the KDPM2 schedulers lay them: EulerDiscreteScheduler's, except that a sigma
    schedule's timesteps stay float64 (Karras' rounded), not float32."""
    if schedule == "default":
        return euler_sigmas(noise, n, schedule)
    train = noise.train_sigmas()
    spaced = interp_sigmas(to_f32(spaced_timesteps(noise, n, points=n, round_linspace=False)), train)
    s = converted_sigmas(schedule, float(spaced[-1]), float(spaced[0]), n, train)
    t = sigma_to_t(s, train)
    return (t.round() if schedule == "karras" else t), to_f32(np.append(s, 0.0))


def _sigma_to_t_f32(sigma: torch.Tensor, log_sigmas: np.ndarray) -> float:
    """diffusers' `_sigma_to_t` of one float32 sigma tensor against its float32 log-sigmas tensor, as the KDPM2
    schedulers call it for the midpoints: numpy's float32 log, then torch's float32 arithmetic (this mirrors both)."""
    log_sigma = np.log(np.maximum(np.asarray(sigma.numpy(), np.float32), np.float32(1e-10)))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low_idx = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = np.clip((low - log_sigma) / (low - high), np.float32(0), np.float32(1)).astype(np.float32)
    t = (np.float32(1) - w) * np.float32(low_idx) + w * np.float32(high_idx)
    return float(t.reshape(()))


def _midpoint_timesteps(noise: NoiseSchedule, mids: torch.Tensor) -> np.ndarray:
    """The timesteps of the float32 midpoint sigmas `mids` (float32 values: diffusers casts them to the dtype of its
    step timesteps, float32 or float64, exactly)."""
    log_sigmas = np.log(noise.train_sigmas().astype(np.float32))
    return np.array([_sigma_to_t_f32(m, log_sigmas) for m in mids], np.float64)


def _heun_steps(noise: NoiseSchedule, n: int, schedule: str) -> _Steps:
    t, sig = euler_sigmas(noise, n, schedule)
    return _Steps(t, sig, first_to=sig[1:], mid_t=t[1:], mid_sigma=sig[1:n], dt=sig[1:n] - sig[: n - 1], heun=True)


def _dpm2_steps(noise: NoiseSchedule, n: int, schedule: str) -> _Steps:
    """KDPM2DiscreteScheduler: the midpoint between sigma_k and sigma_{k+1} is their geometric mean, in float32
    (sigmas.log().lerp(sigmas.roll(1).log(), 0.5).exp(); its last, toward sigma 0, is 0)."""
    t, sig = _kdpm2_sigmas(noise, n, schedule)
    s32 = torch.from_numpy(sig.astype(np.float32))
    interpol = s32.log().lerp(s32.roll(1).log(), 0.5).exp()  # [k]: between sigma_{k-1} and sigma_k
    mid = interpol[1:n]
    return _Steps(t, sig, first_to=interpol[1:].double().numpy(), mid_t=_midpoint_timesteps(noise, mid),
                  mid_sigma=mid.double().numpy(), dt=sig[1:n] - sig[: n - 1])


def _dpm2_a_steps(noise: NoiseSchedule, n: int, schedule: str) -> _Steps:
    """KDPM2AncestralDiscreteScheduler: sigma_up / sigma_down of the ancestral split of sigma_k -> sigma_{k+1}, the
    midpoint between sigma_k and sigma_down (its last, toward sigma 0, is 0), all in diffusers' float32."""
    t, sig = _kdpm2_sigmas(noise, n, schedule)
    s32 = torch.from_numpy(sig.astype(np.float32))
    nxt = s32.roll(-1)
    nxt[-1] = 0.0
    up = (nxt**2 * (s32**2 - nxt**2) / s32**2) ** 0.5
    down = (nxt**2 - up**2) ** 0.5
    down[-1] = 0.0
    interpol = s32.log().lerp(down.log(), 0.5).exp()
    interpol[-2:] = 0.0
    mid = interpol[: n - 1]
    bad = [k for k in range(n - 1) if not (down[k] > 0 and torch.isfinite(mid[k]))]
    if bad:
        k = bad[0]
        raise ValueError(f"dpm2_a at num_steps {n} on this schedule steps from sigma {float(s32[k]):.4g} to "
                         f"{float(s32[k + 1]):.4g}, too far for float32: its sigma_down there is 0 and "
                         "KDPM2AncestralDiscreteScheduler's midpoint NaN; use more steps")
    return _Steps(t, sig, first_to=interpol[:n].double().numpy(), mid_t=_midpoint_timesteps(noise, mid),
                  mid_sigma=mid.double().numpy(), dt=down[: n - 1].double().numpy() - sig[: n - 1],
                  up=up[: n - 1].double().numpy())


def _table(noise: NoiseSchedule, steps: _Steps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timesteps, coefficient table, noise rows) of all 2n - 1 rows."""
    n = len(steps.t)
    rows = 2 * n - 1
    t_rows, sigma_in = np.empty(rows), np.empty(rows)
    t_rows[0::2], t_rows[1::2] = steps.t, steps.mid_t
    sigma_in[0::2], sigma_in[1::2] = steps.sigmas[:n], steps.mid_sigma
    coefs = np.zeros((rows, NUM_COEFS))
    alpha = 1 / np.sqrt(sigma_in**2 + 1)
    p, q = denoiser(noise.prediction_type, alpha, sigma_in * alpha, ve=True)
    for column, values in ((Coef.C_IN, alpha), (Coef.T, t_rows), (Coef.P, p), (Coef.Q, q)):
        coefs[:, int(column)] = values
    for k in range(n):  # first rows: Euler from sigma_k to first_to[k], keeping x for the second
        a = steps.first_to[k] / steps.sigmas[k]
        coefs[2 * k, int(Coef.A)], coefs[2 * k, int(Coef.B)] = a, 1 - a
        if k < n - 1:
            coefs[2 * k, hist_col(1, "X")] = 1.0
    for k in range(n - 1):  # second rows: H1 + dt * derivative
        row, s, dt = coefs[2 * k + 1], steps.sigmas[k], steps.dt[k]
        own = dt / 2 / steps.mid_sigma[k] if steps.heun else dt / steps.mid_sigma[k]  # (x - D) / sigma_mid
        row[int(Coef.A)], row[int(Coef.B)], row[int(Coef.E1)] = own, -own, 1.0
        if steps.heun:  # + dt / 2 * (H1 - P) / sigma_k, the first row's derivative
            row[int(Coef.E1)], row[int(Coef.C)] = 1 + dt / 2 / s, -dt / 2 / s
        if steps.up is not None:
            row[int(Coef.D)] = steps.up[k]
    noise_rows = np.zeros(rows, bool)
    if steps.up is not None:
        noise_rows[1::2] = True
    return t_rows, coefs, noise_rows


def _refuse_repeated_start(sampler: str, schedule: str, n: int, t_rows: np.ndarray) -> None:
    if np.count_nonzero(t_rows == t_rows[0]) > 1:
        # diffusers finds its first step by timestep and takes the second of repeated ones
        raise ValueError(f"{sampler} with {schedule} sigmas on this schedule repeats its first timestep at num_steps "
                         f"{n}; use fewer steps or schedule 'default'")


def _plan(noise: NoiseSchedule, n: int, schedule: str, start: int, sampler: str,
          steps_of: Callable[[NoiseSchedule, int, str], _Steps]) -> PlanParts:
    _refuse_zero_snr(noise, sampler)
    steps = steps_of(noise, n, schedule)
    t_rows, coefs, noise_rows = _table(noise, steps)
    _refuse_repeated_start(sampler, schedule, n, t_rows)
    s = steps.sigmas
    sigmas = np.concatenate([s[:1], np.repeat(s[1:n], 2), s[n:]])  # diffusers' scheduler.sigmas
    first = 2 * start
    rows = len(t_rows) - first
    return PlanParts(t_rows[first:], sigmas[first:], coefs[first:].copy(), euler_init_sigma(noise, s), ve=True,
                     noise_steps=noise_rows[first:] if steps.up is not None else None,
                     step_index=np.arange(first, first + rows) // 2, history=1 if rows > 1 else 0)


def _heun_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _plan(noise, n, schedule, start, "heun", _heun_steps)


def _dpm2_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _plan(noise, n, schedule, start, "dpm2", _dpm2_steps)


def _dpm2_a_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _plan(noise, n, schedule, start, "dpm2_a", _dpm2_a_steps)


PLANS: dict[str, Callable[[NoiseSchedule, int, str, int], PlanParts]] = {
    "heun": _heun_plan,
    "dpm2": _dpm2_plan,
    "dpm2_a": _dpm2_a_plan,
}
