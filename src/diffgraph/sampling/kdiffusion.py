"""k-diffusion's and AUTOMATIC1111's samplers that diffusers has no scheduler for, as plans (`PLANS`):

- `dpmpp_2s_a`: k-diffusion's sample_dpmpp_2s_ancestral: per step an evaluation at sigma_i, a DPM-Solver++ half step
  to the log-midpoint toward sigma_down, an evaluation there, the full step from x_i (history slot H1) with the
  midpoint's D, then sigma_up of fresh noise (eta scales it: 1 by default, 0 is DPM-Solver++(2S)); the last step is
  one evaluation, x = D;
- `dpmpp_2m_sde_heun`: sample_dpmpp_2m_sde with solver_type 'heun' (eta 1), one row a step, the previous D in P;
- `restart`: AUTOMATIC1111's restart_sampler (Xu et al. 2023): from 20 steps on, the schedule's sigmas are redrawn as
  Karras sigmas with fewer steps and a restart segment (Karras sigmas from sigma 2 back down to sigma 0.1, run once,
  twice from 36 steps) inserted where the walk reaches 0.1, after noise that lifts x back to sigma 2; every step is
  a Heun step (two rows; Euler into sigma 0), so a plan is about 2n rows;
- `dpm_fast`: sample_dpm_fast (DPM-Solver, Lu et al. 2022) from the model's sigma_max to its sigma_min with n
  evaluations: floor(n / 3) + 1 equal steps in log sigma of orders 3, ..., then 2, 1 or n % 3, each order-k step k
  rows (its intermediate states in H1, H2); eta (1 by default, as AUTOMATIC1111 runs it) adds the ancestral noise.
  It walks its own sigmas (schedule `default` only) and ends at sigma_min, as k-diffusion does.

All on VE latents (x = x0 + sigma * eps), each row's timestep the training timestep of its sigma (log-sigma
interpolation). A walk from step `start` (image-to-image) begins its sampler afresh there, as AUTOMATIC1111's
img2img does: the multistep and restart samplers on the schedule's sigmas from that step, DPM fast from that step's
sigma with n - start evaluations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import ParamError
from .multistep import _form, _settle_history, _write_row
from .schedules import NoiseSchedule, euler_sigmas, karras_sigmas, sigma_to_t, to_f32
from .table import Coef, PlanFunction, PlanParts, denoiser, table


@dataclass
class _Row:
    """One evaluation: at VE sigma `sigma`, x_next and the history slots as linear forms over the sources
    (multistep._form), `noise` of a fresh draw added, the state then at sigma `to`, in step `step`."""

    sigma: float
    x_next: np.ndarray
    to: float
    step: int
    slots: dict[int, np.ndarray] = field(default_factory=dict)
    noise: float = 0.0


def _parts(noise: NoiseSchedule, rows: list[_Row], first_sigma: float) -> PlanParts:
    """The plan of `rows`, the walk starting at VE sigma `first_sigma` (the initial latents' scale)."""
    sigma_in = np.array([r.sigma for r in rows], np.float64)
    t = to_f32(sigma_to_t(sigma_in, noise.train_sigmas()))
    alpha = 1 / np.sqrt(sigma_in**2 + 1)
    p, q = denoiser(noise.prediction_type, alpha, sigma_in * alpha, ve=True)
    coefs = table(t, alpha, p, q, 0.0, 0.0)
    for i, row in enumerate(rows):
        _write_row(coefs, i, row.x_next, row.slots)
        coefs[i, int(Coef.D)] = row.noise
    draws = np.array([r.noise != 0 for r in rows])
    return PlanParts(t, np.array([first_sigma] + [r.to for r in rows]), coefs, float(first_sigma), ve=True,
                     noise_steps=draws if draws.any() else None, step_index=np.array([r.step for r in rows]),
                     history=_settle_history(coefs))


def _eta(eta: float | None, label: str) -> float:
    eta = 1.0 if eta is None else float(eta)
    if not 0.0 <= eta <= 1.0:
        raise ParamError("eta", f"{label}'s eta must be in [0, 1] (1: its usual noise, 0: none), got {eta:g}")
    return eta


def _ancestral(sigma: float, sigma_next: float, eta: float) -> tuple[float, float]:
    """k-diffusion's get_ancestral_step: (sigma_down, sigma_up)."""
    if not eta:
        return sigma_next, 0.0
    up = min(sigma_next, eta * math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2))
    return math.sqrt(sigma_next**2 - up**2), up


def _dpmpp_2s_a_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    eta = _eta(eta, "DPM++ 2S a")
    _, sig = euler_sigmas(noise, n, schedule)
    rows = []
    for i in range(start, n):
        s, s_next = float(sig[i]), float(sig[i + 1])
        down, up = _ancestral(s, s_next, eta)
        if down == 0:  # into sigma 0: x = D
            rows.append(_Row(s, _form(D=1.0), s_next, i, noise=up))
            continue
        mid = math.sqrt(s * down)  # sigma at the log-midpoint between sigma and sigma_down
        rows.append(_Row(s, _form(X=mid / s, D=1 - mid / s), mid, i, slots={1: _form(X=1.0)}))
        rows.append(_Row(mid, _form(H1=down / s, D=1 - down / s), s_next, i, noise=up))
    return _parts(noise, rows, float(sig[start]))


def _dpmpp_2m_sde_heun_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    _, sig = euler_sigmas(noise, n, schedule)
    rows, h_last = [], None
    for i in range(start, n):
        s, s_next = float(sig[i]), float(sig[i + 1])
        if s_next == 0:
            rows.append(_Row(s, _form(D=1.0), 0.0, i))
            continue
        h = math.log(s / s_next)
        e = -math.expm1(-2 * h)
        w = 0.0 if h_last is None else (e / (-2 * h) + 1) * h / h_last  # heun: (phi(-2h) + 1) / r, r = h_last / h
        rows.append(_Row(s, _form(X=s_next / s * math.exp(-h), D=e + w, P=-w), s_next, i, noise=s_next * math.sqrt(e)))
        h_last = h
    return _parts(noise, rows, float(sig[start]))


def _restart_steps(sigmas: np.ndarray) -> list[tuple[float, float]]:
    """AUTOMATIC1111's restart list, planned from the step count: the (sigma_from, sigma_to) of each Heun step."""
    steps = len(sigmas) - 1
    restart = None
    if steps >= 20:
        restart_steps, times = (steps // 4, 2) if steps >= 36 else (9, 1)
        sigmas = np.append(karras_sigmas(float(sigmas[-2]), float(sigmas[0]), steps - restart_steps * times), 0.0)
        restart = (int(np.argmin(np.abs(sigmas - 0.1))), restart_steps + 1, times, int(np.argmin(np.abs(sigmas - 2))))
    pairs = []
    for i in range(len(sigmas) - 1):
        pairs.append((float(sigmas[i]), float(sigmas[i + 1])))
        if restart is not None and i + 1 == restart[0] and restart[3] < restart[0]:
            lows = karras_sigmas(float(sigmas[restart[0]]), float(sigmas[restart[3]]), restart[1])
            for _ in range(restart[2]):
                pairs.extend(zip(lows[:-1].tolist(), lows[1:].tolist()))
    return pairs


def _restart_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    _, sig = euler_sigmas(noise, n, schedule)
    pairs = _restart_steps(sig[start:])
    rows: list[_Row] = []
    for k, (old, new) in enumerate(pairs):
        if rows and rows[-1].to < old:  # back up: fresh noise to the restart's first sigma
            rows[-1].noise, rows[-1].to = math.sqrt(old**2 - rows[-1].to ** 2), old
        dt = new - old
        if new == 0:  # Euler into sigma 0
            rows.append(_Row(old, _form(D=1.0), 0.0, start + k))
            continue
        rows.append(_Row(old, _form(X=1 + dt / old, D=-dt / old), new, start + k, slots={1: _form(X=1.0)}))
        half_old, half_new = dt / 2 / old, dt / 2 / new  # x_i + dt / 2 (d(x_i) + d(x_2))
        rows.append(_Row(new, _form(H1=1 + half_old, P=-half_old, X=half_new, D=-half_new), new, start + k))
    return _parts(noise, rows, float(sig[start]))


def _dpm_fast_orders(nfe: int) -> list[int]:
    m = nfe // 3 + 1
    return [3] * (m - 2) + [2, 1] if nfe % 3 == 0 else [3] * (m - 1) + [nfe % 3]


def _dpm_solver_rows(s: float, s_next: float, h: float, order: int, step: int) -> list[_Row]:
    """The rows of one DPM-Solver step of `order` from sigma s over log-sigma length h to sigma s_next (noise not yet
    added): k-diffusion's dpm_solver_{1,2,3}_step (r1 = 1/2; r1, r2 = 1/3, 2/3) on eps = (x - D) / sigma."""
    big_e = math.expm1(h)
    eps_x = _form(X=1 / s, D=-1 / s)  # eps of the step's first evaluation, at its own row
    if order == 1:
        return [_Row(s, _form(X=1.0) - s_next * big_e * eps_x, s_next, step)]
    r1, r2 = (0.5, 1.0) if order == 2 else (1 / 3, 2 / 3)
    s1, s2 = s * math.exp(-r1 * h), s * math.exp(-r2 * h)
    first = _Row(s, _form(X=1.0) - s1 * math.expm1(r1 * h) * eps_x, s1, step, slots={1: _form(X=1.0)})
    eps0 = _form(H1=1 / s, P=-1 / s)  # at the second row: x of the first in H1, its D in P
    eps1 = _form(X=1 / s1, D=-1 / s1)
    if order == 2:
        x2 = _form(H1=1.0) - s_next * big_e * eps0 - s_next / (2 * r1) * big_e * (eps1 - eps0)
        return [first, _Row(s1, x2, s_next, step)]
    u2 = _form(H1=1.0) - s2 * math.expm1(r2 * h) * eps0 \
        - s2 * (r2 / r1) * (math.expm1(r2 * h) / (r2 * h) - 1) * (eps1 - eps0)
    second = _Row(s1, u2, s2, step, slots={1: _form(H1=1.0), 2: _form(P=1.0)})
    eps0 = _form(H1=1 / s, H2=-1 / s)  # at the third row: the first's D in H2
    eps2 = _form(X=1 / s2, D=-1 / s2)
    x3 = _form(H1=1.0) - s_next * big_e * eps0 - s_next / r2 * (big_e / h - 1) * (eps2 - eps0)
    return [first, second, _Row(s2, x3, s_next, step)]


def _dpm_fast_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    eta = _eta(eta, "DPM fast")
    train = noise.train_sigmas()
    sigma_min = float(train[0])
    sigma_max = float(train[-1]) if start == 0 else float(euler_sigmas(noise, n, "default")[1][start])
    nfe = n - start
    t_end = -math.log(sigma_min)
    ts = np.linspace(-math.log(sigma_max), t_end, nfe // 3 + 2)
    rows: list[_Row] = []
    for order, t, t_next in zip(_dpm_fast_orders(nfe), ts[:-1], ts[1:]):
        s, s_to = math.exp(-t), math.exp(-t_next)
        down, _ = _ancestral(s, s_to, eta)
        t_down = min(t_end, -math.log(down)) if eta else float(t_next)
        up = math.sqrt(max(s_to**2 - math.exp(-2 * t_down), 0.0)) if eta else 0.0
        step_rows = _dpm_solver_rows(s, math.exp(-t_down), t_down - t, order, 0)
        step_rows[-1].noise, step_rows[-1].to = up, s_to
        rows.extend(step_rows)
    for k, row in enumerate(rows):
        row.step = start + k
    return _parts(noise, rows, sigma_max)


PLANS: dict[str, PlanFunction] = {
    "dpmpp_2s_a": _dpmpp_2s_a_plan,
    "dpmpp_2m_sde_heun": _dpmpp_2m_sde_heun_plan,
    "restart": _restart_plan,
    "dpm_fast": _dpm_fast_plan,
}
