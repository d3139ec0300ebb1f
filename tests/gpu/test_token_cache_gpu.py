"""GPU test (marker `gpu`) of Z-Image's step cache (models/families/token_cache.py) on the trained `digits-zimage` in
fp32 graph mode: every step replays a CUDA graph, those with TaylorSeer rows their own variants (captured at first
use) beside the uncached steps'; cached rows (two intervals, both orders) and uncached ones submitted together equal
each alone within 1 uint8 level (in fp32, so a batch's other GEMM tiling is far below a level: in bf16 it alone moves
this trained model's images by up to 3 levels, which would hide a row mixed up with another), and a cached image
differs from the uncached one (trained weights: the forecast is not a copy of a zero output). A first-block row (its
steps two-phase and eager, its decisions copied to the host) beside a TaylorSeer row and an uncached one equals
itself alone within 1 level."""

import os
import threading

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig
from diffgraph.models import presets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(presets.shipped_preset_folder("digits-zimage") is None,
                                                  reason="the trained digits-zimage asset is absent")]
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
CACHES = [None, {"method": "taylorseer", "interval": 2, "order": 1}, {"method": "taylorseer", "interval": 3,
                                                                      "order": 2}, "auto"]
FIRST_BLOCK = {"method": "first_block", "threshold": 0.15}


def _requests(engine, caches, words):
    return [engine.make_request(f"a handwritten digit {w}", width=64, height=64, seed=40 + i,
                                extras=None if c is None else {"step_cache": c})
            for i, (c, w) in enumerate(zip(caches, words))]


def _together(engine, reqs, alone):
    """Each request's worst difference (levels) from its image alone, the first two submitted, the rest joining
    the running batch."""
    started = threading.Event()
    futures = [engine.submit(r, on_progress=lambda *a: started.set()) for r in reqs[:2]]
    started.wait(120)
    futures += [engine.submit(r) for r in reqs[2:]]
    return [float(np.abs(f.result(timeout=600).arrays - ref).max()) * 255 for f, ref in zip(futures, alone)]


def test_mixed_cached_rows_equal_each_alone_on_the_gpu():
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False)
    with Engine(model="digits-zimage", device=DEVICE, dtype="fp32", mode="graph", graphs=cfg) as engine:
        reqs = _requests(engine, CACHES, ("one", "two", "three", "four"))
        alone = [engine.run(r).arrays for r in reqs]
        plain = engine.run(engine.make_request("a handwritten digit two", width=64, height=64, seed=41)).arrays
        worst = _together(engine, reqs, alone)
        print(f"step-cached Z-Image rows together vs alone (fp32, levels): {worst}")
        assert max(worst) <= 1.0, worst
        assert np.abs(alone[1] - plain).max() > 1 / 255
        engine.core.call_between_steps(lambda: None).result()  # the last step counted
        table = [r for r in engine.runner.graph_table() if r["kind"].startswith("step")]
        assert not [r for r in table if r["status"] == "failed" or r["eager_fallbacks"]], table
        assert sum(r["replays"] for r in table) == engine.core.stats["steps"]  # no step ran eagerly
        cached = {r["kind"] for r in table if r["replays"] and "step_cache" in r["kind"]}
        assert {"step_step_cache_all", "step_step_cache_run0"} <= cached, cached  # full and forecast-only steps


def test_a_first_block_row_beside_other_rows_equals_itself_alone_on_the_gpu():
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False)
    with Engine(model="digits-zimage", device=DEVICE, dtype="fp32", mode="graph", graphs=cfg) as engine:
        reqs = _requests(engine, [FIRST_BLOCK, CACHES[1], None], ("five", "six", "seven"))
        alone = [engine.run(r).arrays for r in reqs]
        worst = _together(engine, reqs, alone)
        print(f"a first-block row with a TaylorSeer and a plain row, together vs alone (fp32, levels): {worst}")
        assert max(worst) <= 1.0, worst
