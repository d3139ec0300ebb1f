"""Per-request sampler plans: a table of per-step coefficients, so rows at different steps share one batch.

diffusers' schedulers keep a hidden step index, so one instance cannot serve rows at different steps. Here
each request gets a `SamplerPlan` (computed once, on the CPU, in float64) whose row `i` holds every number
step `i` needs. The step function (graphs/) then does, per batch row, with `out` the guided model output:

    model_input = c_in * x                      # fed to the UNet with timestep t
    D           = p * x + q * out               # denoised prediction x0 (epsilon or v_prediction)
    x_next      = a * x + b * D + c * D_prev + d * noise + u * unguided

`D_prev` is the row's D of its previous step (zero at step 0); `noise` is standard normal, drawn only when
`plan.draws_noise`; `unguided` is the unconditional branch's output (column u: DDIM CFG++'s, zero elsewhere).
`apply_step` below is that update for numpy arrays or torch tensors.

Image-to-image and inpainting rows start later in the same table (`start_plan`: diffusers' strength rule) from
the image's latents noised to their first state (`noising`). Inpainting rows then blend, after each update, the
known region back in, noised to the row's next state: x <- (1 - m) * (k * image + e * noise0) + m * x, with k
and e the columns KNOWN and KNOWN_NOISE (1 and 0 at the last step), as diffusers' inpainting pipelines do.

Each sampler works in the state space of its diffusers counterpart (Euler: VE latents x0 + sigma*eps;
DDIM, DPM-Solver++: VP latents), so every intermediate x equals diffusers' latents within float rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import ParamError
from .schedules import (
    MAX_STEPS,
    SAMPLERS,
    SCHEDULES,
    NoiseSchedule,
    dpm_sigmas,
    euler_init_sigma,
    euler_sigmas,
    spaced_timesteps,
)
from .names import SCHEDULE_VARIANTS
from .table import NUM_COEFS, Coef, PlanFunction, PlanParts, apply_history, apply_step, cut, denoiser, table

__all__ = ["NUM_COEFS", "Coef", "PlanOptions", "SamplerPlan", "apply_history", "apply_step", "check_sampler", "make_plan",
           "cut", "noising", "start_plan", "strength_start"]

TRAILING_SCHEDULES = ("sgm_uniform", "simple")        # ComfyUI's names: the default schedule on trailing timesteps
# the samplers that take a request's `eta`
ETA_SAMPLERS = ("tcd", "ddim", "euler_a", "dpmpp_2s_a", "dpm_fast", "ddim_cfgpp")


@dataclass(frozen=True)
class SamplerPlan:
    sampler: str
    schedule: str
    num_steps: int          # rows: denoiser evaluations (a two-evaluation sampler's steps are two rows each)
    coefs: np.ndarray       # float64 [num_steps, NUM_COEFS]
    init_noise_sigma: float  # initial latents = randn * init_noise_sigma
    draws_noise: bool       # some row draws a noise tensor (`noise_steps` says which)
    timesteps: np.ndarray   # denoiser timestep per row, == coefs[:, Coef.T]
    sigmas: np.ndarray      # VE sigma per state, num_steps + 1 entries (the last is where x ends)
    noise_steps: np.ndarray  # bool [num_steps]: the rows that draw one noise tensor
    step_index: np.ndarray  # int [num_steps]: the step of the request's steps each row belongs to
    history: int = 0        # history slots the rows use (sampling/table.py)
    ve: bool = True         # the state is x0 + sigma * eps (else alpha * x0 + sigma_vp * eps)
    steps: int = 0          # the request's steps (num_inference_steps) the full plan has
    start: int = 0          # the step its first row belongs to (an edit's rows start later)
    noise: NoiseSchedule | None = None  # what it was made from (start_plan remakes it)
    eta: float | None = None  # TCD's gamma, DDIM's or Euler a's eta, as asked (None: the sampler's default, 0.3 / 0 / 1)
    brownian: np.ndarray | None = None  # [num_steps, 2] Brownian-tree noise spans (dpmpp_sde); None: normal draws
    brownian_range: tuple[float, float] | None = None
    # int [num_steps]: denoiser rows per image row at each row (2 where classifier-free guidance runs both branches),
    # set with the row features' columns (features/program.py:StepProgram.request_plan); None: one everywhere
    branches: np.ndarray | None = None




def _plan_functions() -> dict[str, PlanFunction]:
    """Sampler name -> its plan function (noise schedule, steps, schedule name)."""
    from . import consistency, kdiffusion, multistep, sde, two_eval
    return {"euler": _euler_plan, "euler_a": _euler_a_plan, "dpmpp_2m": _dpmpp_2m_plan, "ddim": _ddim_plan,
            "ddim_cfgpp": _ddim_cfgpp_plan,
            "dpmpp_sde": sde.dpmpp_sde_plan, **multistep.PLANS, **multistep.PLMS_PLANS, **two_eval.PLANS,
            **consistency.PLANS, **kdiffusion.PLANS}


@dataclass(frozen=True)
class PlanOptions:
    """A request's sampler options beside the names: the timestep spacing (None: the model's scheduler config's)
    and `eta`, TCD's gamma (None: 0.3), DDIM's eta (None: 0, deterministic) or Euler a's (None: 1; 0 is Euler)."""

    timestep_spacing: str | None = None
    eta: float | None = None


def make_plan(noise: NoiseSchedule, sampler: str, schedule: str, num_steps: int, start: int = 0,
              options: PlanOptions | None = None) -> SamplerPlan:
    """The coefficient table of `sampler` on `schedule` for `num_steps` steps of `noise`, from step `start` on."""
    check_sampler(sampler, schedule)
    options = options or PlanOptions()
    if options.eta is not None and sampler not in ETA_SAMPLERS:
        raise ParamError("eta", f"eta is the noise amount of samplers {', '.join(ETA_SAMPLERS)} (TCD's gamma, "
                                f"the others' eta); sampler {sampler!r} takes none: leave eta out")
    if options.timestep_spacing is not None:
        noise = dataclasses.replace(noise, timestep_spacing=options.timestep_spacing)
    max_steps = min(MAX_STEPS, noise.num_train_timesteps)
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or not 1 <= num_steps <= max_steps:
        raise ValueError(f"num_steps {num_steps!r} is out of range; use an integer in 1..{max_steps}")
    num_steps, original = int(num_steps), noise
    if schedule in TRAILING_SCHEDULES:
        noise, schedule_for_plan = dataclasses.replace(noise, timestep_spacing="trailing", steps_offset=0), "default"
    else:
        schedule_for_plan = schedule
    if not 0 <= start < num_steps:
        raise ValueError(f"start {start} is outside the plan's {num_steps} steps")
    function = _plan_functions()[sampler]
    parts = function(noise, num_steps, schedule_for_plan, start) if options.eta is None else \
        function(noise, num_steps, schedule_for_plan, start, eta=options.eta)
    coefs, sigmas, rows = parts.coefs, parts.sigmas, parts.coefs.shape[0]
    for i in range(rows - 1):  # the last row blends the un-noised image latents: (1, 0)
        coefs[i, int(Coef.KNOWN)], coefs[i, int(Coef.KNOWN_NOISE)] = _noising(float(sigmas[i + 1]), parts.ve)
    coefs[rows - 1, int(Coef.KNOWN)] = 1.0
    if not np.all(np.isfinite(coefs)):
        raise ValueError(
            f"num_steps {num_steps} gives a degenerate {sampler} schedule with timestep_spacing "
            f"{noise.timestep_spacing!r} (repeated timesteps); use fewer steps"
        )
    noise_steps = np.zeros(rows, bool) if parts.noise_steps is None else np.asarray(parts.noise_steps, bool)
    step_index = np.arange(start, start + rows) if parts.step_index is None else np.asarray(parts.step_index, np.int64)
    if coefs.shape != (rows, NUM_COEFS) or noise_steps.shape != (rows,) or step_index.shape != (rows,) or \
            len(parts.timesteps) != rows or len(sigmas) != rows + 1:
        raise AssertionError(f"{sampler}: inconsistent plan shapes")
    return SamplerPlan(
        sampler=sampler,
        schedule=schedule,
        num_steps=rows,
        coefs=coefs,
        init_noise_sigma=float(parts.init_noise_sigma),
        draws_noise=bool(noise_steps.any()),
        timesteps=np.asarray(parts.timesteps, np.float64),
        sigmas=np.asarray(sigmas, np.float64),
        noise_steps=noise_steps,
        step_index=step_index,
        history=parts.history,
        ve=parts.ve,
        steps=num_steps,
        start=start,
        noise=original,
        eta=options.eta,
        brownian=parts.brownian,
        brownian_range=parts.brownian_range,
    )


def _noising(sigma: float, ve: bool) -> tuple[float, float]:
    """(k, e): a clean latent x0 noised to the state of VE sigma `sigma` is k * x0 + e * noise (the add_noise of
    the sampler's diffusers scheduler: Euler adds sigma * noise; DPM-Solver and DDIM mix with alpha)."""
    if ve:
        return 1.0, sigma
    alpha = 1.0 / float(np.sqrt(sigma * sigma + 1.0))
    return alpha, sigma * alpha


def noising(plan: SamplerPlan) -> tuple[float, float]:
    """(k, e) of the plan's first state: image-to-image rows start at k * image latents + e * noise."""
    return _noising(float(plan.sigmas[0]), plan.ve)


def strength_start(num_steps: int, strength: float) -> int:
    """The step an edit of `strength` starts at (diffusers' get_timesteps); num_steps - start may be 0."""
    init = min(int(num_steps * strength), num_steps)
    return max(num_steps - init, 0)


def start_plan(plan: SamplerPlan, start: int) -> SamplerPlan:
    """The plan from step `start` on, for rows that begin there (image-to-image, inpainting): remade by its sampler,
    as diffusers' scheduler runs when a pipeline enters its timesteps there (a multistep solver's first row there is
    first order). A plan made elsewhere (no `noise`: a family's own planner) is cut at that step's first row, whose
    correction by the previous D (column C: there is none yet) is folded into its D, the first-order step."""
    if start == plan.start:
        return plan
    if plan.noise is not None:
        return make_plan(plan.noise, plan.sampler, plan.schedule, plan.steps, start, PlanOptions(eta=plan.eta))
    rows = np.nonzero(plan.step_index >= start)[0]
    if start < plan.start or len(rows) == 0:
        raise ValueError(f"start {start} is outside the plan's steps {plan.start}..{int(plan.step_index[-1])}")
    row = int(rows[0])
    coefs = plan.coefs[row:].copy()
    coefs[0, Coef.B] += coefs[0, Coef.C]
    coefs[0, Coef.C] = 0.0
    return dataclasses.replace(plan, num_steps=plan.num_steps - row, coefs=coefs,
                               timesteps=plan.timesteps[row:], sigmas=plan.sigmas[row:],
                               noise_steps=plan.noise_steps[row:], step_index=plan.step_index[row:], start=start,
                               brownian=None if plan.brownian is None else plan.brownian[row:])


def check_sampler(sampler: str, schedule: str) -> None:
    """ParamError (naming `sampler` or `schedule`) unless (sampler, schedule) is a pair we implement."""
    if sampler not in SAMPLERS:
        raise ParamError("sampler", f"sampler {sampler!r} is not supported; use one of {', '.join(SAMPLERS)}")
    if schedule not in SCHEDULES + SCHEDULE_VARIANTS:
        raise ParamError("schedule", f"schedule {schedule!r} is not supported; use one of {', '.join(SCHEDULES)}")
    allowed = schedules_of(sampler)
    if schedule not in allowed and not (schedule in SCHEDULE_VARIANTS and "align_your_steps" in allowed):
        raise ParamError("schedule", f"sampler {sampler!r} takes the schedules {', '.join(allowed)}, not "
                                     f"{schedule!r}; pick one of those")


def schedules_of(sampler: str) -> tuple[str, ...]:
    """The schedules `sampler` runs on (its diffusers counterpart's options)."""
    from .names import SAMPLER_SCHEDULES
    return SAMPLER_SCHEDULES.get(sampler, SCHEDULES)


def _euler_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    return cut(_euler_like(noise, n, schedule, ancestral=False), start)


def _euler_a_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    eta = 1.0 if eta is None else float(eta)
    if not 0.0 <= eta <= 1.0:
        raise ParamError("eta", f"Euler a's eta must be in [0, 1] (1: its usual noise, 0: Euler), got {eta:g}")
    return cut(_euler_like(noise, n, schedule, ancestral=True, eta=eta), start)


def _euler_like(noise: NoiseSchedule, n: int, schedule: str, ancestral: bool, eta: float = 1.0) -> PlanParts:
    """Euler (Karras et al. 2022, Alg. 2 without churn) / Euler ancestral with k-diffusion's `get_ancestral_step`
    (eta scales the fresh noise; 0 is Euler), on VE latents."""
    t, sig = euler_sigmas(noise, n, schedule)
    sigma, sigma_next = sig[:-1], sig[1:]
    alpha = 1 / np.sqrt(sigma**2 + 1)
    p, q = denoiser(noise.prediction_type, alpha, sigma * alpha, ve=True)
    if ancestral:
        if eta == 1.0:  # the closed forms (bit for bit as before): sigma_down = sqrt(sigma_next^2 - sigma_up^2)
            sigma_down = sigma_next**2 / sigma
            sigma_up = sigma_next * np.sqrt(1 - (sigma_next / sigma) ** 2)
        else:
            sigma_up = np.minimum(sigma_next, eta * sigma_next * np.sqrt(1 - (sigma_next / sigma) ** 2))
            sigma_down = np.sqrt(sigma_next**2 - sigma_up**2)
        a = sigma_down / sigma
        coefs = table(t, alpha, p, q, a, 1 - a, d=sigma_up)
    else:
        a = sigma_next / sigma
        coefs = table(t, alpha, p, q, a, 1 - a)
    return PlanParts(t, sig, coefs, euler_init_sigma(noise, sig), ve=True,
                     noise_steps=np.full(n, True) if ancestral else None)


def _dpmpp_2m_plan(noise: NoiseSchedule, n: int, schedule: str, start: int) -> PlanParts:
    """DPM-Solver++(2M), Lu et al. 2022; first order at the first and last step (diffusers' defaults), and at the
    first step of a walk that begins later."""
    t, sig = dpm_sigmas(noise, n, schedule, "dpmpp_2m")
    sigma, sigma_next = sig[:-1], sig[1:]
    alpha = 1 / np.sqrt(sigma**2 + 1)
    alpha_next = 1 / np.sqrt(sigma_next**2 + 1)
    p, q = denoiser(noise.prediction_type, alpha, sigma * alpha, ve=False)
    # First order (DPM-Solver++ 1 == DDIM): with lambda = -log(sigma), exp(-h) = sigma_next / sigma.
    a = (sigma_next * alpha_next) / (sigma * alpha)
    b1 = alpha_next * (1 - sigma_next / sigma)
    b, c = b1.copy(), np.zeros(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(1, n - 1):  # second order between the first and the last step
            r0 = np.log(sig[i - 1] / sig[i]) / np.log(sig[i] / sig[i + 1])  # h_prev / h
            b[i] = b1[i] * (1 + 0.5 / r0)
            c[i] = -b1[i] * 0.5 / r0
    b[start], c[start] = b1[start], 0.0
    return cut(PlanParts(t, sig, table(t, np.ones(n), p, q, a, b, c), 1.0, ve=False), start)


def _ddim_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    """DDIM, Song et al. 2021, on VP latents: eta 0 (the default) is deterministic; eta > 0 adds, as DDIMScheduler's
    step does, eta * sqrt((1 - abar_prev) / (1 - abar) * (1 - abar / abar_prev)) of fresh noise at every step (one
    draw a step, the last included, where it is zero) and takes that variance out of the direction to x_t."""
    return cut(_ddim_parts(noise, n, schedule, eta, cfgpp=False), start)


def _ddim_cfgpp_plan(noise: NoiseSchedule, n: int, schedule: str, start: int, eta: float | None = None) -> PlanParts:
    """DDIM CFG++ (Chung et al. 2024; AUTOMATIC1111's ddim_cfgpp): DDIM's walk (timesteps, eta) whose direction to
    x_t is the unconditional branch's noise eps_u, not the guided one: x_prev = alpha_prev * D + sqrt(1 - abar_prev -
    std^2) * eps_u + std * noise, D the guided x0. With eps_u = (x - alpha * D_u) / sigma_vp and D_u = p * x + q *
    unguided (any prediction type), its x term joins column A and its unguided term is column U. The guided output's
    weight (guidance_scale / 12.5) and the second branch at every guided step are the guidance feature's."""
    return cut(_ddim_parts(noise, n, schedule, eta, cfgpp=True), start)


def _ddim_parts(noise: NoiseSchedule, n: int, schedule: str, eta: float | None, cfgpp: bool) -> PlanParts:
    """The rows of DDIM (`cfgpp`: of DDIM CFG++) from the first step on."""
    eta = 0.0 if eta is None else float(eta)
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"ddim's eta must be in [0, 1], got {eta}; pass a value in that range")
    n_train = noise.num_train_timesteps
    if schedule == "karras":
        # oracle.KarrasDDIMScheduler: DPM-Solver's Karras timesteps, each step going to the next of them.
        t, _ = dpm_sigmas(noise, n, "karras", "ddim")
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
    p, q = denoiser(noise.prediction_type, alpha, sigma_vp, ve=False)
    # x_prev = alpha_prev * D + sqrt(1 - abar_prev - std^2) * eps + std * noise, with eps = (x - alpha * D) / sigma
    with np.errstate(divide="ignore", invalid="ignore"):  # a repeated timestep: refused by make_plan's finite check
        std = eta * np.sqrt((1 - ac_prev) / (1 - ac_t) * (1 - ac_t / ac_prev))
    a = np.sqrt(np.maximum(1 - ac_prev - std ** 2, 0.0)) / sigma_vp
    if cfgpp:  # a * sigma_vp * eps_u = a * (1 - alpha * p) * x - a * alpha * q * unguided
        coefs = table(t, np.ones(n), p, q, a * (1 - alpha * p), alpha_prev, d=std)
        coefs[:, int(Coef.U)] = -a * alpha * q
    else:
        coefs = table(t, np.ones(n), p, q, a, alpha_prev - a * alpha, d=std)
    with np.errstate(divide="ignore"):  # zero terminal SNR: alpha 0 at the top timestep is an infinite VE sigma
        sig = np.append(sigma_vp / alpha, sigma_vp_prev[-1] / alpha_prev[-1])
    return PlanParts(t, sig, coefs, 1.0, ve=False, noise_steps=np.ones(n, bool) if eta > 0 else None)
