"""The samplers and schedules diffusers has no counterpart for (sampling/kdiffusion.py, sampling/sigma_tables.py)
against references written here: k-diffusion's and AUTOMATIC1111's loops, step by step, on the toy denoiser of
test_sampling.py, in float64 (the plan through the same batch-form update, `run_plan`), and their schedules' sigma
formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_sampling import CONFIGS, SHAPE, _one_thread, fake_model, run_plan  # noqa: F401 (_one_thread: autouse)

from diffgraph.errors import ParamError
from diffgraph.sampling import NoiseSchedule, make_plan
from diffgraph.sampling.samplers import PlanOptions, start_plan
from diffgraph.sampling.schedules import euler_sigmas, sigma_to_t, to_f32

F64 = torch.float64


class _Walk:
    """The reference side: the same initial latents and noise draws as `run_plan`, an epsilon model on VE latents."""

    def __init__(self, noise: NoiseSchedule, sigma0: float, seed: int = 0):
        self.train, self.v = noise.train_sigmas(), noise.prediction_type == "v_prediction"
        self.x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * sigma0).to(F64)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def denoise(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        t = float(to_f32(sigma_to_t(np.array([sigma]), self.train))[0])
        out = fake_model(x / math.sqrt(sigma**2 + 1), t)
        if self.v:  # v = alpha eps - sigma_vp x0 on the VP latents x / sqrt(sigma^2 + 1)
            return x / (sigma**2 + 1) - sigma / math.sqrt(sigma**2 + 1) * out
        return x - sigma * out

    def noise(self) -> torch.Tensor:
        return torch.randn(SHAPE, generator=self.gen, dtype=F64)


def _ancestral(sigma, sigma_next, eta):
    if not eta:
        return sigma_next, 0.0
    up = min(sigma_next, eta * (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5)
    return (sigma_next**2 - up**2) ** 0.5, up


def k_dpmpp_2s_a(w: _Walk, sigmas, eta):
    x = w.x
    for i in range(len(sigmas) - 1):
        denoised = w.denoise(x, sigmas[i])
        down, up = _ancestral(sigmas[i], sigmas[i + 1], eta)
        if down == 0:
            x = x + (x - denoised) / sigmas[i] * (down - sigmas[i])
        else:
            t, t_next = -math.log(sigmas[i]), -math.log(down)
            h = t_next - t
            s = t + h / 2
            x_2 = (math.exp(-s) / math.exp(-t)) * x - math.expm1(-h / 2) * denoised
            denoised_2 = w.denoise(x_2, math.exp(-s))
            x = (math.exp(-t_next) / math.exp(-t)) * x - math.expm1(-h) * denoised_2
        if sigmas[i + 1] > 0 and up:
            x = x + w.noise() * up
    return x


def k_dpmpp_2m_sde_heun(w: _Walk, sigmas):
    x, old, h_last = w.x, None, None
    for i in range(len(sigmas) - 1):
        denoised = w.denoise(x, sigmas[i])
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = -math.log(sigmas[i + 1]) + math.log(sigmas[i])
            x = sigmas[i + 1] / sigmas[i] * math.exp(-h) * x - math.expm1(-2 * h) * denoised
            if old is not None:
                r = h_last / h
                x = x + (-math.expm1(-2 * h) / (-2 * h) + 1) * (1 / r) * (denoised - old)
            x = x + w.noise() * sigmas[i + 1] * (-math.expm1(-2 * h)) ** 0.5
        old, h_last = denoised, h if sigmas[i + 1] else h_last
    return x


def _karras(n, sigma_min, sigma_max, rho=7.0):
    ramp = np.linspace(0, 1, n)
    return np.append((sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho, 0.0)


def a1111_restart(w: _Walk, sigmas):
    """AUTOMATIC1111's restart_sampler: its restart list from the step count, Heun steps, noise up to each restart."""
    sigmas = np.asarray(sigmas)
    steps = len(sigmas) - 1
    restart_list = {}
    if steps >= 20:
        restart_steps, restart_times = (steps // 4, 2) if steps >= 36 else (9, 1)
        sigmas = _karras(steps - restart_steps * restart_times, sigmas[-2], sigmas[0])
        restart_list = {0.1: [restart_steps + 1, restart_times, 2]}
    restart_list = {int(np.argmin(abs(sigmas - key))): value for key, value in restart_list.items()}
    step_list = []
    for i in range(len(sigmas) - 1):
        step_list.append((sigmas[i], sigmas[i + 1]))
        if i + 1 in restart_list:
            restart_steps, restart_times, restart_max = restart_list[i + 1]
            min_idx, max_idx = i + 1, int(np.argmin(abs(sigmas - restart_max)))
            if max_idx < min_idx:
                sigma_restart = _karras(restart_steps, sigmas[min_idx], sigmas[max_idx])[:-1]
                step_list.extend(list(zip(sigma_restart[:-1], sigma_restart[1:])) * restart_times)
    x, last = w.x, None
    for old, new in step_list:
        if last is not None and last < old:
            x = x + w.noise() * (old**2 - last**2) ** 0.5
        denoised = w.denoise(x, old)
        d = (x - denoised) / old
        if new == 0:
            x = x + d * (new - old)
        else:
            x_2 = x + d * (new - old)
            d_2 = (x_2 - w.denoise(x_2, new)) / new
            x = x + (d + d_2) / 2 * (new - old)
        last = new
    return x, len(step_list)


def k_dpm_fast(w: _Walk, sigma_min, sigma_max, n, eta):
    """k-diffusion's DPMSolver.dpm_solver_fast, its eps and sigma(t) = exp(-t) written out."""
    def eps(x, t):
        return (x - w.denoise(x, math.exp(-t))) / math.exp(-t)

    def step(x, t, t_next, order):
        h = t_next - t
        e0 = eps(x, t)
        sig = math.exp(-t_next)
        if order == 1:
            return x - sig * math.expm1(h) * e0
        if order == 2:
            r1 = 0.5
            s1 = t + r1 * h
            e1 = eps(x - math.exp(-s1) * math.expm1(r1 * h) * e0, s1)
            return x - sig * math.expm1(h) * e0 - sig / (2 * r1) * math.expm1(h) * (e1 - e0)
        r1, r2 = 1 / 3, 2 / 3
        s1, s2 = t + r1 * h, t + r2 * h
        e1 = eps(x - math.exp(-s1) * math.expm1(r1 * h) * e0, s1)
        u2 = x - math.exp(-s2) * math.expm1(r2 * h) * e0 - math.exp(-s2) * (r2 / r1) * (
            math.expm1(r2 * h) / (r2 * h) - 1) * (e1 - e0)
        e2 = eps(u2, s2)
        return x - sig * math.expm1(h) * e0 - sig / r2 * (math.expm1(h) / h - 1) * (e2 - e0)

    t_start, t_end = -math.log(sigma_max), -math.log(sigma_min)
    m = n // 3 + 1
    ts = np.linspace(t_start, t_end, m + 1)
    orders = [3] * (m - 2) + [2, 1] if n % 3 == 0 else [3] * (m - 1) + [n % 3]
    x = w.x
    for i, order in enumerate(orders):
        t, t_next = ts[i], ts[i + 1]
        if eta:
            sd, su = _ancestral(math.exp(-t), math.exp(-t_next), eta)
            t_next_ = min(t_end, -math.log(sd))
            su = (math.exp(-2 * t_next) - math.exp(-2 * t_next_)) ** 0.5
        else:
            t_next_, su = t_next, 0.0
        x = step(x, t, t_next_, order)
        if su:
            x = x + su * w.noise()
    return x


def _close(ours, ref, what):
    ours = ours[0][-1]
    scale = max(ref.abs().max().item(), 1.0)
    assert (ours - ref).abs().max().item() <= 1e-10 * scale, what


SD15 = NoiseSchedule.from_config(CONFIGS["sd15"])


@pytest.mark.parametrize("schedule", ["default", "karras", "align_your_steps"])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_dpmpp_2s_a_is_k_diffusions(schedule, n):
    for eta in (None, 0.0, 0.5):
        plan = make_plan(SD15, "dpmpp_2s_a", schedule, n, options=PlanOptions(eta=eta))
        sigmas = euler_sigmas(SD15, n, schedule)[1].tolist()
        assert plan.init_noise_sigma == sigmas[0] and plan.num_steps == 2 * n - 1
        ref = k_dpmpp_2s_a(_Walk(SD15, sigmas[0]), sigmas, 1.0 if eta is None else eta)
        _close(run_plan(plan, dtype=F64), ref, f"dpmpp_2s_a {schedule} n={n} eta={eta}")
        assert plan.draws_noise == (n > 1 and eta != 0.0)


@pytest.mark.parametrize("schedule", ["exponential", "kl_optimal"])
def test_dpmpp_2m_sde_heun_is_k_diffusions(schedule):
    for n in (1, 2, 9):
        plan = make_plan(SD15, "dpmpp_2m_sde_heun", schedule, n)
        sigmas = euler_sigmas(SD15, n, schedule)[1].tolist()
        ref = k_dpmpp_2m_sde_heun(_Walk(SD15, sigmas[0]), sigmas)
        _close(run_plan(plan, dtype=F64), ref, f"dpmpp_2m_sde_heun {schedule} n={n}")
    midpoint = make_plan(SD15, "dpmpp_2m_sde", schedule, 9)
    assert not np.allclose(midpoint.coefs, plan.coefs)


@pytest.mark.parametrize("n,rows", [(4, 7), (20, 39), (40, 79)])
def test_restart_is_automatic1111s(n, rows):
    """Below 20 steps Restart is Heun on the schedule; from 20 on its Karras redraw and restart segments (one from
    20, two from 36) with the noise that lifts x back up, planned from the step count."""
    plan = make_plan(SD15, "restart", "karras", n)
    sigmas = euler_sigmas(SD15, n, "karras")[1].tolist()
    ref, steps = a1111_restart(_Walk(SD15, sigmas[0]), sigmas)
    assert (plan.num_steps, steps, int(plan.step_index[-1])) == (rows, n, n - 1)
    assert plan.draws_noise == (n >= 20) and int(plan.noise_steps.sum()) == (0 if n < 20 else 1 if n < 36 else 2)
    _close(run_plan(plan, dtype=F64), ref, f"restart n={n}")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 10])
def test_dpm_fast_is_k_diffusions(n):
    """Its own sigmas, the training range's (schedule default only), n evaluations; eta 1 by default as
    AUTOMATIC1111 runs it, 0 deterministic."""
    train = SD15.train_sigmas()
    for eta in (None, 0.0):
        plan = make_plan(SD15, "dpm_fast", "default", n, options=PlanOptions(eta=eta))
        assert plan.num_steps == n and plan.sigmas[0] == train[-1] and plan.sigmas[-1] == pytest.approx(train[0])
        ref = k_dpm_fast(_Walk(SD15, float(train[-1])), float(train[0]), float(train[-1]), n, 1.0 if eta is None else eta)
        _close(run_plan(plan, dtype=F64), ref, f"dpm_fast n={n} eta={eta}")
    with pytest.raises(ParamError, match="takes the schedules default"):
        make_plan(SD15, "dpm_fast", "karras", n)


def test_a_v_prediction_model_walks_as_k_diffusion_with_its_v_denoiser():
    sdxl = NoiseSchedule.from_config(CONFIGS["sdxl"] | {"prediction_type": "v_prediction"})
    sigmas = euler_sigmas(sdxl, 7, "karras")[1].tolist()
    _close(run_plan(make_plan(sdxl, "dpmpp_2s_a", "karras", 7), dtype=F64),
           k_dpmpp_2s_a(_Walk(sdxl, sigmas[0]), sigmas, 1.0), "dpmpp_2s_a v")
    _close(run_plan(make_plan(sdxl, "restart", "karras", 7), dtype=F64), a1111_restart(_Walk(sdxl, sigmas[0]), sigmas)[0],
           "restart v")


def test_a_later_start_begins_the_sampler_afresh_there():
    """Image-to-image from step 3 of 10: the walk from that step's sigma, as AUTOMATIC1111's img2img runs them."""
    for sampler in ("dpmpp_2s_a", "dpmpp_2m_sde_heun", "restart"):
        later = start_plan(make_plan(SD15, sampler, "karras", 10), 3)
        sigmas = euler_sigmas(SD15, 10, "karras")[1].tolist()[3:]
        w = _Walk(SD15, sigmas[0])
        ref = {"dpmpp_2s_a": lambda: k_dpmpp_2s_a(w, sigmas, 1.0), "dpmpp_2m_sde_heun": lambda: k_dpmpp_2m_sde_heun(
            w, sigmas), "restart": lambda: a1111_restart(w, sigmas)[0]}[sampler]()
        assert later.step_index[0] == 3 and later.step_index[-1] == 9 and later.sigmas[0] == sigmas[0]
        _close(run_plan(later, dtype=F64), ref, f"{sampler} from step 3")
    fast = start_plan(make_plan(SD15, "dpm_fast", "default", 10), 3)
    train, top = SD15.train_sigmas(), float(euler_sigmas(SD15, 10, "default")[1][3])
    ref = k_dpm_fast(_Walk(SD15, top), float(train[0]), top, 7, 1.0)
    assert fast.num_steps == 7 and fast.step_index[0] == 3
    _close(run_plan(fast, dtype=F64), ref, "dpm_fast from step 3")


def test_eta_is_refused_outside_its_range_and_where_fixed():
    with pytest.raises(ParamError, match=r"DPM\+\+ 2S a's eta must be in \[0, 1\]"):
        make_plan(SD15, "dpmpp_2s_a", "karras", 5, options=PlanOptions(eta=1.5))
    with pytest.raises(ParamError, match="sampler 'restart' takes none"):
        make_plan(SD15, "restart", "karras", 5, options=PlanOptions(eta=0.5))


# ---- schedules: AUTOMATIC1111's, Forge's and ComfyUI's formulas, written out ------------------------------------

def _uniform(train, n):  # k-diffusion's DiscreteSchedule.get_sigmas / t_to_sigma
    log_sigmas = np.log(train)
    t = np.linspace(len(train) - 1, 0, n)
    low, high, w = np.floor(t).astype(int), np.ceil(t).astype(int), t - np.floor(t)
    return np.exp((1 - w) * log_sigmas[low] + w * log_sigmas[high])


def _polyexponential(train, n, rho=1.0):
    ramp = np.linspace(1, 0, n) ** rho
    return np.exp(ramp * (math.log(train[-1]) - math.log(train[0])) + math.log(train[0]))


def _kl_optimal(train, n):  # ComfyUI's kl_optimal_scheduler
    idx = np.arange(n) / (n - 1)
    return np.tan(idx * math.atan(train[0]) + (1 - idx) * math.atan(train[-1]))


def _ays(sigmas, n):  # AUTOMATIC1111's get_align_your_steps_sigmas
    if n == len(sigmas):
        return np.array(sigmas)
    xs, ys = np.linspace(0, 1, len(sigmas)), np.log(sigmas[::-1])
    return np.exp(np.interp(np.linspace(0, 1, n), xs, ys))[::-1]


def _turbo(train, n):  # Forge's turbo_scheduler
    timesteps = np.flip(np.arange(1, n + 1) * (1000.0 / n) - 1).round().astype(int).clip(0, 999)
    return train[timesteps]


def _ddim(train, n):  # AUTOMATIC1111's ddim_scheduler (its first n: see sigma_tables.py)
    sigs, ss, x = [], max(len(train) // n, 1), 1
    while x < len(train):
        sigs.append(train[x])
        x += ss
    return np.array(sigs[::-1][:n])


AYS_SD15 = [14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.029]
AYS_SDXL = [14.615, 6.315, 3.771, 2.181, 1.342, 0.862, 0.555, 0.380, 0.234, 0.113, 0.029]
REFERENCES = {"uniform": _uniform, "polyexponential": _polyexponential, "kl_optimal": _kl_optimal,
              "align_your_steps": lambda train, n: _ays(AYS_SD15, n),
              "align_your_steps_sdxl": lambda train, n: _ays(AYS_SDXL, n), "turbo": _turbo, "ddim_uniform": _ddim}


@pytest.mark.parametrize("schedule", list(REFERENCES))
def test_table_schedules_are_their_references(schedule):
    train = SD15.train_sigmas()
    for n in (2, 4, 10, 11, 20, 30):
        ref = np.append(REFERENCES[schedule](train, n), 0.0)
        for sampler in ("euler", "heun", "dpmpp_2m"):
            plan = make_plan(SD15, sampler, schedule, n)
            got = plan.sigmas if sampler != "heun" else plan.sigmas[[0, *range(1, 2 * n - 1, 2), -1]]
            np.testing.assert_allclose(got, to_f32(ref), rtol=1e-6, atol=0, err_msg=f"{sampler}/{schedule} n={n}")


def test_ddim_uniform_walks_the_highest_n_where_automatic1111_lays_more():
    train = SD15.train_sigmas()
    plan = make_plan(SD15, "euler", "ddim_uniform", 30)
    assert plan.num_steps == 30 and plan.sigmas[0] == pytest.approx(train[991], rel=1e-7)
    assert plan.sigmas[-2] == pytest.approx(train[34], rel=1e-7)  # 991, 958, ..., 34 (AUTOMATIC1111: down to 1)


def test_the_sdxl_family_walks_align_your_steps_on_the_sdxl_list():
    from diffgraph.models.families import SDFamily, SDXLFamily

    assert SDXLFamily.schedule_variants == {"align_your_steps": "align_your_steps_sdxl"}
    assert SDFamily.schedule_variants == {} and "align_your_steps_sdxl" not in SDXLFamily.schedules
    sdxl = make_plan(SD15, "euler", "align_your_steps_sdxl", 11)
    np.testing.assert_allclose(sdxl.sigmas[:-1], to_f32(np.array(AYS_SDXL)), rtol=1e-7)


# ---- DDIM CFG++: AUTOMATIC1111's ddim_cfgpp ------------------------------------------------------------------------

def fake_uncond(x: torch.Tensor, t: float) -> torch.Tensor:
    """The toy's unconditional branch: an output of the same kind as fake_model's that differs from it."""
    k = torch.linspace(2.0, 0.5, x[0].numel()).reshape(x.shape[1:])
    return 0.8 * x + 0.25 * torch.cos(x * k - float(t) / 70)


def a1111_ddim_cfgpp(config: dict, n: int, scale: float, eta: float, seed: int = 0) -> torch.Tensor:
    """AUTOMATIC1111's ddim_cfgpp loop in float64 over DDIMScheduler's timesteps and alpha-bars (each step to
    t - 1000 // n, the last to final_alpha_cumprod): e_t the guided noise at scale / 12.5, pred_x0 from it, the
    direction to x_t along the unconditional branch's noise, sigma_t of fresh noise. A v-prediction model's outputs
    become noise predictions first (eps = sqrt(a_t) v + sqrt(1 - a_t) x), as AUTOMATIC1111's v denoiser makes them."""
    from diffgraph.sampling.oracle import diffusers_scheduler

    sched = diffusers_scheduler(config, "ddim", "default")
    sched.set_timesteps(n)
    ac = sched.alphas_cumprod.double()
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(F64)
    gen = torch.Generator().manual_seed(seed + 1)
    v = config.get("prediction_type") == "v_prediction"
    for t in sched.timesteps.tolist():
        prev = t - sched.config.num_train_timesteps // n
        a_t = ac[t].item()
        a_prev = ac[prev].item() if prev >= 0 else float(sched.final_alpha_cumprod)

        def eps(out: torch.Tensor, x=x, a_t=a_t) -> torch.Tensor:
            return math.sqrt(a_t) * out + math.sqrt(1 - a_t) * x if v else out
        e_c, e_u = eps(fake_model(x, t)), eps(fake_uncond(x, t))
        e_t = e_u + scale / 12.5 * (e_c - e_u)
        sigma_t = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
        pred_x0 = (x - math.sqrt(1 - a_t) * e_t) / math.sqrt(a_t)
        x = math.sqrt(a_prev) * pred_x0 + math.sqrt(1 - a_prev - sigma_t**2) * e_u
        if eta:
            x = x + sigma_t * torch.randn(SHAPE, generator=gen, dtype=F64)
    return x


def run_cfgpp(plan, weights: np.ndarray, one_branch: bool = False, seed: int = 0) -> torch.Tensor:
    """The plan through the step's update in float64: per row the guided output at `weights[i]` (the guidance
    feature's column) and the unguided one, or (`one_branch`) the text branch as both, as a row with one branch
    reads it; the same draws as the reference."""
    from diffgraph.sampling import NUM_COEFS, Coef, apply_step

    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * plan.init_noise_sigma).to(F64)
    gen, d_prev = torch.Generator().manual_seed(seed + 1), torch.zeros(SHAPE, dtype=F64)
    coefs = torch.from_numpy(plan.coefs)
    for i in range(plan.num_steps):
        row = coefs[i : i + 1].expand(SHAPE[0], NUM_COEFS)
        x_in = row[:, Coef.C_IN].reshape(-1, 1, 1, 1) * x
        cond = fake_model(x_in, plan.timesteps[i])
        uncond = cond if one_branch else fake_uncond(x_in, plan.timesteps[i])
        guided = uncond + float(weights[i]) * (cond - uncond)
        noise = torch.randn(SHAPE, generator=gen, dtype=F64) if plan.noise_steps[i] else None
        x, d_prev = apply_step(row, x, guided, d_prev, noise, uncond)
    return x


@pytest.mark.parametrize("config", ["sd15", "trailing", "sdxl_v"])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_ddim_cfgpp_is_automatic1111s(config, n):
    """The plan, the guidance feature's columns (weight scale / 12.5, both branches at every step, at any scale) and
    the update against AUTOMATIC1111's loop, eta 0 and eta 0.6 with the same draws, epsilon and v-prediction."""
    from diffgraph.features.guidance import ClassifierFreeGuidance
    from diffgraph.request import GenerationRequest

    cfg = CONFIGS["sdxl"] | {"prediction_type": "v_prediction"} if config == "sdxl_v" else CONFIGS[config]
    noise = NoiseSchedule.from_config(cfg)
    for scale in (0.0, 1.0, 7.5):
        request = GenerationRequest.create("x", width=64, height=64, guidance_scale=scale, sampler="DDIM CFG++",
                                           num_inference_steps=n)
        assert request.sampler == "ddim_cfgpp"
        for eta in (None, 0.6):
            plan = make_plan(noise, "ddim_cfgpp", "default", n, options=PlanOptions(eta=eta))
            feature = ClassifierFreeGuidance({})
            weights = feature.plan_columns(request, plan.step_index)["guidance"]
            assert np.allclose(weights, scale / 12.5) and feature.branches(request, plan.step_index).tolist() == [2] * n
            ref = a1111_ddim_cfgpp(cfg, n, scale, eta or 0.0)
            scale_ref = max(ref.abs().max().item(), 1.0)
            got = run_cfgpp(plan, weights)
            assert (got - ref).abs().max().item() <= 1e-10 * scale_ref, f"{config} n={n} scale={scale} eta={eta}"
            assert plan.draws_noise == bool(eta)
    # the unguided branch reaches the update: plain DDIM with the same guided output differs
    ddim = make_plan(noise, "ddim", "default", n)
    if n > 1:
        assert (run_cfgpp(ddim, weights) - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("schedule", ["default", "karras", "sgm_uniform", "simple"])
@pytest.mark.parametrize("pred", ["epsilon", "v_prediction"])
def test_a_ddim_cfgpp_row_with_one_branch_is_plain_ddim(schedule, pred):
    """Where a row runs one branch the step hands the text branch as the unguided output too: the update is DDIM's
    (every schedule DDIM takes, eta 0 and 0.6); a later start (image-to-image) walks DDIM's rows from there."""
    noise = NoiseSchedule.from_config(CONFIGS["sd15"] | {"prediction_type": pred})
    for eta in (None, 0.6):
        for n, start in ((1, 0), (7, 0), (7, 3)):
            plans = [make_plan(noise, s, schedule, n, options=PlanOptions(eta=eta)) for s in ("ddim", "ddim_cfgpp")]
            plans = [start_plan(p, start) for p in plans]
            ddim, cfgpp = (run_cfgpp(p, np.ones(p.num_steps), one_branch=True) for p in plans)
            assert (cfgpp - ddim).abs().max().item() <= 1e-10 * max(ddim.abs().max().item(), 1.0), (eta, n, start)
            assert np.array_equal(plans[0].timesteps, plans[1].timesteps) and plans[1].step_index[0] == start
