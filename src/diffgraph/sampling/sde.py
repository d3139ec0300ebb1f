"""DPM-Solver++ SDE (`dpmpp_sde`): diffusers' DPMSolverSDEScheduler (k-diffusion's sample_dpmpp_sde, midpoint r = 1/2,
eta 1) as a plan, and the Brownian-tree noise its rows draw.

Each step is two rows on VE latents, as diffusers interleaves them: row 2i evaluates at sigma_i and moves to the
log-midpoint s_mid with an ancestral split (keeping x_i in history slot H1), row 2i+1 evaluates there and moves from x_i
to sigma_{i+1} with the midpoint's D; the last step is Euler to sigma 0. The noise of a row is not a fresh normal draw
but the increment of a Brownian motion between the row's two sigmas, W(s_to) - W(s_from) over sqrt(|s_to - s_from|):
`BrownianNoise` keeps one tree per request of shape [n, C, h, w] seeded by the request's seed (torchsde's
BrownianInterval with diffusers' settings), where diffusers keeps one per batch seeded by `noise_sampler_seed`; so a
request's image does not depend on its batch companions and equals diffusers' with `noise_sampler_seed` = its seed.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from .schedules import (NoiseSchedule, converted_sigmas, euler_init_sigma, interp_sigmas, sigma_to_t,
                        spaced_timesteps, to_f32)
from .table import Coef, PlanParts, denoiser, hist_col


def dpmpp_sde_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    if noise.rescale_betas_zero_snr:
        raise ValueError("dpmpp_sde's diffusers scheduler (DPMSolverSDEScheduler) has no zero terminal SNR option "
                         "(rescale_betas_zero_snr); use euler, euler_a, dpmpp_2m, dpmpp_2m_sde, dpmpp_3m_sde, ddim, "
                         "unipc, lcm or tcd with this model")
    train = noise.train_sigmas()
    if noise.timestep_spacing == "linspace":  # float64 here (diffusers keeps them so; Euler rounds to float32)
        t = np.linspace(0, noise.num_train_timesteps - 1, n)[::-1].copy()
    else:
        t = spaced_timesteps(noise, n, points=n, round_linspace=False)
    s = interp_sigmas(t, train)
    if schedule != "default":
        s = converted_sigmas(schedule, float(s[-1]), float(s[0]), n, train)
        t = sigma_to_t(s, train)
    mid = np.exp(-(-np.log(s[:-1]) + np.diff(-np.log(s)) * 0.5))
    rows = 2 * n - 1
    timesteps = np.empty(rows)
    timesteps[0::2], timesteps[1::2] = t, sigma_to_t(mid, train)
    s32 = to_f32(np.append(s, 0.0)).astype(np.float32)
    sigmas = np.concatenate([s32[:1], np.repeat(s32[1:-1], 2), s32[-1:]]).astype(np.float64)
    coefs = np.zeros((rows, len(Coef)))
    brownian = np.zeros((rows, 2))
    draws = np.zeros(rows, bool)
    for i in range(n):
        sig, nxt = s32[i], s32[i + 1]
        if nxt == 0:  # the last step: Euler to sigma 0 (x_next = D)
            _evaluate(coefs[2 * i], noise, float(sig), float(timesteps[2 * i]))
            coefs[2 * i, Coef.B] = 1.0
            continue
        s_from, s_mid, s_next = _sigmas_as_diffusers(sig, nxt)
        for row, s_to, sigma_in in ((2 * i, s_mid, sig), (2 * i + 1, s_next, s_mid)):
            up = min(s_to, np.sqrt(s_to**2 * (s_from**2 - s_to**2) / s_from**2))
            ratio = float(np.sqrt(s_to**2 - up**2) / s_from)  # sigma_down / sigma_from
            _evaluate(coefs[row], noise, float(sigma_in), float(timesteps[row]))
            coefs[row, Coef.B], coefs[row, Coef.D] = 1.0 - ratio, float(up)
            if row == 2 * i:  # first half: from x itself; keep it for the second half
                coefs[row, Coef.A], coefs[row, hist_col(1, "X")] = ratio, 1.0
            else:             # second half: from the step's starting x (H1)
                coefs[row, Coef.E1] = ratio
            brownian[row], draws[row] = (float(s_from), float(s_to)), True
    positive = s32[s32 > 0]
    parts = PlanParts(timesteps, sigmas, coefs, euler_init_sigma(noise, s32), ve=True, noise_steps=draws,
                      step_index=np.arange(rows) // 2 if rows > 1 else np.zeros(1, np.int64), history=1,
                      brownian=brownian, brownian_range=(float(positive.min()), float(s32.max())))
    return _from(parts, start)


def _sigmas_as_diffusers(sigma: np.float32, sigma_next: np.float32) -> tuple[np.float32, np.float32, np.float32]:
    """(sigma_fn(t), sigma_fn(t_mid), sigma_fn(t_next)) with t = -log(sigma), in torch's float32 arithmetic as
    DPMSolverSDEScheduler.step computes them: the Brownian tree is queried at exactly these points."""
    import torch

    t, t_next = (torch.tensor(v, dtype=torch.float32).log().neg() for v in (sigma, sigma_next))
    t_mid = t + (t_next - t) * 0.5
    return tuple(np.float32(v.neg().exp().item()) for v in (t, t_mid, t_next))


def _evaluate(row: np.ndarray, noise: NoiseSchedule, sigma: float, t: float) -> None:
    alpha = 1.0 / np.sqrt(sigma * sigma + 1.0)
    p, q = denoiser(noise.prediction_type, np.array([alpha]), np.array([sigma * alpha]), ve=True)
    row[Coef.C_IN], row[Coef.T], row[Coef.P], row[Coef.Q] = alpha, t, float(p[0]), float(q[0])


def _from(parts: PlanParts, start: int) -> PlanParts:
    """The rows from step `start` on (its first half): diffusers' timesteps[2 * start:], the tree's range kept."""
    if start == 0:
        return parts
    r = 2 * start
    return dataclasses.replace(parts, timesteps=parts.timesteps[r:], sigmas=parts.sigmas[r:], coefs=parts.coefs[r:],
                               noise_steps=parts.noise_steps[r:], step_index=parts.step_index[r:],
                               brownian=parts.brownian[r:])


class BrownianNoise:
    """One request's Brownian-tree noise: `draw(row)` is the increment between the plan row's two sigmas over the
    square root of their distance, [rows, C, h, w] float32 on the CPU (diffusers' BrownianTreeNoiseSampler)."""

    def __init__(self, brownian: np.ndarray, brownian_range: tuple[float, float], seed: int,
                 shape: tuple[int, ...]):
        try:
            import torch
            import torchsde
        except ImportError:
            raise RuntimeError("sampler 'dpmpp_sde' needs torchsde (pip install torchsde)") from None
        self._torch, self._pairs = torch, brownian
        lo, hi = brownian_range
        self._tree = torchsde.BrownianInterval(t0=lo, t1=hi, size=shape, dtype=torch.float32, device="cpu",
                                               entropy=seed, tol=1e-6, pool_size=24, halfway_tree=True)

    def draw(self, row: int):
        with warnings.catch_warnings():  # diffusers queries the same points (a float32 ulp past the range's end)
            warnings.filterwarnings("ignore", "Should have", UserWarning)
            return self._draw(row)

    def _draw(self, row: int):
        torch = self._torch
        s_from, s_to = (torch.tensor(v, dtype=torch.float32) for v in self._pairs[row])
        sign = 1.0 if s_from < s_to else -1.0
        lo, hi = (s_from, s_to) if sign > 0 else (s_to, s_from)
        return self._tree(float(lo), float(hi)) * sign / (s_to - s_from).abs().sqrt()
