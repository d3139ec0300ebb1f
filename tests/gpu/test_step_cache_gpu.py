"""GPU tests of step caching (models/families/unet_cache.py) on real-size random UNets in graph mode: steps with
DeepCache rows replay CUDA graphs of their own variants (captured at first use) beside the uncached steps' (no step
runs eagerly); mixed cached (several intervals and branches, uniform and
non-uniform) and uncached requests together equal each alone (fp16 tolerance), and a cached image differs from the
uncached one by a bounded amount (random weights: only that caching changed it)."""

import os
import threading

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
CACHES = [None, {"method": "deepcache", "interval": 3}, {"method": "deepcache", "interval": 2, "branch": 2},
          {"method": "deepcache", "interval": 4, "branch": 5, "schedule": "nonuniform", "center": 8}]


@pytest.fixture(scope="module", params=[("random:sd15", 512), ("random:sdxl", 1024)])
def engine(request):
    model, size = request.param
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((size, size),), prewarm=False)
    with Engine(model=model, device=DEVICE, dtype="fp16", mode="graph", graphs=cfg) as e:
        yield e


def test_mixed_cached_rows_equal_each_alone_on_the_gpu(engine):
    reqs = [engine.make_request("a red fox", num_inference_steps=12, seed=40 + i, sampler=["euler", "dpmpp_2m"][i % 2],
                                extras=None if c is None else {"step_cache": c}) for i, c in enumerate(CACHES)]
    alone = [engine.run(r).arrays for r in reqs]
    started = threading.Event()
    futures = [engine.submit(r, on_progress=lambda *a: started.set()) for r in reqs[:2]]
    started.wait(120)
    futures += [engine.submit(r) for r in reqs[2:]]
    for f, ref in zip(futures, alone):
        assert np.abs(f.result(timeout=600).arrays - ref).max() <= 2 / 255
    assert np.abs(alone[1] - alone[0]).max() > 1 / 255  # cached rows did reuse features
    # every step replayed a CUDA graph: the cached steps their own variants ("step_step_cache_<key>"), captured on
    # the GPU (none failed), none run eagerly (an uncovered shape, a failed capture)
    table = [r for r in engine.runner.graph_table() if r["kind"].startswith("step")]
    cached = [r for r in table if "step_cache" in r["kind"] and r["replays"]]
    assert {r["kind"] for r in cached} >= {"step_step_cache_b0", "step_step_cache_b0k0"}  # full and cached steps
    assert any(r["kind"].count("_b") >= 2 for r in cached)  # rows at several branches in one replay
    assert not [r for r in table if r["status"] == "failed" or r["eager_fallbacks"]], table
    engine.core.call_between_steps(lambda: None).result()  # the last step counted
    assert sum(r["replays"] for r in table) == engine.core.stats["steps"]
