"""GPU test (marker `gpu`) of Z-Image's step cache (models/families/token_cache.py) on the trained `digits-zimage` in
fp32 graph mode: every step replays a CUDA graph, those with TaylorSeer rows their own variants (captured at first
use) beside the uncached steps'; cached rows (two intervals, both orders) and uncached ones submitted together equal
each alone within 1 uint8 level (in fp32, so a batch's other GEMM tiling is far below a level: in bf16 it alone moves
this trained model's images by up to 3 levels, which would hide a row mixed up with another), and a cached image
differs from the uncached one (trained weights: the forecast is not a copy of a zero output). A first-block row (its
steps two-phase and eager, its decisions copied to the host) beside a TaylorSeer row and an uncached one equals
itself alone within 1 level. FLUX.2 (the tiny random klein, fp32 graph mode): a plain request first, so the group's
step graphs are captured before any cache row allocated the cache's lazy fields, then TaylorSeer rows of two
intervals beside plain ones, and a first-block row beside them, each equal to itself alone within 1 level."""

import os
import threading

import numpy as np
import pytest

from diffgraph import Engine, GraphConfig
from diffgraph.models import presets

pytestmark = pytest.mark.gpu
needs_digits = pytest.mark.skipif(presets.shipped_preset_folder("digits-zimage") is None,
                                  reason="the trained digits-zimage asset is absent")
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


@needs_digits
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


@needs_digits
def test_a_first_block_row_beside_other_rows_equals_itself_alone_on_the_gpu():
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False)
    with Engine(model="digits-zimage", device=DEVICE, dtype="fp32", mode="graph", graphs=cfg) as engine:
        reqs = _requests(engine, [FIRST_BLOCK, CACHES[1], None], ("five", "six", "seven"))
        alone = [engine.run(r).arrays for r in reqs]
        worst = _together(engine, reqs, alone)
        print(f"a first-block row with a TaylorSeer and a plain row, together vs alone (fp32, levels): {worst}")
        assert max(worst) <= 1.0, worst


def test_flux2_cached_rows_after_plain_ones_equal_each_alone_on_the_gpu():
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((128, 128),), prewarm=False)
    with Engine(model="random:flux2-klein-tiny", device=DEVICE, dtype="fp32", mode="graph", graphs=cfg) as engine:
        def make(cache, seed):
            return engine.make_request("a red fox in the snow", width=128, height=128, seed=seed,
                                       num_inference_steps=8, extras=None if cache is None else {"step_cache": cache})
        reqs = [make(c, 50 + i) for i, c in enumerate([None] + CACHES[1:3] + [None])]
        alone = [engine.run(r).arrays for r in reqs]  # the plain one first: graphs before the lazy cache fields
        assert np.abs(alone[1] - engine.run(make(None, 51)).arrays).max() > 1 / 255
        worst = _together(engine, reqs, alone)
        print(f"step-cached FLUX.2 rows together vs alone (fp32, levels): {worst}")
        assert max(worst) <= 1.0, worst
        engine.core.call_between_steps(lambda: None).result()
        table = [r for r in engine.runner.graph_table() if r["kind"].startswith("step")]
        assert not [r for r in table if r["status"] == "failed" or r["eager_fallbacks"]], table
        assert sum(r["replays"] for r in table) == engine.core.stats["steps"]
        first = [make({"method": "first_block", "threshold": 1.05}, 60), make(CACHES[1], 61), make(None, 62)]
        alone = [engine.run(r).arrays for r in first]
        worst = _together(engine, first, alone)
        print(f"a FLUX.2 first-block row with a TaylorSeer and a plain row, together vs alone (fp32, levels): {worst}")
        assert max(worst) <= 1.0, worst
