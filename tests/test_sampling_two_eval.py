"""The two-evaluation samplers (sampling/two_eval.py) and the consistency samplers (sampling/consistency.py): walks
from a later start against diffusers, their rows' steps, the history slots they use, and what they refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_sampling import CONFIGS, SHAPE, assert_same_latents, fake_model, run_plan

from diffgraph.sampling import Coef, NoiseSchedule, make_plan
from diffgraph.sampling.consistency import PLANS as CONSISTENCY_PLANS
from diffgraph.sampling.oracle import diffusers_scheduler, step_kwargs
from diffgraph.sampling.samplers import PlanOptions, noising
from diffgraph.sampling.table import HISTORY_SLOTS, HISTORY_SOURCES, hist_col
from diffgraph.sampling.two_eval import PLANS as TWO_EVAL_PLANS

TWO_EVAL = tuple(TWO_EVAL_PLANS)
CONSISTENCY = tuple(CONSISTENCY_PLANS)
# (config, schedule, prediction type) x (steps, start)
SETTINGS = {name: (("sd15", "default", "epsilon"), ("sdxl", "karras", "v_prediction")) for name in TWO_EVAL}
SETTINGS |= {name: (("sd15", "default", "epsilon"), ("sdxl", "default", "v_prediction")) for name in CONSISTENCY}
WALKS = ((10, 3), (16, 15))
# diffusers' KDPM2 schedulers call numpy functions on torch tensors (numpy 2 deprecates the wrapping)
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")


def run_diffusers_from(sched, n: int, start: int, x: torch.Tensor, eta: float | None = None) -> list:
    """A pipeline's image-to-image walk: set_timesteps(n), then timesteps[start * order:] after
    set_begin_index(start * order), the scheduler's state fresh."""
    sched.set_timesteps(n)
    first = start * sched.order
    sched.set_begin_index(first)
    kwargs = step_kwargs(sched, torch.Generator().manual_seed(1)) | ({} if eta is None else {"eta": eta})
    xs = [x]
    for t in sched.timesteps[first:]:
        out = fake_model(sched.scale_model_input(x, t), t)
        x = sched.step(out, t, x, **kwargs).prev_sample
        xs.append(x)
    return xs


def _from_noised_zero_image(plan):
    """The plan and its first latents for a zero image noised to the start: e * noise on both sides."""
    _, e = noising(plan)
    plan = dataclasses.replace(plan, init_noise_sigma=e)
    return plan, torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * e


@pytest.mark.parametrize("sampler", TWO_EVAL + CONSISTENCY)
def test_starts_match_diffusers(sampler):
    for name, schedule, pred in SETTINGS[sampler]:
        config = CONFIGS[name] | {"prediction_type": pred}
        noise = NoiseSchedule.from_config(config)
        sched = diffusers_scheduler(config, sampler, schedule)
        for n, start in WALKS:
            plan, x = _from_noised_zero_image(make_plan(noise, sampler, schedule, n, start=start))
            assert (plan.start, int(plan.step_index[0]), int(plan.step_index[-1])) == (start, start, n - 1)
            ref = run_diffusers_from(sched, n, start, x)
            first = start * sched.order
            np.testing.assert_array_equal(plan.timesteps, sched.timesteps[first:].numpy().astype(np.float64))
            if sampler in TWO_EVAL:
                np.testing.assert_array_equal(plan.sigmas, sched.sigmas[first:].numpy().astype(np.float64))
            else:  # VE sigmas of the states: each row's timestep, then the end (LCM: 0, TCD: timestep 0)
                ac = noise.alphas_cumprod()
                end = 0.0 if sampler == "lcm" else np.sqrt((1 - ac[0]) / ac[0])
                abar = ac[plan.timesteps.astype(np.int64)]
                np.testing.assert_allclose(plan.sigmas, np.append(np.sqrt((1 - abar) / abar), end), rtol=1e-12)
            assert_same_latents(run_plan(plan), ref, f"{sampler}/{schedule}/{pred}/{name} n={n} start={start}")


@pytest.mark.parametrize("sampler", TWO_EVAL)
def test_a_step_is_two_rows_the_last_one(sampler):
    plan = make_plan(NoiseSchedule.from_config(CONFIGS["sd15"]), sampler, "karras", 20)
    assert plan.num_steps == 39 and plan.steps == 20
    np.testing.assert_array_equal(plan.step_index, np.repeat(np.arange(20), 2)[:-1])
    assert (plan.coefs[-1, Coef.A], plan.coefs[-1, Coef.B]) == (0.0, 1.0)  # Euler to sigma 0: x_next = D
    assert list(plan.noise_steps) == [sampler == "dpm2_a" and i % 2 == 1 for i in range(39)]
    later = make_plan(NoiseSchedule.from_config(CONFIGS["sd15"]), sampler, "karras", 20, start=5)
    assert later.num_steps == 29 and list(later.step_index[:3]) == [5, 5, 6]
    np.testing.assert_array_equal(later.coefs, plan.coefs[10:])  # the steps share no state


def _slot_columns(slot: int) -> list[int]:
    return [int(Coef[f"E{slot}"])] + [hist_col(slot, source) for source in HISTORY_SOURCES]


@pytest.mark.parametrize("sampler", TWO_EVAL + CONSISTENCY)
def test_history_is_the_slots_the_rows_use(sampler):
    noise = NoiseSchedule.from_config(CONFIGS["sd15"])
    schedule = "default" if sampler in CONSISTENCY else "karras"
    for n, start in ((1, 0), (2, 0), (2, 1), (7, 0), (20, 19), (31, 7)):
        plan = make_plan(noise, sampler, schedule, n, start=start)
        rows_read_h1 = sampler in TWO_EVAL and n - start > 1  # a first row keeps x for its second row
        assert plan.history == (1 if rows_read_h1 else 0), (sampler, n, start)
        for slot in range(1, HISTORY_SLOTS + 1):
            used = np.any(plan.coefs[:, _slot_columns(slot)] != 0)
            assert used == (slot <= plan.history), (sampler, n, start, slot)
        if plan.history:  # H1 = x is written by the first rows that have a second row and read by those
            rows = np.arange(plan.num_steps)
            np.testing.assert_array_equal(plan.coefs[:, hist_col(1, "X")] != 0, (rows % 2 == 0) & (rows < rows[-1]))
            np.testing.assert_array_equal(plan.coefs[:-1:2, hist_col(1, "X")], 1.0)
            np.testing.assert_array_equal(plan.coefs[:, Coef.E1] != 0, rows % 2 == 1)


@pytest.mark.parametrize("sampler", TWO_EVAL)
def test_zero_terminal_snr_is_refused_naming_the_samplers_that_take_it(sampler):
    noise = NoiseSchedule.from_config(CONFIGS["zero_snr"] | {"prediction_type": "v_prediction"})
    with pytest.raises(ValueError, match="zero terminal SNR") as e:
        make_plan(noise, sampler, "default", 10)
    assert "euler" in str(e.value) and "lcm" in str(e.value)


def test_degenerate_walks_are_refused():
    linear = NoiseSchedule.from_config(CONFIGS["linspace"])
    # one ancestral step from sigma 157 to 0.01: float32 leaves no sigma_down (diffusers' midpoint is NaN)
    with pytest.raises(ValueError, match="sigma_down there is 0.*use more steps"):
        make_plan(linear, "dpm2_a", "default", 2)
    assert make_plan(linear, "dpm2_a", "default", 4).num_steps == 7
    for sampler in CONSISTENCY:
        with pytest.raises(ValueError, match="at most 50 steps"):
            make_plan(NoiseSchedule.from_config(CONFIGS["sd15"]), sampler, "default", 51)


def test_tcd_gamma_is_the_requests_eta():
    config = CONFIGS["sd15"]
    noise = NoiseSchedule.from_config(config)
    assert make_plan(noise, "tcd", "default", 8).eta is None  # 0.3, the step's default (test_sampling compares it)
    assert not make_plan(noise, "tcd", "default", 8, options=PlanOptions(eta=0.0)).draws_noise
    sched = diffusers_scheduler(config, "tcd", "default")
    for eta, start in ((0.0, 0), (0.7, 2), (1.0, 5)):
        plan, x = _from_noised_zero_image(make_plan(noise, "tcd", "default", 8, start=start,
                                                    options=PlanOptions(eta=eta)))
        ref = run_diffusers_from(sched, 8, start, x, eta=eta)
        assert_same_latents(run_plan(plan), ref, f"tcd eta={eta} start={start}")


def _diffusers_float64(sched, n: int) -> list:
    """diffusers' walk of `sched` with its sigma tables, latents and model in float64."""
    sched.set_timesteps(n)
    for name in ("sigmas", "sigmas_interpol", "sigmas_up", "sigmas_down"):
        if hasattr(sched, name):
            setattr(sched, name, getattr(sched, name).double())
    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * sched.init_noise_sigma).double()
    kwargs = step_kwargs(sched, torch.Generator().manual_seed(1))
    xs = [x]
    for t in sched.timesteps:
        x = sched.step(fake_model(sched.scale_model_input(x, t), t), t, x, **kwargs).prev_sample
        xs.append(x)
    return xs


def _plan_float64(plan) -> list:
    """run_plan's walk with the coefficients, latents and model in float64 (noise drawn in float32)."""
    from diffgraph.sampling import NUM_COEFS, apply_step
    from diffgraph.sampling.table import apply_history

    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * plan.init_noise_sigma).double()
    gen = torch.Generator().manual_seed(1)
    d_prev, history = torch.zeros_like(x), [torch.zeros_like(x) for _ in range(HISTORY_SLOTS)]
    coefs = torch.from_numpy(plan.coefs)
    xs = [x]
    for i in range(plan.num_steps):
        row = coefs[i : i + 1].expand(SHAPE[0], NUM_COEFS)
        out = fake_model(row[:, Coef.C_IN].reshape(-1, 1, 1, 1) * x, plan.timesteps[i])
        noise = torch.randn(SHAPE, generator=gen).double() if plan.noise_steps[i] else None
        x_next, d = apply_step(row, x, out, d_prev, noise)
        extra, history = apply_history(row, x, d, d_prev, history)
        x, d_prev = x_next + extra, d
        xs.append(x)
    return xs


@pytest.mark.parametrize("sampler", TWO_EVAL)
def test_ill_conditioned_walks_are_diffusers_in_exact_arithmetic(sampler, monkeypatch):
    """Linear betas (sigma 157 down to 0.01) in 2 or 4 steps: the second evaluation of the first step amplifies the
    first's float32 rounding by |dt| / sigma_mid (~8000 for Heun at 2 steps), so diffusers' own float32 walk is off
    its float64 walk by more than test_sampling's 8 ulps; there the plan must equal diffusers in float64."""
    import diffusers.schedulers.scheduling_k_dpm_2_ancestral_discrete as ancestral

    draw = ancestral.randn_tensor  # its noise drawn in float32, as ours
    monkeypatch.setattr(ancestral, "randn_tensor", lambda shape, generator=None, device=None, dtype=None:
                        draw(shape, generator=generator, device=device, dtype=torch.float32).double())
    for schedule in ("default", "beta"):
        for pred in ("epsilon", "v_prediction"):
            config = CONFIGS["linspace"] | {"prediction_type": pred}
            sched = diffusers_scheduler(config, sampler, schedule)
            for n in (2, 4):
                try:
                    plan = make_plan(NoiseSchedule.from_config(config), sampler, schedule, n)
                except ValueError as e:
                    assert "sigma_down there is 0" in str(e), e
                    continue
                ours, ref = _plan_float64(plan), _diffusers_float64(sched, n)
                largest = max(r.abs().max().item() for r in ref)
                err = max((a - b).abs().max().item() for a, b in zip(ours, ref))
                assert err <= 1e-12 * largest, f"{sampler}/{schedule}/{pred} n={n}: {err:.2e} (largest {largest:.1f})"
