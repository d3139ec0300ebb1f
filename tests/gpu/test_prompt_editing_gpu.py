"""GPU test of prompt schedules (prompt editing and alternation) in graph mode: rows of different schedules and plain
rows share the step graphs' replays (the conditioning switched between replays by device copies), each equal to its
image alone (fp16 tolerance)."""

import os

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def sd15():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((512, 512),), prewarm=False)
    engine = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    yield engine
    engine.close()


def test_schedules_share_replays_and_equal_each_alone(sd15):
    kw = dict(prompt_syntax="a1111", negative_prompt="blurry", guidance_scale=6.0, num_inference_steps=8)
    prompts = [dict(prompt="a red fox"), dict(prompt="a [red fox:blue car:0.5]"),
               dict(prompt="a [red|blue] car", negative_prompt="[blurry|grainy]"),
               dict(prompt="a [castle::3] on a hill", sampler="heun", num_inference_steps=5),
               dict(prompt="a blue car")]
    reqs = [sd15.make_request(**{**kw, **p}, seed=40 + i) for i, p in enumerate(prompts)]
    alone = [sd15.run(r).arrays for r in reqs]
    results = [h.result(timeout=300) for h in [sd15.submit(r) for r in reqs]]
    worst = max(float(np.abs(res.arrays - ref).max()) for res, ref in zip(results, alone))
    assert worst <= 2 / 255, worst
    assert float(np.abs(alone[1] - alone[0]).max()) > 1 / 255   # the edit changed the image
