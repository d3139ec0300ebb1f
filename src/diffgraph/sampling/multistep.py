"""Multistep sampler plans that keep history beyond one D: DPM-Solver++ 2M/3M SDE, LMS and UniPC.

Owns the plan functions (`PLANS`, read by `samplers.make_plan`) of

- `dpmpp_2m_sde` / `dpmpp_3m_sde`: DPMSolverMultistepScheduler, algorithm_type "sde-dpmsolver++", solver_order 2
  (midpoint) / 3, on VP latents; one noise tensor per step; D_{i-2} of the third order in history slot H1.
- `lms`: LMSDiscreteScheduler, order 4 (its step's default), on VE latents; H1..H3 hold the three previous
  derivatives (x - D) / sigma, the current one is folded into A and B; its coefficients are diffusers' quadratures.
- `plms`: PNDMScheduler with skip_prk_steps (AUTOMATIC1111's "PLMS"), in `PLMS_PLANS` (see the PLMS section).
- `unipc` / `unipc_3`: UniPCMultistepScheduler, bh2, predict_x0, corrector on, solver_order 2 / 3, on VP latents.
  The model is evaluated at the predictor's sample; the corrector then replaces it by the corrected sample, kept in
  H1 (the next corrector starts from it), with D_{i-2} (and D_{i-3}) in H2 (and H3).

Each row is written as linear forms over the sources (x, D, P, H1, H2, H3) of `table.py`: one for x_next, one per
history slot; slots no later row reads are cleared, so `PlanParts.history` is the slots a walk uses (none for one
row). Every plan equals its diffusers scheduler, as `oracle.diffusers_scheduler` builds it, from step `start` on as a
pipeline runs it after `set_begin_index(start)`: the DPM and UniPC solvers restart their order count there
(`lower_order_nums`), LMS keeps its step-indexed order but has no earlier derivatives (diffusers' behaviour). The DPM
and UniPC coefficients, D's included, are diffusers' own float32 scalars (its 0-d tensor arithmetic, replayed) combined
in float64: at small log-SNR steps and high sigmas that rounding shows in the latents.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .schedules import (
    NoiseSchedule,
    converted_sigmas,
    dpm_sigmas,
    euler_init_sigma,
    euler_sigmas,
    sigma_to_t,
    spaced_timesteps,
    to_f32,
)
from .table import HISTORY_SLOTS, HISTORY_SOURCES, Coef, PlanFunction, PlanParts, denoiser, hist_col, table

# The samplers whose diffusers scheduler takes rescale_betas_zero_snr (the others cannot run a zero-SNR model).
ZERO_SNR_SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "ddim", "dpmpp_2m_sde", "dpmpp_3m_sde", "unipc", "unipc_3",
                     "lcm", "tcd")


def _form(**weights: float) -> np.ndarray:
    """A linear form over HISTORY_SOURCES (x, D, P, H1, H2, H3), e.g. _form(X=a, D=b)."""
    form = np.zeros(len(HISTORY_SOURCES))
    for name, w in weights.items():
        form[HISTORY_SOURCES.index(name)] = w
    return form


def _from_past(past: Sequence[str], weights: Sequence[float]) -> np.ndarray:
    """sum_k weights[k] * (the source holding D_{i-k}), `past[k]` naming that source."""
    form = np.zeros(len(HISTORY_SOURCES))
    for name, w in zip(past, weights):
        form[HISTORY_SOURCES.index(name)] += w
    return form


def _write_row(coefs: np.ndarray, row: int, x_next: np.ndarray, slots: dict[int, np.ndarray]) -> None:
    """Put the linear forms of x_next and of the updated history slots into a table row."""
    for column, name in ((Coef.A, "X"), (Coef.B, "D"), (Coef.C, "P"), (Coef.E1, "H1"), (Coef.E2, "H2"),
                         (Coef.E3, "H3")):
        coefs[row, int(column)] = x_next[HISTORY_SOURCES.index(name)]
    for slot, form in slots.items():
        for name, w in zip(HISTORY_SOURCES, form):
            coefs[row, hist_col(slot, name)] = w


def _settle_history(coefs: np.ndarray) -> int:
    """Clear the updates of the history slots no row reads (a short walk needs fewer: 4 LMS rows read 3 slots, 1
    row none) and return the highest slot left, the plan's `history`: the columns of every slot above it are zero.

    A slot is read when x_next takes it (its E column) or when a slot that is read is updated from it."""
    read = {slot for slot in range(1, HISTORY_SLOTS + 1) if np.any(coefs[:, int(Coef[f"E{slot}"])] != 0)}
    while True:
        more = {k for j in read for k in range(1, HISTORY_SLOTS + 1) if np.any(coefs[:, hist_col(j, f"H{k}")] != 0)}
        if more <= read:
            break
        read |= more
    for slot in set(range(1, HISTORY_SLOTS + 1)) - read:
        coefs[:, [hist_col(slot, name) for name in HISTORY_SOURCES]] = 0.0
    return max(read, default=0)


def _refuse_zero_snr(noise: NoiseSchedule, sampler: str, scheduler: str) -> None:
    if noise.rescale_betas_zero_snr:
        raise ValueError(f"sampler {sampler!r} cannot run a zero terminal SNR schedule (rescale_betas_zero_snr): "
                         f"diffusers' {scheduler} has no such option; use one of {', '.join(ZERO_SNR_SAMPLERS)}")


class _F32:
    """diffusers' float32 scalar arithmetic on a plan's sigmas: its schedulers compute each step's coefficients from
    0-d float32 tensors, and at small log-SNR steps that rounding is not negligible (the third order's
    (1 - e^-2h - 2h) / (2h)^2 and UniPC's phi recursion cancel), so the plans take the same values, then combine them
    in float64. `alpha_sigma(k)`, `lam(k)`: alpha, sigma_vp and log(alpha / sigma_vp) of state k, as
    `_sigma_to_alpha_sigma_t` and the solvers' lambda lines compute them (lambda is inf at the final sigma 0)."""

    def __init__(self, sig: np.ndarray) -> None:
        self.sigmas = torch.from_numpy(np.asarray(sig, np.float32))

    def alpha_sigma(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sigma = self.sigmas[k]
        alpha = 1 / ((sigma**2 + 1) ** 0.5)
        return alpha, sigma * alpha

    def lam(self, k: int) -> torch.Tensor:
        alpha, sigma = self.alpha_sigma(k)
        return torch.log(alpha) - torch.log(sigma)


def _vp_table(noise: NoiseSchedule, t: np.ndarray, f32: _F32, start: int) -> np.ndarray:
    """The table of rows start.. of a VP-latent solver with its denoiser columns set (the rest zero): D is
    diffusers' convert_model_output with its float32 alpha and sigma of the row (D = x / alpha - sigma / alpha * out
    cancels, so a float64 alpha would move D by several float32 ulps)."""
    rows = range(start, len(t))
    alpha_sigma = [f32.alpha_sigma(k) for k in rows]
    alpha = np.array([float(a) for a, _ in alpha_sigma])
    sigma = np.array([float(s) for _, s in alpha_sigma])
    p, q = denoiser(noise.prediction_type, alpha, sigma, ve=False)
    return table(t[start:], np.ones(len(rows)), p, q, 0.0, 0.0)


# ---- DPM-Solver++ SDE (2M midpoint, 3M) ------------------------------------------------------------------------

def _dpm_sde_order(i: int, start: int, n: int, solver_order: int) -> int:
    """The order diffusers' DPMSolverMultistepScheduler.step takes at step i of n (final_sigmas_type "zero",
    lower_order_final) when the walk began at `start`."""
    done = min(i - start, solver_order)  # lower_order_nums
    if solver_order == 1 or done < 1 or i == n - 1:
        return 1
    if solver_order == 2 or done < 2 or (i == n - 2 and n < 15):
        return 2
    return 3


def _dpm_sde_step(f32: _F32, i: int, order: int) -> tuple[float, float, list[float]]:
    """(weight of x, weight of the noise, weights of D_i, D_{i-1}, D_{i-2}) of the SDE-DPM-Solver++ step from state
    i, as DPMSolverMultistepScheduler's first/second (midpoint)/third order updates compute them."""
    alpha_t, sigma_t = f32.alpha_sigma(i + 1)
    _, sigma_s0 = f32.alpha_sigma(i)
    lam_s0 = f32.lam(i)
    h = f32.lam(i + 1) - lam_s0
    a = float(sigma_t / sigma_s0 * torch.exp(-h))
    noise = float(sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)))
    b1 = alpha_t * (1 - torch.exp(-2.0 * h))
    if order == 1:
        return a, noise, [float(b1)]
    lam_s1 = f32.lam(i - 1)
    r0 = (lam_s0 - lam_s1) / h
    inv_r0 = float(1.0 / r0)
    if order == 2:  # D0 + 0.5 * D1 with D1 = (1 / r0) (m0 - m1)
        w = float(0.5 * b1) * inv_r0
        return a, noise, [float(b1) + w, -w]
    r1 = (lam_s1 - f32.lam(i - 2)) / h
    inv_r1, mix, inv_sum = float(1.0 / r1), float(r0 / (r0 + r1)), float(1.0 / (r0 + r1))
    c1 = float(alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0))
    c2 = float(alpha_t * ((1.0 - torch.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2 - 0.5))
    # c1 D1 + c2 D2, D1 = (1 + mix) D1_0 - mix D1_1, D2 = inv_sum (D1_0 - D1_1), D1_k = (m_k - m_{k+1}) / r_k
    u0 = c1 * (1 + mix) + c2 * inv_sum
    u1 = -(c1 * mix + c2 * inv_sum)
    return a, noise, [float(b1) + u0 * inv_r0, -u0 * inv_r0 + u1 * inv_r1, -u1 * inv_r1]


def _dpm_sde_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, solver_order: int) -> PlanParts:
    """SDE-DPM-Solver++ (Lu et al. 2022, sec. 5), diffusers' "sde-dpmsolver++": first order at the first step of
    the walk and at the last; the third order's D_{i-2} in H1 (H1' = P)."""
    sampler = f"dpmpp_{solver_order}m_sde"
    t, sig = dpm_sigmas(noise, n, schedule, sampler)
    f32 = _F32(sig)
    coefs = _vp_table(noise, t, f32, start)
    for row, i in enumerate(range(start, n)):
        a, noise_weight, weights = _dpm_sde_step(f32, i, _dpm_sde_order(i, start, n, solver_order))
        coefs[row, int(Coef.D)] = noise_weight
        x_next = _form(X=a) + _from_past(("D", "P", "H1"), weights)
        _write_row(coefs, row, x_next, {1: _form(P=1.0)} if solver_order == 3 else {})
    return PlanParts(t[start:], sig[start:], coefs, 1.0, ve=False, noise_steps=np.full(n - start, True),
                     history=_settle_history(coefs))


def _dpmpp_2m_sde_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _dpm_sde_plan(noise, n, schedule, start, solver_order=2)


def _dpmpp_3m_sde_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _dpm_sde_plan(noise, n, schedule, start, solver_order=3)


# ---- LMS ---------------------------------------------------------------------------------------------------------

LMS_ORDER = 4


def _lms_coefficient(sig32: np.ndarray, order: int, i: int, j: int) -> float:
    """diffusers' LMSDiscreteScheduler.get_lms_coefficient: the integral from sigma_i to sigma_{i+1} of the Lagrange
    basis polynomial of sigma_{i-j} over sigma_i..sigma_{i-order+1}, by scipy's quad with the integrand in float32
    (diffusers multiplies float32 tensors), so the value is diffusers' own."""
    try:
        from scipy import integrate
    except ImportError:
        raise ValueError("sampler 'lms' needs scipy (pip install scipy); use another sampler") from None

    def basis(tau: float) -> float:
        prod = np.float32(1.0)
        for k in range(order):
            if k != j:
                prod *= (np.float32(tau) - sig32[i - k]) / (sig32[i - j] - sig32[i - k])
        return float(prod)

    return integrate.quad(basis, float(sig32[i]), float(sig32[i + 1]), epsrel=1e-4)[0]


def _lms_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    """Linear multistep, order 4 (k-diffusion's sample_lms), on VE latents: x_next = x + sum_j c_j d_{i-j} with
    d = (x - D) / sigma; H1..H3 hold d_{i-1}..d_{i-3} (H1' = d_i, H2' = H1, H3' = H2). diffusers takes the order
    from the step index but has only the derivatives since `start`: it uses the first of that order's coefficients."""
    _refuse_zero_snr(noise, "lms", "LMSDiscreteScheduler")
    t, sig = euler_sigmas(noise, n, schedule)
    if n > 1 and t[0] == t[1]:
        raise ValueError(f"lms with {schedule} sigmas on this schedule repeats its first timestep at num_steps {n}; "
                         "use fewer steps or schedule 'default'")
    sig32 = sig.astype(np.float32)
    alpha = 1 / np.sqrt(sig[start:n] ** 2 + 1)
    p, q = denoiser(noise.prediction_type, alpha, sig[start:n] * alpha, ve=True)
    coefs = table(t[start:], alpha, p, q, 0.0, 0.0)
    for row, i in enumerate(range(start, n)):
        order = min(i + 1, LMS_ORDER)
        known = min(row + 1, LMS_ORDER)  # derivatives diffusers holds: this one and those since start
        c = [_lms_coefficient(sig32, order, i, j) for j in range(min(order, known))]
        s = sig[i]
        derivative = _form(X=1 / s, D=-1 / s)
        x_next = _form(X=1.0) + c[0] * derivative + _from_past(("H1", "H2", "H3"), c[1:])
        _write_row(coefs, row, x_next, {1: derivative, 2: _form(H1=1.0), 3: _form(H2=1.0)})
    return PlanParts(t[start:], sig[start:], coefs, euler_init_sigma(noise, sig), ve=True,
                     history=_settle_history(coefs))


# ---- UniPC (bh2, predict_x0) -------------------------------------------------------------------------------------

def _unipc_sigmas(noise: NoiseSchedule, n: int, schedule: str, sampler: str) -> tuple[np.ndarray, np.ndarray]:
    """UniPCMultistepScheduler's (timesteps, sigmas + 0): DPM-Solver's, except that it rounds Karras timesteps on the
    cosine schedule too (DPM-Solver truncates them there)."""
    if schedule != "karras" or noise.beta_schedule != "squaredcos_cap_v2":
        return dpm_sigmas(noise, n, schedule, sampler)
    train = noise.train_sigmas()
    sigmas = converted_sigmas("karras", float(train[0]), float(train[-1]), n)
    t = np.round(sigma_to_t(sigmas, train))
    if n > 1 and t[0] == t[1]:  # diffusers would find its first step by timestep at the second of them
        raise ValueError(f"{sampler} with karras sigmas on this schedule repeats its first timestep at num_steps {n}; "
                         "use fewer steps or schedule 'default'")
    return t, to_f32(np.append(sigmas, 0.0))


def _unipc_step(f32: _F32, frm: int, order: int, corrector: bool) -> tuple[float, list[float]]:
    """(weight of the sample at state `frm`, weights of D_frm, D_{frm-1}, ..., D_{frm-order+1}) of the sample at
    state frm + 1, as UniPCMultistepScheduler's multistep_uni_p_bh_update (bh2, predict_x0) computes them, or with
    `corrector` its multistep_uni_c_bh_update, whose extra weight, of D_{frm+1} (the model output at the predicted
    sample), comes first."""
    alpha_t, sigma_t = f32.alpha_sigma(frm + 1)
    _, sigma_s0 = f32.alpha_sigma(frm)
    lam_s0 = f32.lam(frm)
    h = f32.lam(frm + 1) - lam_s0
    rks = [(f32.lam(frm - k) - lam_s0) / h for k in range(1, order)]
    powers_of = torch.stack(rks + [torch.ones(())])
    hh = -h
    h_phi_1 = torch.expm1(hh)  # into the final sigma 0: h = inf, h_phi_1 = B_h = -1 (a first order step)
    b_h = torch.expm1(hh)      # bh2
    h_phi_k, factorial, powers, b = h_phi_1 / hh - 1, 1, [], []
    for k in range(1, order + 1):
        powers.append(torch.pow(powers_of, k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    rhos = _unipc_rhos(torch.stack(powers), torch.stack(b), order, corrector)
    scale = -float(alpha_t * b_h)
    weights = [-float(alpha_t * h_phi_1)] + [0.0] * (order - 1)
    for k in range(1, order):  # rho_k (D_{frm-k} - D_frm) / r_k
        w = scale * rhos[k - 1] / float(rks[k - 1])
        weights[k] += w
        weights[0] -= w
    ratio = float(sigma_t / sigma_s0)
    if not corrector:
        return ratio, weights
    rho_t = scale * rhos[-1]  # rho_c[-1] (D_{frm+1} - D_frm)
    weights[0] -= rho_t
    return ratio, [rho_t] + weights


def _unipc_rhos(powers: torch.Tensor, b: torch.Tensor, order: int, corrector: bool) -> list[float]:
    """rhos_c (corrector) or rhos_p, as diffusers solves for them in float32 (0.5 at the orders it shortcuts)."""
    if corrector:
        return [0.5] if order == 1 else torch.linalg.solve(powers, b).tolist()
    if order == 1:
        return []
    return [0.5] if order == 2 else torch.linalg.solve(powers[:-1, :-1], b[:-1]).tolist()


def _unipc_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, solver_order: int) -> PlanParts:
    """UniPC (Zhao et al. 2023), bh2, predict_x0, as diffusers' UniPCMultistepScheduler: at each step after the
    walk's first, UniC corrects the predicted sample x_i (the one the model saw) from the last corrected sample
    xc_{i-1} (H1) and the D's; UniP then steps from the corrected sample. H1' = xc_i; D_{i-2}, D_{i-3} in H2, H3."""
    sampler = "unipc" if solver_order == 2 else f"unipc_{solver_order}"
    t, sig = _unipc_sigmas(noise, n, schedule, sampler)
    f32 = _F32(sig)
    coefs = _vp_table(noise, t, f32, start)
    past = ("D", "P", "H2", "H3")  # the sources of D_i, D_{i-1}, D_{i-2}, D_{i-3} at row i
    order_before = 0
    for row, i in enumerate(range(start, n)):
        if row == 0:
            corrected = _form(X=1.0)
        else:  # UniC at the order of the previous step's predictor, from xc_{i-1} and D_{i-1}, ... to state i
            a, weights = _unipc_step(f32, i - 1, order_before, corrector=True)
            corrected = _form(H1=a) + _from_past(past, weights)
        order = min(solver_order, n - i, row + 1)  # lower_order_final; the warm-up from `start` (lower_order_nums)
        a, weights = _unipc_step(f32, i, order, corrector=False)
        x_next = a * corrected + _from_past(past, weights)
        slots = {1: corrected, 2: _form(P=1.0)}
        if solver_order == 3:
            slots[3] = _form(H2=1.0)
        _write_row(coefs, row, x_next, slots)
        order_before = order
    return PlanParts(t[start:], sig[start:], coefs, 1.0, ve=False, history=_settle_history(coefs))


def _unipc_2_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _unipc_plan(noise, n, schedule, start, solver_order=2)


def _unipc_3_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return _unipc_plan(noise, n, schedule, start, solver_order=3)


PLANS: dict[str, PlanFunction] = {
    "dpmpp_2m_sde": _dpmpp_2m_sde_plan,
    "dpmpp_3m_sde": _dpmpp_3m_sde_plan,
    "lms": _lms_plan,
    "unipc": _unipc_2_plan,
    "unipc_3": _unipc_3_plan,
}


# ---- PLMS --------------------------------------------------------------------------------------------------------
# PLMS (pseudo linear multistep, Liu et al. 2022; AUTOMATIC1111's "PLMS"): diffusers' PNDMScheduler with
# skip_prk_steps, on VP latents (`PLMS_PLANS`, beside `PLANS` in `samplers.make_plan`).
#
# diffusers walks the timesteps T_{n-1}, T_{n-2}, T_{n-2}, T_{n-3}, ..., T_0 (n + 1 rows; one at n = 1): the first row
# steps x by the model output e_0 (a DDIM-like transfer) and keeps x (H2) and e_0 (H1); the second evaluates there and
# redoes that step from the kept x with (e_1 + e_0) / 2; each later row steps with the Adams-Bashforth mean of its
# output and the kept ones (orders 2, 3, then 4: H1..H3 hold the three previous), e_1 never among them. A walk that
# begins at `start` (image-to-image) takes the timesteps from index `start` of that list with the counter at zero, as
# a pipeline does. The transfer is PNDM's `_get_prev_sample` (v-prediction converted with the row's sample); every
# coefficient is diffusers' float32 scalar, combined in float64. Zero terminal SNR is refused (PNDM has no option).

# Adams-Bashforth weights of (this output, the previous, ...) by how many outputs PNDM holds
_AB = {1: (1.0,), 2: (3 / 2, -1 / 2), 3: (23 / 12, -16 / 12, 5 / 12), 4: (55 / 24, -59 / 24, 37 / 24, -9 / 24)}


def plms_timesteps(noise: NoiseSchedule, n: int) -> np.ndarray:
    """PNDMScheduler's plms_timesteps for n steps: its n timesteps, descending, the second repeated."""
    t = spaced_timesteps(noise, n, points=n, round_linspace=True)
    return t if n == 1 else np.concatenate([t[:2], t[1:]])


def _transfer(ac: torch.Tensor, final: torch.Tensor, t: int, prev: int) -> tuple[float, float, float, float]:
    """(sample weight, model output weight, sqrt(abar_t), sqrt(1 - abar_t)) of PNDM's _get_prev_sample from timestep
    `t` to `prev` (below 0: the final alpha-bar), in its float32 arithmetic."""
    a_t = ac[t]
    a_prev = ac[prev] if prev >= 0 else final
    b_t, b_prev = 1 - a_t, 1 - a_prev
    sample = (a_prev / a_t) ** 0.5
    denom = a_t * b_prev ** 0.5 + (a_t * b_t * a_prev) ** 0.5
    return float(sample), float(-(a_prev - a_t) / denom), float(a_t ** 0.5), float(b_t ** 0.5)


def _plms_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    """PLMS as PNDMScheduler(skip_prk_steps=True) walks it (the section's comment): H1..H3 the outputs it holds,
    H2 the kept x at the first step."""
    if noise.rescale_betas_zero_snr:
        raise ValueError("sampler 'plms' cannot run a zero terminal SNR schedule (rescale_betas_zero_snr): diffusers' "
                         "PNDMScheduler has no such option; use one of euler, ddim, unipc")
    n_train = noise.num_train_timesteps
    steps = plms_timesteps(noise, n)
    if steps.max() >= n_train or steps.min() < 0:
        raise ValueError(f"num_steps {n} with timestep_spacing {noise.timestep_spacing!r} and steps_offset "
                         f"{noise.steps_offset} reaches timestep {int(steps.max())} >= num_train_timesteps; use fewer "
                         "steps")
    ratio = n_train // n
    ac = torch.from_numpy(noise.alphas_cumprod()).float()
    final = torch.tensor(1.0) if noise.set_alpha_to_one else ac[0]
    t = steps[start:]
    rows = len(t)
    ac_rows = ac[torch.from_numpy(t.astype(np.int64))].double().numpy()
    p, q = denoiser(noise.prediction_type, np.sqrt(ac_rows), np.sqrt(1 - ac_rows), ve=False)
    coefs = table(t, np.ones(rows), p, q, 0.0, 0.0)
    levels = [int(t[0])]  # the timestep of each state (below 0: the final alpha-bar)
    for row in range(rows):
        out = _form(X=-p[row] / q[row], D=1 / q[row])  # the row's model output, from x and D
        step_t, prev = int(t[row]), int(t[row]) - ratio
        if row == 1:  # the first step again, from the kept x, with the mean of both outputs
            step_t, prev = int(t[row]) + ratio, int(t[row])
            sample, combo = _form(H2=1.0), 0.5 * out + _form(H1=0.5)
            slots = {1: _form(H1=1.0)}
        else:
            held = 1 if row == 0 else min(row, 4)
            weights = _AB[held]
            combo = weights[0] * out + sum((w * _form(**{f"H{k}": 1.0}) for k, w in enumerate(weights[1:], 1)),
                                           np.zeros_like(out))
            sample = _form(X=1.0)
            slots = {1: out, 2: _form(X=1.0)} if row == 0 else {1: out, 2: _form(H1=1.0), 3: _form(H2=1.0)}
        a, b, root_a, root_b = _transfer(ac, final, step_t, prev)
        if noise.prediction_type == "v_prediction":  # PNDM turns the combined v into epsilon with the row's sample
            combo = root_a * combo + root_b * sample
        _write_row(coefs, row, a * sample + b * combo, slots)
        levels.append(prev)
    abar = np.array([float(ac[k]) if k >= 0 else float(final) for k in levels])
    sigmas = np.sqrt((1 - abar) / abar)
    full_steps = np.concatenate([[0], np.arange(n)]) if n > 1 else np.zeros(1, np.int64)
    return PlanParts(t, sigmas, coefs, 1.0, ve=False, step_index=np.maximum(full_steps[start:], start),
                     history=_settle_history(coefs))


PLMS_PLANS: dict[str, PlanFunction] = {"plms": _plms_plan}  # apart: its rows are not one a timestep of diffusers' sigmas
