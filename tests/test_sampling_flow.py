"""Flow-matching samplers (sampling/flow.py) against diffusers' schedulers stepping the same fake velocity model:
Euler (FlowMatchEulerDiscreteScheduler), its stochastic form (stochastic_sampling, one draw a step from the row's
generator) and DPM-Solver++(2M) (DPMSolverMultistepScheduler, use_flow_sigmas, flow_prediction), on a fixed shift
and on the dynamic shift; a walk that begins later (image-to-image) starts first order, as the scheduler does there;
AUTOMATIC1111's labels name them on a flow family."""

import numpy as np
import pytest
import torch

from diffgraph.sampling.aliases import canonical
from diffgraph.sampling.flow import FLOW_SAMPLERS, FLOW_SCHEDULES, FlowSchedule, flow_plan
from diffgraph.sampling.samplers import start_plan
from diffgraph.sampling.table import HISTORY_SLOTS, NUM_COEFS, Coef, apply_history, apply_step

SHAPE = (2, 16, 8, 8)
TOKENS = 1024
FIXED = FlowSchedule(shift=3.0)
DYNAMIC = FlowSchedule(use_dynamic_shifting=True)


def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
    k = torch.linspace(0.5, 2.0, x[0].numel(), dtype=x.dtype).reshape(x.shape[1:])
    return 0.8 * x + 0.3 * torch.sin(x * k + float(t) / 100)


def scheduler(sampler: str, flow: FlowSchedule):
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
    if sampler == "flow_dpmpp_2m":
        return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                           flow_shift=flow.shift, use_dynamic_shifting=flow.use_dynamic_shifting)
    return FlowMatchEulerDiscreteScheduler(shift=flow.shift, use_dynamic_shifting=flow.use_dynamic_shifting,
                                           stochastic_sampling=sampler == "flow_euler_a")


def diffusers_walk(sampler: str, flow: FlowSchedule, steps: int, x: torch.Tensor, begin: int = 0):
    sched = scheduler(sampler, flow)
    mu = flow.mu(TOKENS) if flow.use_dynamic_shifting else None
    if sampler == "flow_dpmpp_2m":
        sched.set_timesteps(steps, mu=mu)
    else:  # the sigmas the flow pipelines give it (ZImagePipeline's default, Flux's)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps), mu=mu)
    if begin:
        sched.set_begin_index(begin)
    gen = torch.Generator().manual_seed(3)
    xs = [x]
    for t in sched.timesteps[begin:]:
        x = sched.step(velocity(x, t), t, x, generator=gen, return_dict=False)[0]
        xs.append(x)
    return sched, xs


def our_walk(plan, x: torch.Tensor):
    gen = torch.Generator().manual_seed(3)
    d_prev = torch.zeros_like(x)
    history = [torch.zeros_like(x) for _ in range(HISTORY_SLOTS)]
    coefs = torch.from_numpy(plan.coefs).to(x.dtype)
    xs = [x]
    for i in range(plan.num_steps):
        row = coefs[i:i + 1].expand(x.shape[0], NUM_COEFS)
        out = velocity(x, plan.timesteps[i])
        noise = torch.randn(x.shape, generator=gen, dtype=x.dtype) if plan.noise_steps[i] else None
        x_next, d = apply_step(row, x, out, d_prev, noise)
        extra, history = apply_history(row, x, d, d_prev, history)
        x, d_prev = x_next + extra, d
        xs.append(x)
    return xs


@pytest.mark.parametrize("flow", [FIXED, DYNAMIC], ids=["shift3", "dynamic"])
@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_flow_samplers_walk_as_diffusers_schedulers(sampler, flow):
    for steps in (1, 2, 3, 8, 20):
        plan = flow_plan(sampler, FLOW_SCHEDULES[0], flow, steps, TOKENS)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(steps), dtype=torch.float32)
        sched, ref = diffusers_walk(sampler, flow, steps, x)
        np.testing.assert_allclose(plan.sigmas, sched.sigmas.double().numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(plan.timesteps, sched.timesteps.double().numpy(), rtol=1e-6)
        ours = our_walk(plan, x)
        assert len(ours) == len(ref) == steps + 1
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert (a - b).abs().max().item() < 1e-5, (sampler, steps, i)


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_a_later_start_is_the_schedulers_walk_from_there(sampler):
    """An edit's rows begin at step 3 of 8: DPM-Solver++ begins first order there, as the scheduler does."""
    plan = start_plan(flow_plan(sampler, FLOW_SCHEDULES[0], FIXED, 8, TOKENS), 3)
    assert plan.num_steps == 5 and plan.coefs[0, Coef.C] == 0.0
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9), dtype=torch.float32)
    _, ref = diffusers_walk(sampler, FIXED, 8, x, begin=3)
    ours = our_walk(plan, x)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-5


def test_automatic1111_labels_name_the_flow_samplers():
    for label, want in (("Euler", "flow_euler"), ("Euler a", "flow_euler_a"), ("DPM++ 2M", "flow_dpmpp_2m")):
        assert canonical(label, None, FLOW_SAMPLERS, FLOW_SCHEDULES)[0] == want
