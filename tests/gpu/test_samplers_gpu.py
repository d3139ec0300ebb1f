"""GPU tests (marker `gpu`, skipped without CUDA): every sampler and schedule in one running batch under CUDA graphs;
each request equals its solo run, and the steps ran as replays of the one step graph (no per-sampler variants)."""

import os

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig
from diffgraph.sampling.names import SAMPLER_SCHEDULES, SAMPLERS, SCHEDULES

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def sd15():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16, 32), resolutions=((512, 512),))
    engine = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    yield engine
    engine.close()


def test_every_sampler_shares_the_step_replays_and_equals_alone(sd15):
    reqs = []
    for i, sampler in enumerate(SAMPLERS * 2):
        allowed = SAMPLER_SCHEDULES.get(sampler, SCHEDULES)
        reqs.append(sd15.make_request(["a red fox", "a blue car", "a castle"][i % 3], width=512, height=512,
                                      num_inference_steps=[4, 6, 8][i % 3], sampler=sampler,
                                      schedule=allowed[i % len(allowed)], guidance_scale=[1.0, 7.5][i % 2],
                                      seed=300 + i))
    alone = [sd15.run(r).arrays for r in reqs]

    def counts():
        rows = [r for r in sd15.graph_table() if r["kind"] == "step"]
        return sum(r["replays"] for r in rows), sum(r["eager_fallbacks"] for r in rows)
    before = counts()
    futures = [sd15.submit(r) for r in reqs]
    results = [f.result(timeout=600) for f in futures]
    worst = {r.sampler: float(np.abs(res.arrays - ref).max()) for r, res, ref in zip(reqs, results, alone)}
    print("mixed vs alone, max abs per sampler:", worst)
    assert max(worst.values()) <= 2e-2, worst
    replays, eager = counts()
    assert replays > before[0] and eager == before[1], (before, replays, eager)  # all of them replays of "step"
    assert all(np.isfinite(res.arrays).all() and res.arrays.std() > 1e-3 for res in results)
