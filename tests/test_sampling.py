"""Sampler plans against diffusers' schedulers: every intermediate latent, every timestep."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from diffgraph.sampling import NUM_COEFS, SAMPLERS, SCHEDULES, Coef, NoiseSchedule, apply_step, make_plan
from diffgraph.sampling.names import KDIFFUSION_SAMPLERS, TABLE_SCHEDULES
from diffgraph.sampling.oracle import diffusers_scheduler, step_kwargs
from diffgraph.sampling.samplers import schedules_of
from diffgraph.sampling.sde import BrownianNoise
from diffgraph.sampling.table import HISTORY_SLOTS, apply_history

SD15 = {  # runwayml/stable-diffusion-v1-5 scheduler_config.json, as the PNDM scheduler exposes it
    "_class_name": "PNDMScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "trained_betas": None,
    "timestep_spacing": "leading",
    "prediction_type": "epsilon",
}
SDXL = {  # stable-diffusion-xl-base-1.0 scheduler_config.json
    "_class_name": "EulerDiscreteScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "trained_betas": None,
    "timestep_spacing": "leading",
    "prediction_type": "epsilon",
}
CONFIGS = {
    "sd15": SD15,
    "sdxl": SDXL,
    "trailing": SD15 | {"timestep_spacing": "trailing", "steps_offset": 0},
    "linspace": {"beta_schedule": "linear", "timestep_spacing": "linspace"},  # diffusers' defaults otherwise
    # zero terminal SNR (Lin et al. 2023): rescaled betas, trailing spacing, as v-prediction fine-tunes ship it
    "zero_snr": SD15 | {"timestep_spacing": "trailing", "steps_offset": 0, "rescale_betas_zero_snr": True},
}
STEPS = (1, 2, 4, 7, 20, 31)
SHAPE = (2, 4, 8, 8)
TOL = 1e-5
# allowed float32 rounding, in units of the largest latent's last place, where that exceeds TOL. 8, not 4: with
# torch 2.13 on this CPU, ddim/karras/linspace at one step differs by 5.7e-5 at a largest value of ~82 (6 ulps; also
# at ff9cc93, before any change of ours): diffusers divides by sqrt(alpha) in a different order than our coefficients
ULPS = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This module's tensors are 512 numbers: torch's intra-op threads gain nothing on them, and with two threads
    each fake_model's torch.sin paid a parallel region (measured on the 2-core CI box beside a busy core: 20 cases
    took 14.5 s with two threads, 0.8 s with one; nearly all of it in sin). Both paths compared run under it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fake_model(x: torch.Tensor, t: float) -> torch.Tensor:
    k = torch.linspace(0.5, 2.0, x[0].numel()).reshape(x.shape[1:])
    # Noise-predictor-like (out ~ the unit-variance input), so x0 and the final latents stay O(1) as with a
    # real UNet; plus a nonlinear term so that every step depends on the exact x and t it is fed.
    return 0.9 * x + 0.3 * torch.sin(x * k + float(t) / 100)


def assert_same_latents(ours, ref, what, ulps=ULPS):
    """Max abs difference <= TOL, or ULPS float32 ulps of the largest value stepped so far where larger.

    diffusers itself steps in float32: with linear betas (sigma_max ~157) the initial Euler latents reach
    ~600, and the VP samplers' x0 prediction x / alpha as much, where one ulp is 6e-5; a flat 1e-5 would
    test diffusers' rounding, not our coefficients.
    """
    ours, denoised = ours
    assert len(ours) == len(ref)
    largest = 0.0
    for i, (a, b) in enumerate(zip(ours, ref)):
        largest = max(largest, b.abs().max().item(), denoised[i - 1].abs().max().item() if i else 0.0)
        err = (a - b).abs().max().item()
        tol = max(TOL, ulps * torch.finfo(torch.float32).eps * largest)
        assert err <= tol, f"{what}: latent {i} differs by {err:.2e} > {tol:.2e}"


@functools.lru_cache(maxsize=8)
def _built(config_items, sampler, schedule):
    # diffusers' k-diffusion schedulers lay all 1000 timesteps in __init__ (KDPM2: ~0.4 s): build once per case
    return diffusers_scheduler(dict(config_items), sampler, schedule)


def run_diffusers(config, sampler, schedule, n, seed=0, dtype=torch.float32):
    sched = copy.deepcopy(_built(tuple(sorted(config.items())), sampler, schedule))
    sched.set_timesteps(n)
    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * sched.init_noise_sigma).to(dtype)
    kwargs = step_kwargs(sched, torch.Generator().manual_seed(seed + 1))
    if hasattr(sched, "noise_sampler_seed"):  # DPMSolverSDEScheduler's Brownian tree: seeded as ours is
        sched.noise_sampler_seed = seed + 1
    xs = [x]
    for t in sched.timesteps:
        out = fake_model(sched.scale_model_input(x, t), t)
        x = sched.step(out, t, x, **kwargs).prev_sample
        xs.append(x)
    return sched, xs


def run_plan(plan, seed=0, dtype=torch.float32):
    """Our batch-form update (sampling/table.py); the same draws as diffusers' (initial latents, then one at each
    row that draws)."""
    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * plan.init_noise_sigma).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    tree = None if plan.brownian is None else BrownianNoise(plan.brownian, plan.brownian_range, seed + 1, SHAPE)
    d_prev = torch.zeros(SHAPE, dtype=dtype)
    history = [torch.zeros(SHAPE, dtype=dtype) for _ in range(HISTORY_SLOTS)]
    coefs = torch.from_numpy(plan.coefs).to(dtype)
    xs, ds = [x], []
    for i in range(plan.num_steps):
        row = coefs[i : i + 1].expand(SHAPE[0], NUM_COEFS)
        out = fake_model(row[:, Coef.C_IN].reshape(-1, 1, 1, 1) * x, plan.timesteps[i])
        # (in float64 the draws are float64, as diffusers' randn_tensor makes them for float64 latents)
        noise = None if not plan.noise_steps[i] else (torch.randn(SHAPE, generator=gen, dtype=dtype) if tree is None
                                                      else tree.draw(i).to(dtype))
        x_next, denoised = apply_step(row, x, out, d_prev, noise)
        extra, history = apply_history(row, x, denoised, d_prev, history)
        x, d_prev = x_next + extra, denoised
        xs.append(x)
        ds.append(d_prev)
    return xs, ds


def _cases():
    """The pairs diffusers runs (tests/test_sampling_a1111.py checks the others against k-diffusion's loops)."""
    for name in CONFIGS:
        for sampler in (s for s in SAMPLERS if s not in KDIFFUSION_SAMPLERS):
            for schedule in (s for s in schedules_of(sampler) if s not in TABLE_SCHEDULES):
                for pred in ("epsilon", "v_prediction"):
                    if name != "zero_snr" or pred == "v_prediction":  # (zero SNR is v-prediction only: refused)
                        yield name, sampler, schedule, pred


@pytest.mark.parametrize("name,sampler,schedule,pred", list(_cases()))
def test_matches_diffusers(name, sampler, schedule, pred):
    config = CONFIGS[name] | {"prediction_type": pred}
    noise = NoiseSchedule.from_config(config)
    # the full step counts on SD1.5's config for every pair, and on every config for the first four samplers on
    # default / karras; the other configs (spacings, zero SNR, linear betas) run the newer pairs at three counts
    # (diffusers' Heun, KDPM2 and LMS schedulers take ~0.1-0.3 s a walk: the whole matrix would be minutes)
    full = name == "sd15" or (sampler in SAMPLERS[:4] and schedule in SCHEDULES[:2])
    for n in STEPS if full else (2, 7, 20):
        if (name, n, pred) == ("linspace", 2, "v_prediction") and sampler in ("heun", "dpm2"):
            # linear betas in 2 steps: the second half multiplies float32 rounding ~8000-fold; diffusers' float32 walk
            # is 7e-3 from exact there (ours 8e-5), beyond any float32 bound: tests/test_sampling_two_eval.py checks
            # this walk against diffusers in float64, where both are exact to 1e-12
            continue
        if (sampler, n) == ("plms", 2) and name in ("linspace", "trailing", "zero_snr"):
            # PLMS's third row evaluates timestep 0 (sigma_vp 0.01): its output, read back from D, carries D's float32
            # rounding times 1 / sigma_vp; tests/test_sampling_multistep.py checks this walk in float64
            continue
        try:
            plan = make_plan(noise, sampler, schedule, n)
        except ValueError as e:
            if "zero terminal SNR" in str(e):  # a sampler whose diffusers scheduler has no rescale_betas_zero_snr
                import inspect
                cls = type(diffusers_scheduler(CONFIGS["sd15"], sampler, schedule))
                assert "rescale_betas_zero_snr" not in inspect.signature(cls.__init__).parameters, e
                continue
            # refused where diffusers itself goes wrong: a repeated first timestep (it would start at the second)
            # or a repeated timestep anywhere (a degenerate table), or a step float32 cannot take (dpm2_a: NaN there)
            sched = diffusers_scheduler(config, sampler, schedule)
            sched.set_timesteps(n)
            if "too far for float32" in str(e):
                assert torch.isnan(sched.timesteps).any() or not torch.isfinite(run_diffusers(
                    config, sampler, schedule, n)[1][-1]).all(), e
                continue
            assert "repeat" in str(e), e
            assert len(set(sched.timesteps.tolist())) < len(sched.timesteps)
            continue
        sched, ref = run_diffusers(config, sampler, schedule, n)
        np.testing.assert_array_equal(plan.timesteps, sched.timesteps.numpy().astype(np.float64))
        np.testing.assert_array_equal(plan.timesteps, plan.coefs[:, Coef.T])
        assert plan.init_noise_sigma == float(sched.init_noise_sigma)
        if sampler not in ("ddim", "lcm", "tcd", "plms"):
            np.testing.assert_array_equal(plan.sigmas, sched.sigmas.numpy().astype(np.float64))
        assert len(ref) == plan.num_steps + 1 and plan.step_index[-1] == n - 1
        # the beta schedule's sigmas crowd at both ends: diffusers' float32 step-size ratios there lose a few more
        # bits (up to 19 ulps of the largest latent seen, dpmpp_2m at 4 steps); UniPC of order 3 on linear betas
        # (sigma_max 157, alpha 0.006) amplifies float32 rounding most: diffusers misses its own tolerance there when
        # half its initial noise moves by one ulp (5 of 12 draws), so the bound is what float32 allows, not tighter
        ulps = ULPS * (4 if schedule == "beta" else 1) * (2 if (sampler, name) == ("unipc_3", "linspace") else 1)
        ours = run_plan(plan)
        try:
            assert_same_latents(ours, ref, f"{sampler}/{schedule}/{pred}/{name} n={n}", ulps=ulps)
        except AssertionError:
            # an ill-conditioned walk (one step over most of the sigma range: linear betas or trailing at 2-4 steps,
            # where a two-evaluation step multiplies its first half's rounding by |dt| / sigma_mid, up to ~8000):
            # diffusers' float32 walk is then itself further from exact than the tolerance. The bound widens by
            # exactly float32's own error on each side, measured by running both walks in float64
            _, ref64 = run_diffusers(config, sampler, schedule, n, dtype=torch.float64)
            ours64, _ = run_plan(plan, dtype=torch.float64)
            beyond = []  # our latents moved towards diffusers' by that error: what is left must be within tolerance
            for a, b, a64, b64 in zip(ours[0], ref, ours64, ref64):
                gap = a.double() - b.double()
                slack = (b.double() - b64).abs() + (a.double() - a64).abs()
                beyond.append((b.double() + gap.sign() * (gap.abs() - slack).clamp(min=0)).float())
            assert_same_latents((beyond, ours[1]), ref, f"{sampler}/{schedule}/{pred}/{name} n={n} (beyond float32's "
                                "own error)", ulps=ulps)


def test_zero_snr_is_v_prediction_only_and_karras_repeats_are_refused():
    with pytest.raises(ValueError, match="zero terminal SNR.*v_prediction"):
        NoiseSchedule.from_config(CONFIGS["zero_snr"] | {"prediction_type": "epsilon"})
    noise = NoiseSchedule.from_config(CONFIGS["zero_snr"] | {"prediction_type": "v_prediction"})
    ours = noise.alphas_cumprod()
    ref = diffusers_scheduler(CONFIGS["zero_snr"] | {"prediction_type": "v_prediction"}, "ddim", "default")
    np.testing.assert_array_equal(ours, ref.alphas_cumprod.numpy().astype(np.float64))
    assert ours[-1] == 0.0 and noise.train_sigmas()[-1] == pytest.approx(4096.0, rel=1e-3)
    for sampler in ("dpmpp_2m", "ddim"):
        with pytest.raises(ValueError, match="repeat"):
            make_plan(noise, sampler, "karras", 50)


def test_alphas_cumprod_matches_diffusers():
    for config in CONFIGS.values():
        config = config | ({"prediction_type": "v_prediction"} if config.get("rescale_betas_zero_snr") else {})
        sched = diffusers_scheduler(config, "ddim", "default")
        ours = NoiseSchedule.from_config(config).alphas_cumprod()
        assert ours.dtype == np.float64
        np.testing.assert_array_equal(ours, sched.alphas_cumprod.numpy().astype(np.float64))


def test_cosine_schedule_matches_diffusers():
    config = {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}
    # ddim/karras: diffusers' truncated timesteps start 999, 999, ...; DDIM steps through the repeat.
    for sampler, schedule in (("dpmpp_2m", "default"), ("euler", "karras"), ("ddim", "default"), ("ddim", "karras")):
        plan = make_plan(NoiseSchedule.from_config(config), sampler, schedule, 10)
        sched, ref = run_diffusers(config, sampler, schedule, 10)
        np.testing.assert_array_equal(plan.timesteps, sched.timesteps.numpy().astype(np.float64))
        assert_same_latents(run_plan(plan), ref, f"cosine {sampler}/{schedule}")
    # diffusers truncates these timesteps to 999, 999, ... and would skip the first step.
    with pytest.raises(ValueError, match="repeats its first timestep"):
        make_plan(NoiseSchedule.from_config(config), "dpmpp_2m", "karras", 10)


@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
def test_coefficients_finite(spacing):
    noise = NoiseSchedule.from_config(SD15 | {"timestep_spacing": spacing})
    for sampler in SAMPLERS:
        # (the table schedules do not depend on the spacing: walked once, at the counts that differ in kind)
        for schedule in SCHEDULES if spacing == "leading" else [s for s in SCHEDULES if s not in TABLE_SCHEDULES]:
            counts = list(range(1, 13)) + [20, 31, 49, 50, 100, 200, 999, 1000]
            for n in counts if schedule not in TABLE_SCHEDULES else [1, 2, 3, 4, 7, 20, 36, 200]:
                try:
                    plan = make_plan(noise, sampler, schedule, n)
                except ValueError:
                    continue  # degenerate combinations are refused, never returned
                rows = 2 * n - 1 if sampler in ("heun", "dpm2", "dpm2_a", "dpmpp_sde", "dpmpp_2s_a") else \
                    n + 1 if sampler == "plms" and n > 1 else n
                if sampler == "restart":  # Heun steps, two rows each, Euler into sigma 0 (a restart may end there too)
                    rows = min(max(plan.num_steps, n), 2 * n - 1)
                assert plan.coefs.shape == (rows, NUM_COEFS) and plan.coefs.dtype == np.float64
                assert np.all(np.isfinite(plan.coefs)), (sampler, schedule, n)
                # (LCM and TCD draw none at their last step; dpm2_a and dpmpp_sde draw at rows before sigma 0; DPM
                # fast draws after its steps before the last, Restart where it restarts)
                noisy = ("euler_a", "dpmpp_2m_sde", "dpmpp_3m_sde") + (("dpm2_a", "dpmpp_sde", "lcm", "tcd", "dpmpp_2s_a",
                                                                        "dpmpp_2m_sde_heun") if n > 1 else ()) + \
                    (("dpm_fast",) if n > 2 else ()) + (("restart",) if n >= 20 else ())
                assert plan.draws_noise == (sampler in noisy), (sampler, n)


def test_final_step_lands_on_denoised():
    # Sigma reaches zero at the last step: x_next is exactly D there (not DDIM, which stops at abar[0]).
    noise = NoiseSchedule.from_config(SD15)
    for sampler in ("euler", "euler_a", "dpmpp_2m"):
        last = make_plan(noise, sampler, "karras", 20).coefs[-1]
        assert (last[Coef.A], last[Coef.B], last[Coef.C], last[Coef.D]) == (0.0, 1.0, 0.0, 0.0)


def test_ddim_karras_walks_dpm_solvers_karras_timesteps():
    """The Karras DDIM oracle takes DPM-Solver's timesteps, steps to the next one, and survives from_config."""
    for config in (SD15, SD15 | {"set_alpha_to_one": True}):
        noise = NoiseSchedule.from_config(config)
        sched = diffusers_scheduler(config, "ddim", "karras")
        copy = type(sched).from_config(sched.config)
        dpm = diffusers_scheduler(config, "dpmpp_2m", "karras")
        for s in (sched, copy, dpm):
            s.set_timesteps(10)
        assert torch.equal(sched.timesteps, dpm.timesteps) and torch.equal(copy.timesteps, dpm.timesteps)
        plan = make_plan(noise, "ddim", "karras", 10)
        ac = noise.alphas_cumprod()
        t = plan.timesteps.astype(int)
        # sigmas are VE: sqrt((1 - abar) / abar) at each timestep, then at the final alpha.
        final = 1.0 if noise.set_alpha_to_one else ac[0]
        abar = np.append(ac[t], final)
        np.testing.assert_allclose(plan.sigmas, np.sqrt((1 - abar) / abar), rtol=1e-12)
        # x_next = sqrt(abar_next) D + sqrt(1 - abar_next) eps: B + A * alpha == sqrt(abar_next).
        last = plan.coefs[-1]
        assert last[Coef.B] + last[Coef.A] * np.sqrt(ac[t[-1]]) == pytest.approx(np.sqrt(final), rel=1e-12)


def test_rows_of_different_plans_batch_like_alone():
    noise = NoiseSchedule.from_config(SD15)
    plans = [make_plan(noise, "dpmpp_2m", "karras", 7), make_plan(noise, "euler_a", "default", 12)]
    shape = (1,) + SHAPE[1:]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(shape, generator=g) * p.init_noise_sigma for p in plans]
    d_prevs = [torch.zeros(shape) for _ in plans]
    steps = [0, 0]
    while any(s < p.num_steps for s, p in zip(steps, plans)):
        live = [r for r, p in enumerate(plans) if steps[r] < p.num_steps]
        coefs = torch.from_numpy(np.stack([plans[r].coefs[steps[r]] for r in live])).float()
        x = torch.cat([xs[r] for r in live])
        out = torch.cat([fake_model(plans[r].coefs[steps[r], Coef.C_IN] * xs[r], plans[r].timesteps[steps[r]])
                         for r in live])
        noise_draw = torch.randn(x.shape, generator=g)
        batched_x, batched_d = apply_step(coefs, x, out, torch.cat([d_prevs[r] for r in live]), noise_draw)
        for j, r in enumerate(live):
            alone_x, alone_d = apply_step(coefs[j : j + 1], xs[r], out[j : j + 1], d_prevs[r], noise_draw[j : j + 1])
            assert torch.equal(batched_x[j : j + 1], alone_x) and torch.equal(batched_d[j : j + 1], alone_d)
            xs[r], d_prevs[r] = alone_x, alone_d
            steps[r] += 1
    assert steps == [7, 12]


@pytest.mark.parametrize(
    "sampler,schedule,steps,words",
    [
        ("dpm_adaptive", "default", 10, ["sampler 'dpm_adaptive'", "euler, euler_a, dpmpp_2m, ddim"]),
        ("euler", "linear_quadratic", 10, ["schedule 'linear_quadratic'", "default, karras"]),
        ("ddim", "exponential", 10, ["sampler 'ddim' takes the schedules default, karras", "not 'exponential'"]),
        ("euler", "default", 0, ["num_steps 0", "1..200"]),
        ("euler", "default", 201, ["num_steps 201", "1..200"]),  # MAX_STEPS, the one bound (request.py too)
        ("euler", "default", 2.5, ["num_steps 2.5", "1..200"]),
    ],
)
def test_bad_arguments_name_the_allowed_values(sampler, schedule, steps, words):
    with pytest.raises(ValueError) as info:
        make_plan(NoiseSchedule.from_config(SD15), sampler, schedule, steps)
    for word in words:
        assert word in str(info.value)


def test_the_names_are_the_sd_families_and_a_request_checks_them():
    """The built-in families list sampling/names.py; a request without a model is checked against those names, one
    for a model against its family's (ModelInfo), and the request itself only types them (the family decides)."""
    from diffgraph.models.families import SDFamily, SDXLFamily
    from diffgraph.request import GenerationRequest, ModelInfo, ParamError

    for family in (SDFamily, SDXLFamily):
        assert (family.samplers, family.schedules) == (SAMPLERS, SCHEDULES)
        assert (family.default_sampler, family.default_schedule, family.size_multiple) == ("euler", "default", 8)
    base = dict(width=64, height=64, guidance_scale=7.5)
    with pytest.raises(ParamError, match=f"^sampler 'flow_euler' is unknown; allowed: {', '.join(SAMPLERS)}$"):
        GenerationRequest.create("a cat", sampler="flow_euler", **base)
    assert GenerationRequest.create("a cat", **base).sampler == "euler"
    info = ModelInfo("m", "flow", 64, 3.0, 4, "eager", "cpu", samplers=("flow_euler",), schedules=("shifted",),
                     default_sampler="flow_euler", default_schedule="shifted", size_multiple=16)
    request = GenerationRequest.create("a cat", model=info)
    assert (request.sampler, request.schedule) == ("flow_euler", "shifted")
    with pytest.raises(ParamError, match=r"^schedule 'karras' is unknown; allowed: shifted \(the schedules of model "
                                         r"family 'flow'\)$") as e:
        GenerationRequest.create("a cat", model=info, schedule="karras")
    assert e.value.param == "schedule"
    with pytest.raises(ParamError, match="^width 100 is not a multiple of 16; use 96 or 112$"):
        GenerationRequest.create("a cat", model=info, width=100)
    img = np.zeros((72, 100, 3), np.uint8)  # an edit's size: its image's, rounded down to the family's multiple
    assert GenerationRequest.create("a cat", model=info, image=img).key == (64, 96)
    with pytest.raises(ParamError, match="sampler must be a sampler name") as e:
        GenerationRequest.create("a cat", sampler=3, **base)
    assert e.value.param == "sampler"


@pytest.mark.parametrize(
    "override,words",
    [
        ({"clip_sample": True}, ["clip_sample", "clip_sample=False"]),
        ({"thresholding": True}, ["thresholding"]),
        ({"prediction_type": "sample"}, ["'sample'", "'epsilon', 'v_prediction'"]),
        ({"trained_betas": [0.1] * 1000}, ["trained_betas"]),
        ({"rescale_betas_zero_snr": True}, ["rescale_betas_zero_snr"]),
        ({"timestep_spacing": "uniform"}, ["'uniform'", "'leading', 'linspace', 'trailing'"]),
        ({"beta_schedule": "sigmoid"}, ["'sigmoid'", "'scaled_linear'"]),
    ],
)
def test_unsupported_config_raises(override, words):
    with pytest.raises(ValueError) as info:
        NoiseSchedule.from_config(SD15 | override)
    for word in words:
        assert word in str(info.value)


def test_from_config_defaults_follow_the_scheduler_family():
    assert NoiseSchedule.from_config({"_class_name": "DDIMScheduler"}).timestep_spacing == "leading"
    assert NoiseSchedule.from_config({"_class_name": "EulerDiscreteScheduler"}).timestep_spacing == "linspace"
    noise = NoiseSchedule.from_config({"unrelated_key": 3})
    assert (noise.beta_schedule, noise.steps_offset, noise.prediction_type) == ("linear", 0, "epsilon")


def test_trailing_step_counts_diffusers_gets_wrong_are_refused():
    noise = NoiseSchedule.from_config(CONFIGS["trailing"])
    with pytest.raises(ValueError, match="use 60 or 62"):
        make_plan(noise, "euler", "default", 61)


@pytest.mark.parametrize("name, schedule, pred", [("sd15", "default", "epsilon"), ("sd15", "karras", "epsilon"),
                                                  ("sd15", "default", "v_prediction"),
                                                  ("sd15", "sgm_uniform", "epsilon")])
def test_ddim_eta_is_diffusers_ddim_eta(name, schedule, pred):
    """A request's eta on DDIM (AUTOMATIC1111 clients such as webuiapi send eta 1.0): the plan walks as
    DDIMScheduler.step(eta=...) does, one draw a step from the request's generator after the initial latents, the
    same draws as diffusers'; eta 0 (or none) draws nothing and is the deterministic walk; eta out of [0, 1] is
    refused."""
    from diffgraph.sampling.samplers import PlanOptions
    config = CONFIGS[name] | {"prediction_type": pred}
    noise = NoiseSchedule.from_config(config)
    assert not make_plan(noise, "ddim", schedule, 6, options=PlanOptions(eta=0.0)).draws_noise
    assert np.array_equal(make_plan(noise, "ddim", schedule, 6, options=PlanOptions(eta=0.0)).coefs,
                          make_plan(noise, "ddim", schedule, 6).coefs)
    for eta, n in ((0.5, 6), (1.0, 6), (1.0, 20)):
        plan = make_plan(noise, "ddim", schedule, n, options=PlanOptions(eta=eta))
        assert plan.draws_noise and plan.noise_steps.all()
        sched = copy.deepcopy(_built(tuple(sorted(config.items())), "ddim", schedule))
        sched.set_timesteps(n)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * sched.init_noise_sigma
        gen = torch.Generator().manual_seed(1)
        ref = [x]
        for t in sched.timesteps:
            x = sched.step(fake_model(sched.scale_model_input(x, t), t), t, x, eta=eta, generator=gen).prev_sample
            ref.append(x)
        assert_same_latents(run_plan(plan), ref, f"ddim {schedule} {pred} eta={eta} n={n}")
    deterministic = run_plan(make_plan(noise, "ddim", schedule, 6))[0][-1]
    assert (run_plan(make_plan(noise, "ddim", schedule, 6, options=PlanOptions(eta=1.0)))[0][-1]
            - deterministic).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"ddim's eta must be in \[0, 1\], got 1.5"):
        make_plan(noise, "ddim", schedule, 6, options=PlanOptions(eta=1.5))


def _k_euler_ancestral(plan, eta, seed=0):
    """k-diffusion's `sample_euler_ancestral` with `get_ancestral_step(sigma, sigma_next, eta)`, written out, on the
    plan's sigmas and timesteps (an epsilon model on VE latents); the same draws as `run_plan`."""
    sigmas = [float(s) for s in plan.sigmas]
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) * plan.init_noise_sigma
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [x]
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = x - sigma * fake_model(x / (sigma**2 + 1) ** 0.5, plan.timesteps[i])
        sigma_up = min(sigma_next, eta * (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5)
        sigma_down = (sigma_next**2 - sigma_up**2) ** 0.5
        x = x + (x - denoised) / sigma * (sigma_down - sigma)
        x = x + torch.randn(SHAPE, generator=gen) * sigma_up  # drawn at every step, as the plan draws
        xs.append(x)
    return xs


@pytest.mark.parametrize("schedule", ["default", "karras"])
def test_euler_a_eta_is_k_diffusions_ancestral_step(schedule):
    """AUTOMATIC1111 runs "Euler a" with the request's eta (its test body sends eta 0): eta scales the fresh noise of
    k-diffusion's ancestral step, 0 is Euler, 1 (or none) the usual walk, outside [0, 1] refused by name."""
    from diffgraph.errors import ParamError
    from diffgraph.sampling.samplers import PlanOptions
    noise = NoiseSchedule.from_config(SD15)
    assert np.array_equal(make_plan(noise, "euler_a", schedule, 8, options=PlanOptions(eta=1.0)).coefs,
                          make_plan(noise, "euler_a", schedule, 8).coefs)
    for eta in (0.0, 0.5, 1.0):
        plan = make_plan(noise, "euler_a", schedule, 8, options=PlanOptions(eta=eta))
        assert_same_latents(run_plan(plan), _k_euler_ancestral(plan, eta), f"euler_a {schedule} eta={eta}")
    euler = run_plan(make_plan(noise, "euler", schedule, 8))[0][-1]
    silent = run_plan(make_plan(noise, "euler_a", schedule, 8, options=PlanOptions(eta=0.0)))[0][-1]
    torch.testing.assert_close(silent, euler, atol=1e-4, rtol=0)
    assert (run_plan(make_plan(noise, "euler_a", schedule, 8))[0][-1] - euler).abs().max() > 1e-2
    with pytest.raises(ParamError, match=r"Euler a's eta must be in \[0, 1\]") as e:
        make_plan(noise, "euler_a", schedule, 8, options=PlanOptions(eta=1.5))
    assert e.value.param == "eta"
