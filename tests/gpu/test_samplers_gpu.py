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


def test_ddim_cfgpp_under_graphs_equals_eager():
    """DDIM CFG++ (in the list above too) reads the unconditional branch's output through column U of the static
    coefficient buffer: a graphed engine's images equal an eager one's at two buckets, eta 0 and 0.5, where plain
    DDIM's are ~0.1 away (the tiny UNet on the CPU), and its steps are replays of the one step graph."""
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False)
    with Engine(model="random:tiny", device=DEVICE, mode="graph", graphs=cfg) as graphed, \
            Engine(model="random:tiny", device=DEVICE, mode="eager") as eager:
        for n, eta in ((1, None), (2, 0.5)):
            kw = dict(num_images=n, num_inference_steps=4, seed=5, guidance_scale=7.5, eta=eta)
            a = graphed.generate("a red fox", sampler="ddim_cfgpp", **kw).arrays
            b = eager.generate("a red fox", sampler="ddim_cfgpp", **kw).arrays
            ddim = eager.generate("a red fox", sampler="ddim", **kw).arrays
            assert np.abs(a - b).max() <= 2e-2 and np.abs(b - ddim).max() > 5e-2
        rows = [r for r in graphed.graph_table() if r["kind"] == "step"]
        assert sum(r["replays"] for r in rows) >= 8 and sum(r["eager_fallbacks"] for r in rows) == 0
