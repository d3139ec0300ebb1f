"""Graph lifetime on the CPU (emulated graphs): invalidation drops graphs between steps and counts it, keys
captured on first use are counted, and prompt embeddings are keyed by the text encoders' weights version."""

import numpy as np
import torch

from diffgraph import Engine, GraphConfig


def test_invalidate_drops_graphs_and_they_come_back_on_demand(tiny_engine):
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as e:
        first = e.generate("a cat", num_inference_steps=3, seed=1).arrays
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        assert rows[("step", 1)]["status"] == "captured" and rows[("step", 1)]["on_demand"] == 0  # prewarmed
        e.invalidate("step")
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        assert [rows[("step", b)]["status"] for b in (1, 2)] == ["pending", "pending"]
        assert [rows[("step", b)]["invalidations"] for b in (1, 2)] == [1, 1]
        assert rows[("text", 1)]["status"] == "captured" and rows[("text", 1)]["invalidations"] == 0
        again = e.generate("a cat", num_inference_steps=3, seed=1).arrays
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        assert rows[("step", 1)]["status"] == "captured" and rows[("step", 1)]["on_demand"] == 1
        assert rows[("step", 2)]["status"] == "pending"  # never needed since
        np.testing.assert_array_equal(again, first)


def test_prompt_embeddings_follow_the_text_encoder_weights():
    with Engine(model="random:tiny", device="cpu") as e, Engine(model="random:tiny", device="cpu") as fresh:
        kw = dict(num_inference_steps=3, seed=2)
        before = e.generate("a red fox", **kw).arrays
        hits = e.stats["prompt_cache_hits"]
        assert np.array_equal(e.generate("a red fox", **kw).arrays, before)
        assert e.stats["prompt_cache_hits"] == hits + 2  # prompt and negative prompt
        with torch.no_grad():
            for engine in (e, fresh):
                dict(engine.model.text_encoders[0].named_parameters())["final_layer_norm.weight"].mul_(3.0)
        stale = e.generate("a red fox", **kw).arrays  # the cache still holds the old weights' embeddings...
        assert np.array_equal(stale, before)
        misses = e.stats["prompt_cache_misses"]
        e.invalidate("text")  # ...until the engine is told
        after = e.generate("a red fox", **kw).arrays
        assert e.stats["prompt_cache_misses"] == misses + 2
        assert np.abs(after - before).max() > 0.02
        np.testing.assert_array_equal(after, fresh.generate("a red fox", **kw).arrays)
