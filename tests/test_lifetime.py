"""Graph lifetime on the CPU (emulated graphs): invalidation drops graphs between steps and counts it, keys
captured on first use are counted, and prompt embeddings are keyed by the text encoders' weights version."""

import copy

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig


def test_invalidate_drops_graphs_and_they_come_back_on_demand(tiny_engine):
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as e:
        first = e.generate("a cat", num_inference_steps=3, seed=1).arrays
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        # one guided image: two denoiser rows, bucket 2
        assert rows[("step", 2)]["status"] == "captured" and rows[("step", 2)]["on_demand"] == 0  # prewarmed
        e.invalidate("step")
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        assert [rows[("step", b)]["status"] for b in (1, 2)] == ["pending", "pending"]
        assert [rows[("step", b)]["invalidations"] for b in (1, 2)] == [1, 1]
        assert rows[("text", 1)]["status"] == "captured" and rows[("text", 1)]["invalidations"] == 0
        again = e.generate("a cat", num_inference_steps=3, seed=1).arrays
        rows = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
        assert rows[("step", 2)]["status"] == "captured" and rows[("step", 2)]["on_demand"] == 1
        assert rows[("step", 1)]["status"] == "pending"  # never needed since
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


def test_invalidate_from_the_loop_thread_runs_at_once(tiny_engine):
    """A step listener (the loop thread) that invalidates must not wait for the loop, i.e. for itself."""
    with Engine(model=tiny_engine.model, device="cpu") as e:
        calls = []

        def listener(plan, seconds):
            if not calls:
                e.invalidate("text")
                calls.append(e.runner.weights_version["text"])
        e.step_listeners.append(listener)
        e.generate("a cat", num_inference_steps=2, seed=1)
        assert calls == [1]


def test_abort_by_handle_leaves_a_later_request_with_the_same_id_alone(tiny_engine):
    with Engine(model=tiny_engine.model, device="cpu") as e:
        first = object()
        later = e.make_request("a cat", num_inference_steps=3, seed=1, request_id="same")
        future = e.submit(later)
        assert e.core.abort("same", sink=first) is False  # not the request that sink answers for
        assert future.result().request_id == "same"


def test_graph_mode_max_rows_below_the_largest_bucket(tiny_engine):
    import pytest

    from diffgraph.engine.model_runner import ModelRunner

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated", prewarm=False)
    runner = ModelRunner(tiny_engine.model, mode="graph", graphs=cfg, max_rows=2)
    assert runner.max_rows == 2 and runner.graph_config.batch_buckets == (1, 2)
    assert [r["bucket"] for r in runner.graph_table() if r["kind"] == "step"] == [1, 2]
    with pytest.raises(ValueError, match="max_rows 3 is not a batch bucket"):
        ModelRunner(tiny_engine.model, mode="graph", graphs=cfg, max_rows=3)


def test_a_replaced_vae_gets_the_compiled_decoders_form():
    """`invalidate("vae")` gives a VAE that replaces the model's what the graph set gave the first decoder (the
    compile tier's per-channel group norms on CUDA: set here by hand on a CPU engine), and its images stay the same."""
    from diffgraph.graphs.group_norm import ChannelGroupNorm, use_channel_group_norms
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model="random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg) as e:
        kw = dict(num_inference_steps=2, seed=3)
        before = e.generate("a cat", **kw).arrays
        e.runner.graphs.decoder_form = use_channel_group_norms
        e.model.vae = copy.deepcopy(e.model.vae)
        norms = [m for m in e.model.vae.decoder.modules() if isinstance(m, torch.nn.GroupNorm)]
        assert norms and not any(isinstance(m, ChannelGroupNorm) for m in norms)
        e.invalidate("vae")
        assert all(type(m) is ChannelGroupNorm for m in norms)
        np.testing.assert_array_equal(e.generate("a cat", **kw).arrays, before)


def test_a_replaced_unet_serves_its_own_weights_unless_the_engine_gave_the_old_one_adapters():
    """A replaced UNet gets what the graph set gave the first (the compile tier's channels-last convolution weights
    on CUDA: set here by hand on a CPU engine), and its weights make the images; an engine that gave the old UNet
    adapters refuses it by name."""
    from functools import partial

    from diffgraph.engine.graph_setup import set_conv_layout
    kw = dict(num_inference_steps=2, seed=4)
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model="random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg) as e:
        before = e.generate("a cat", **kw).arrays
        e.runner.graphs.denoiser_form = partial(set_conv_layout, channels_last=True)
        new = copy.deepcopy(e.model.denoiser)
        with torch.no_grad():
            new.conv_in.weight.mul_(1.5)
        e.model.denoiser = new
        e.invalidate("step")
        assert new.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
        after = e.generate("a cat", **kw).arrays
        e.invalidate("step")  # the new UNet is the engine's own now
    assert np.abs(after - before).max() > 0.02
    with Engine(model=e.model, device="cpu") as fresh:
        np.testing.assert_array_equal(fresh.generate("a cat", **kw).arrays, after)
    with Engine(model="random:tiny", device="cpu", dtype="fp32", max_loras=4) as e:
        e.model.denoiser = copy.deepcopy(e.model.denoiser)  # without the adapter slots' side paths
        with pytest.raises(ValueError, match="model.unet was replaced.*LoRA adapters.*build a new Engine"):
            e.invalidate("step")
        e.invalidate("text")  # other kinds go on


def test_a_replaced_text_encoder_makes_the_prompts_unless_the_engine_gave_the_old_one_lora_side_paths():
    """A text encoder replaced in `model.text_encoders` encodes the prompts after `invalidate("text")` (a fresh
    engine on the same model gives the same image); an engine whose LoRA slots gave the old encoder side paths
    refuses it by name (its adapters' text parts would be dropped silently), and the UNet's kind goes on."""
    kw = dict(num_inference_steps=2, seed=6)
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        before = e.generate("a red fox", **kw).arrays
        new = copy.deepcopy(e.model.text_encoders[0])
        with torch.no_grad():
            dict(new.named_parameters())["final_layer_norm.weight"].mul_(3.0)
        e.model.text_encoders[0] = new
        e.invalidate("text")
        after = e.generate("a red fox", **kw).arrays
    assert np.abs(after - before).max() > 0.02
    with Engine(model=e.model, device="cpu") as fresh:
        np.testing.assert_array_equal(fresh.generate("a red fox", **kw).arrays, after)
    with Engine(model="random:tiny", device="cpu", dtype="fp32", max_loras=4) as e:
        e.model.text_encoders[0] = copy.deepcopy(e.model.text_encoders[0])
        with pytest.raises(ValueError, match=r"model.text_encoders\[0\] was replaced.*LoRA adapters.*build a new Engine"):
            e.invalidate()
        e.invalidate("step")


def _close_in_result_callback(engine, request):
    """Submits `request` with a done callback that closes `engine` (on the image thread that answers it); returns
    what the callback saw: its thread's name and the error close() raised, once the callback has ended."""
    import threading
    seen, ended = {}, threading.Event()

    def close_it(_future):
        seen["thread"] = threading.current_thread().name
        try:
            engine.close(timeout=60)  # (a failure guard: the happy path never waits for it)
            seen["error"] = None
        except BaseException as e:  # what the engine raised into the caller's callback
            seen["error"] = repr(e)
        seen["finished"] = engine.core._finished.is_set()
        ended.set()
    future = engine.submit(request)
    future.add_done_callback(close_it)
    assert ended.wait(120), "close() from the result callback did not return"
    return future, seen


def test_close_from_a_result_callback_on_the_image_thread_stops_the_engine_without_joining_itself(tiny_engine):
    e = Engine(model=tiny_engine.model)
    future, seen = _close_in_result_callback(e, e.make_request("a cat", num_inference_steps=2, seed=1, width=64,
                                                                height=64))
    assert seen == {"thread": seen["thread"], "error": None, "finished": True}
    assert seen["thread"].startswith("diffgraph-images")
    assert future.result().arrays.shape == (1, 64, 64, 3)
    assert not e.ready and e.core.previews._pool._shutdown  # the preview thread is let go too
    e.close()  # again, from the caller: nothing left to do


def test_close_from_the_only_image_thread_while_held_rows_wait_for_it_does_not_deadlock(tiny_engine):
    """One image thread, a backlog bound of 0: the loop's last decode (a batch row held for companions) would wait
    for the image thread to deliver, while that thread waits in close() for the loop to finish."""
    import dataclasses
    e = Engine(model=tiny_engine.model, image_threads=1, grow_fill=0.0)
    e.core.retirement.max_backlog = 0

    def request(steps, seed, priority):
        r = e.make_request("a cat", num_inference_steps=steps, seed=seed, width=64, height=64, guidance_scale=1.0)
        return dataclasses.replace(r, priority=priority, job="j" if priority == "batch" else None)
    gate = __import__("threading").Event()
    held = e.core.call_between_steps(lambda: gate.wait(60))  # all three admitted at one step
    batch = [e.submit(request(1, 1, "batch")), e.submit(request(50, 2, "batch"))]
    interactive = request(2, 3, "interactive")
    gate.set()
    held.result(60)
    _, seen = _close_in_result_callback(e, interactive)
    assert seen["error"] is None and seen["finished"]  # the loop finished before close() returned
    assert batch[0].result(60).arrays.shape == (1, 64, 64, 3)  # the held row was decoded and answered
    with pytest.raises(Exception, match="closed"):
        batch[1].result(60)
