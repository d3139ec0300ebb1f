"""Every sampler and schedule in one running batch: requests submitted together, with and without guidance, equal
each run alone (their rows share every step; each row's noise comes from its own generator)."""

from __future__ import annotations

import numpy as np

from diffgraph.sampling.names import SAMPLER_SCHEDULES, SAMPLERS, SCHEDULES


def _requests(engine):
    reqs = []
    pairs = [(s, SAMPLER_SCHEDULES.get(s, SCHEDULES)[i % len(SAMPLER_SCHEDULES.get(s, SCHEDULES))])
             for i, s in enumerate(SAMPLERS)]
    pairs += [(("dpmpp_2m", "dpmpp_2s_a")[i % 2], schedule)  # the schedules no sampler above drew
              for i, schedule in enumerate(s for s in SCHEDULES if s not in {k for _, k in pairs})]
    for i, (sampler, schedule) in enumerate(pairs):
        reqs.append(engine.make_request(
            ["a red fox", "a blue car", "a castle at night"][i % 3], width=64, height=64,
            num_inference_steps=[3, 4, 5][i % 3], sampler=sampler, schedule=schedule,
            guidance_scale=[1.0, 5.0][i % 2], seed=500 + i, num_images=[1, 2][(i // 2) % 2],
            request_id=f"sampler-mix-{i}"))
    return reqs


def test_every_sampler_and_schedule_together_equal_each_alone(tiny_engine):
    reqs = _requests(tiny_engine)
    assert {r.schedule for r in reqs} == set(SCHEDULES) and {r.sampler for r in reqs} == set(SAMPLERS)
    alone = [tiny_engine.run(r).arrays for r in reqs]
    steps_before = tiny_engine.stats["steps"]
    futures = [tiny_engine.submit(r) for r in reqs]
    for r, f, ref in zip(reqs, futures, alone):
        got = f.result(timeout=600).arrays
        assert got.shape == (r.num_images, 64, 64, 3)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"{r.sampler}/{r.schedule}")
    assert tiny_engine.stats["steps"] - steps_before < sum(r.num_inference_steps for r in reqs)  # they shared steps


def test_a_requests_timestep_spacing_and_eta_are_diffusers_own(tiny_engine):
    """timestep_spacing overrides the model's scheduler config for one request; eta is TCD's gamma and DDIM's eta;
    both are refused where they mean nothing, naming the field."""
    import pytest
    import torch

    from diffgraph.errors import ParamError

    def ref(sampler, spacing=None, eta=None):
        pipe = tiny_engine.diffusers_pipeline(sampler, "default")
        if spacing is not None:
            pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, timestep_spacing=spacing)
        return pipe("a red fox", width=64, height=64, num_inference_steps=4, guidance_scale=5.0,
                    generator=torch.Generator("cpu").manual_seed(9), output_type="np",
                    **({} if eta is None else {"eta": eta})).images

    def ours(sampler, **kw):
        return tiny_engine.generate("a red fox", num_inference_steps=4, guidance_scale=5.0, seed=9, sampler=sampler,
                                    **kw).arrays

    trailing = ours("euler", timestep_spacing="trailing")
    assert np.abs(trailing - ref("euler", spacing="trailing")).max() * 255 <= 1.0
    assert np.abs(trailing - ours("euler")).max() > 1e-3  # the spacing changed the walk
    for eta in (0.0, 0.7):
        assert np.abs(ours("tcd", eta=eta) - ref("tcd", eta=eta)).max() * 255 <= 1.0
    assert np.abs(ours("tcd", eta=0.0) - ours("tcd", eta=0.7)).max() > 1e-3
    ddim = ours("ddim", eta=1.0)  # webuiapi's default eta, sent with every AUTOMATIC1111 request
    assert np.abs(ddim - ref("ddim", eta=1.0)).max() * 255 <= 1.0
    assert np.abs(ddim - ours("ddim")).max() > 1e-3
    with pytest.raises(ParamError, match="eta is the noise amount of samplers tcd, ddim, euler_a") as e:
        ours("euler", eta=0.3)
    assert e.value.param == "eta"
    with pytest.raises(ParamError, match="timestep_spacing 'uniform' is unknown; allowed: leading, linspace, "
                                         "trailing") as e:
        ours("euler", timestep_spacing="uniform")
    assert e.value.param == "timestep_spacing"
