"""GPU tests of step caching (models/families/unet_cache.py) on real-size random UNets in graph mode: steps with
DeepCache rows replay their keys' graphs beside the uncached steps' replays; mixed cached (several intervals and branches, uniform
and non-uniform) and uncached requests together equal each alone (SD1.5 in fp32 within 1 level, SDXL in fp16 within
12), and a cached image differs from the uncached one (random weights: only that caching changed it)."""

import os
import threading

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
CACHES = [None, {"method": "deepcache", "interval": 3}, {"method": "deepcache", "interval": 2, "branch": 2},
          {"method": "deepcache", "interval": 4, "branch": 5, "schedule": "nonuniform", "center": 8}]


# SD1.5 in fp32 (another batch's kernels are far below a level: within 1 level is the mechanism), SDXL in fp16 (its
# bound: the kernels of another batch size round otherwise, and a reused feature carries that to the later steps)
@pytest.fixture(scope="module", params=[("random:sd15", 512, "fp32", 1), ("random:sdxl", 1024, "fp16", 12)])
def engine(request):
    model, size, dtype, levels = request.param
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((size, size),), prewarm=False)
    with Engine(model=model, device=DEVICE, dtype=dtype, mode="graph", graphs=cfg) as e:
        yield e, levels


def test_mixed_cached_rows_equal_each_alone_on_the_gpu(engine):
    engine, levels = engine
    reqs = [engine.make_request("a red fox", num_inference_steps=12, seed=40 + i, sampler=["euler", "dpmpp_2m"][i % 2],
                                extras=None if c is None else {"step_cache": c}) for i, c in enumerate(CACHES)]
    alone = [engine.run(r).arrays for r in reqs]
    started = threading.Event()
    futures = [engine.submit(r, on_progress=lambda *a: started.set()) for r in reqs[:2]]
    started.wait(120)
    futures += [engine.submit(r) for r in reqs[2:]]
    worst = [float(np.abs(f.result(timeout=600).arrays - ref).max()) * 255 for f, ref in zip(futures, alone)]
    print(f"DeepCache rows together vs alone ({engine.model.dtype}, levels): {worst}")
    assert max(worst) <= levels, worst
    assert np.abs(alone[1] - alone[0]).max() > 1 / 255  # cached rows did reuse features
    # the steps replayed the step graphs (those with cache rows their keys' own), and no capture failed
    table = [r for r in engine.runner.graph_table() if r["kind"].startswith("step")]
    assert not [r for r in table if r["status"] == "failed"], table
    assert sum(r["replays"] or 0 for r in table) > 0
