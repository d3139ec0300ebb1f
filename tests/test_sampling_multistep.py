"""The multistep samplers (sampling/multistep.py) from a later start against diffusers, and their history slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_sampling import CONFIGS, SHAPE, ULPS, assert_same_latents, fake_model, run_diffusers, run_plan

from diffgraph.sampling import SAMPLERS, Coef, NoiseSchedule, make_plan
from diffgraph.sampling.multistep import PLANS, ZERO_SNR_SAMPLERS
from diffgraph.sampling.names import KDIFFUSION_SAMPLERS
from diffgraph.sampling.oracle import diffusers_scheduler, step_kwargs
from diffgraph.sampling.samplers import noising
from diffgraph.sampling.table import HISTORY_SLOTS, HISTORY_SOURCES, hist_col

MULTISTEP = tuple(PLANS)
# (config, schedule, prediction type) x (steps, start): orders 2 and 3 and LMS's 4 are reached after the start, and
# the lower-order final steps (n < 15: the last two) are inside the walk or not
SETTINGS = (("sd15", "default", "epsilon"), ("sdxl", "karras", "v_prediction"))
WALKS = ((10, 3), (16, 5), (16, 12))


def run_diffusers_from(config: dict, sampler: str, schedule: str, n: int, start: int, x: torch.Tensor) -> tuple:
    """A pipeline's image-to-image walk: set_timesteps(n), set_begin_index(start) where the class has it, then the
    timesteps from `start` on. Returns (the scheduler, the latents from x on)."""
    sched = diffusers_scheduler(config, sampler, schedule)
    sched.set_timesteps(n)
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start)
    kwargs = step_kwargs(sched, torch.Generator().manual_seed(1))
    xs = [x]
    for t in sched.timesteps[start:]:
        out = fake_model(sched.scale_model_input(x, t), t)
        x = sched.step(out, t, x, **kwargs).prev_sample
        xs.append(x)
    return sched, xs


@pytest.mark.parametrize("sampler", MULTISTEP)
def test_starts_match_diffusers(sampler):
    for name, schedule, pred in SETTINGS:
        config = CONFIGS[name] | {"prediction_type": pred}
        for n, start in WALKS:
            plan = make_plan(NoiseSchedule.from_config(config), sampler, schedule, n, start=start)
            assert (plan.start, plan.num_steps, int(plan.step_index[0])) == (start, n - start, start)
            # the noised latents of a zero image at the start: e * noise, on both sides (run_plan draws randn * this)
            _, e = noising(plan)
            plan = dataclasses.replace(plan, init_noise_sigma=e)
            x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * e
            sched, ref = run_diffusers_from(config, sampler, schedule, n, start, x)
            np.testing.assert_array_equal(plan.timesteps, sched.timesteps[start:].numpy().astype(np.float64))
            np.testing.assert_array_equal(plan.sigmas, sched.sigmas[start:].numpy().astype(np.float64))
            assert_same_latents(run_plan(plan), ref, f"{sampler}/{schedule}/{pred}/{name} n={n} start={start}")


def _slot_columns(slot: int) -> list[int]:
    return [int(Coef[f"E{slot}"])] + [hist_col(slot, source) for source in HISTORY_SOURCES]


@pytest.mark.parametrize("sampler", MULTISTEP)
def test_history_is_the_slots_the_rows_use(sampler):
    noise = NoiseSchedule.from_config(CONFIGS["sd15"])
    most = {"dpmpp_2m_sde": 0, "dpmpp_3m_sde": 1, "lms": 3, "unipc": 2, "unipc_3": 3}[sampler]
    for n, start in ((1, 0), (2, 0), (3, 0), (4, 0), (20, 0), (20, 16), (20, 19), (31, 7)):
        plan = make_plan(noise, sampler, "karras", n, start=start)
        assert 0 <= plan.history <= most and plan.draws_noise == sampler.endswith("_sde")
        for slot in range(1, HISTORY_SLOTS + 1):
            used = np.any(plan.coefs[:, _slot_columns(slot)] != 0)
            assert used == (slot <= plan.history), (sampler, n, start, slot)  # slots are used from H1 up
        # every slot the plan keeps is read: by x_next (its E column) or by another slot's update
        for slot in range(1, plan.history + 1):
            assert np.any(plan.coefs[:, int(Coef[f"E{slot}"])] != 0) or np.any(
                plan.coefs[:, [hist_col(k, f"H{slot}") for k in range(1, HISTORY_SLOTS + 1) if k != slot]] != 0)
        if n - start >= 5:  # (shorter walks never reach the top order: lower_order_final)
            assert plan.history == most, (sampler, n, start)
    assert make_plan(noise, sampler, "default", 1).history == 0  # one row reads no history


def test_zero_snr_is_refused_by_lms_and_matched_by_the_others():
    config = CONFIGS["zero_snr"] | {"prediction_type": "v_prediction"}
    noise = NoiseSchedule.from_config(config)
    with pytest.raises(ValueError, match="zero terminal SNR") as e:
        make_plan(noise, "lms", "default", 10)
    assert "LMSDiscreteScheduler" in str(e.value) and "unipc, unipc_3" in str(e.value)
    assert "lms" not in ZERO_SNR_SAMPLERS and set(MULTISTEP) - {"lms"} <= set(ZERO_SNR_SAMPLERS)
    for sampler in ("dpmpp_3m_sde", "unipc_3"):  # an edit on a zero-SNR model, from step 2 of 8
        plan = make_plan(noise, sampler, "default", 8, start=2)
        _, e = noising(plan)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * e
        _, ref = run_diffusers_from(config, sampler, "default", 8, 2, x)
        assert_same_latents(run_plan(dataclasses.replace(plan, init_noise_sigma=e)), ref, f"{sampler}/zero_snr")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (KDPM2's constructor, under numpy 2)
def test_zero_snr_samplers_are_those_whose_scheduler_takes_it():
    import inspect

    takes = [s for s in SAMPLERS if s not in KDIFFUSION_SAMPLERS and "rescale_betas_zero_snr" in
             inspect.signature(type(diffusers_scheduler(CONFIGS["linspace"], s, "default")).__init__).parameters]
    assert tuple(takes) == ZERO_SNR_SAMPLERS


def test_unipc_rounds_karras_timesteps_on_the_cosine_schedule():
    """UniPC rounds its Karras timesteps on squaredcos_cap_v2 too: 999, 998, 983, 0 at 4 steps, where DPM-Solver's
    truncated 998, 998, ... repeat (refused)."""
    config = {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"}
    noise = NoiseSchedule.from_config(config)
    with pytest.raises(ValueError, match="repeat"):
        make_plan(noise, "dpmpp_2m_sde", "karras", 4)
    for n, start in ((4, 0), (3, 0), (4, 1)):
        plan = make_plan(noise, "unipc", "karras", n, start=start)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        sched, ref = run_diffusers_from(config, "unipc", "karras", n, start, x)
        np.testing.assert_array_equal(plan.timesteps, sched.timesteps[start:].numpy().astype(np.float64))
        # the first sigma is 2e4 (alpha 5e-5): D = (x - sigma_vp out) / alpha magnifies float32 rounding there, as the
        # beta schedule's crowded sigmas do in test_sampling (the same allowance)
        assert_same_latents(run_plan(plan), ref, f"cosine unipc/karras n={n} start={start}", ulps=4 * ULPS)
    with pytest.raises(ValueError, match="repeats its first timestep"):
        make_plan(noise, "unipc", "karras", 6)


# ---- PLMS (PNDMScheduler, skip_prk_steps) ------------------------------------------------------------------------
@pytest.mark.parametrize("name, pred", [("sd15", "epsilon"), ("sdxl", "v_prediction"), ("linspace", "epsilon")])
def test_plms_starts_match_diffusers(name, pred):
    """An image-to-image walk enters PNDM's timestep list (its second timestep repeated) at index `start` with its
    counter at zero: the plan's rows are those, with diffusers' latents."""
    config = CONFIGS[name] | {"prediction_type": pred}
    for n, start in ((10, 3), (16, 5), (16, 12), (5, 1)):
        plan = make_plan(NoiseSchedule.from_config(config), "plms", "default", n, start=start)
        assert plan.num_steps == n + 1 - start and int(plan.step_index[0]) == start and plan.step_index[-1] == n - 1
        _, e = noising(plan)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * e
        sched, ref = run_diffusers_from(config, "plms", "default", n, start, x)
        np.testing.assert_array_equal(plan.timesteps, sched.timesteps[start:].numpy().astype(np.float64))
        assert_same_latents(run_plan(dataclasses.replace(plan, init_noise_sigma=e)), ref, f"plms/{name} n={n} {start}")


def test_plms_rows_and_history():
    noise = NoiseSchedule.from_config(CONFIGS["sd15"])
    one, two, many = (make_plan(noise, "plms", "default", n) for n in (1, 2, 20))
    assert (one.num_steps, one.history) == (1, 0)  # one row: PNDM's single step to the final alpha-bar
    assert two.num_steps == 3 and list(two.step_index) == [0, 0, 1]
    assert many.num_steps == 21 and many.history == 3 and many.timesteps[1] == many.timesteps[2]
    # the second row redoes the first step from the kept x (H2) with the mean of both outputs (H1 holds e_0)
    assert many.coefs[1, int(Coef.E1)] != 0 and many.coefs[1, int(Coef.E2)] != 0 and many.coefs[2, int(Coef.E2)] == 0
    assert many.coefs[1, hist_col(1, "H1")] == 1.0


def test_plms_evaluating_timestep_zero_matches_diffusers_in_float64():
    """Two steps on linspace spacing evaluate timestep 0, where float32 cannot compare (test_sampling skips it)."""
    config = CONFIGS["linspace"]
    plan = make_plan(NoiseSchedule.from_config(config), "plms", "default", 2)
    assert list(plan.timesteps) == [999.0, 0.0, 0.0]
    _, ref = run_diffusers(config, "plms", "default", 2, dtype=torch.float64)
    ours, _ = run_plan(plan, dtype=torch.float64)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-5 * max(r.abs().max().item() for r in ref)
