"""Every sampler and schedule in one running batch: requests submitted together, with and without guidance, equal
each run alone (their rows share every step; each row's noise comes from its own generator)."""

from __future__ import annotations

import numpy as np

from diffgraph.sampling.names import SAMPLER_SCHEDULES, SAMPLERS, SCHEDULES


def _requests(engine):
    reqs = []
    for i, sampler in enumerate(SAMPLERS):
        allowed = SAMPLER_SCHEDULES.get(sampler, SCHEDULES)
        schedule = allowed[i % len(allowed)]
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
