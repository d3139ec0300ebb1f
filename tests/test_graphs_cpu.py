"""Graph dispatch on the CPU with the emulated backend: buckets, padding, fallback, the table, GraphedUNet."""

import numpy as np
import pytest
import torch

from diffgraph.config import GraphConfig, parse_buckets, parse_resolutions
from diffgraph.engine.model_runner import ModelRunner
from diffgraph.features.base import Admission
from diffgraph.request import GenerationRequest
from diffgraph.models.families.base import select_row
from diffgraph.graphs.graphed_unet import GraphedUNet


def test_bucket_choice():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16))
    assert [cfg.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, None]
    assert parse_buckets("16, 4,1,4") == (1, 4, 16)
    assert parse_resolutions("512x768,64x64") == ((768, 512), (64, 64))
    with pytest.raises(ValueError, match="positive integers"):
        parse_buckets("0,2")
    with pytest.raises(ValueError, match="multiples of 8"):
        parse_resolutions("500x512")


@pytest.fixture()
def emulated_worker(tiny_engine):
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    return ModelRunner(tiny_engine.model, mode="graph", graphs=cfg)


def _fill(worker, key, n, seed):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn((n, *worker.latent_shape(key)), generator=g)
    cond = worker.encode_texts(["a cat"] * n)
    uncond = worker.adapter.negative(worker.model, worker.encode_texts([""] * n), [None] * n)
    request = GenerationRequest.create("a cat", width=key[1], height=key[0], guidance_scale=1.0)
    for i in range(n):
        worker.write_rows(key, i, Admission(request, 1), (select_row(cond, i), select_row(uncond, i), None),
                          lat[i:i + 1])
    return lat


def _coefs(worker, n, step=3):
    """Step `step` of a 10-step plan for n rows that run one denoiser branch (guidance 1)."""
    plan = worker.plan_for("dpmpp_2m", "karras", 10, (64, 64))
    request = GenerationRequest.create("a cat", width=64, height=64, guidance_scale=1.0, num_inference_steps=10)
    return np.repeat(worker.program.request_coefs(request, plan.coefs, plan.step_index)[step][None], n, 0)


def _step(worker, key, n):
    """One step of n one-branch rows; True when it ran as a graph replay."""
    before = sum(r["replays"] for r in worker.graph_table())
    worker.step(key, _coefs(worker, n), [(i, 1, 1) for i in range(n)], None)
    return sum(r["replays"] for r in worker.graph_table()) > before


def test_padding_rows_never_change_live_rows(emulated_worker, tiny_engine):
    """3 live rows run in bucket 4; row 3 holds a finished row's leftovers; live rows equal an eager run of 3 rows."""
    key = (64, 64)
    _fill(emulated_worker, key, 3, seed=0)
    buf = emulated_worker.buffers(key)
    buf.x[3] = 1e6
    buf.d_prev[3] = -1e6
    buf.cond("embeds")[3] = buf.cond("embeds")[0] * 3
    eager = ModelRunner(tiny_engine.model, mode="eager")
    _fill(eager, key, 3, seed=0)
    assert _step(emulated_worker, key, 3) is True
    assert _step(eager, key, 3) is False
    # batch 4 vs 3 changes CPU matmul blocking: equal up to float rounding
    torch.testing.assert_close(emulated_worker.buffers(key).x[:3], eager.buffers(key).x[:3], atol=1e-5, rtol=0)
    assert torch.isfinite(buf.x[3]).all() and float(buf.x[3].abs().max()) == 0.0
    table = {(r["kind"], r["bucket"]): r for r in emulated_worker.graph_runner.table()}
    assert table[("step", 4)]["replays"] == 1 and table[("step", 4)]["status"] == "captured"
    assert table[("step", 1)]["status"] == "pending"  # captured on first use only


def test_uncovered_shapes_run_eagerly_and_are_counted(emulated_worker):
    key = (64, 96)  # not a configured resolution
    _fill(emulated_worker, key, 2, seed=1)
    assert _step(emulated_worker, key, 2) is False
    rows = [r for r in emulated_worker.graph_runner.table() if r["status"] == "uncovered"]
    assert {(r["height"], r["width"], r["eager_fallbacks"]) for r in rows} == {(64, 96, 1)}
    # more rows than the largest bucket cannot happen in graph mode: the runner holds at most that many rows
    assert emulated_worker.max_rows == 4 and emulated_worker.buffers((64, 64)).num_rows == 4


def test_max_rows_is_the_largest_bucket_and_never_more(tiny_engine):
    """Engine(graphs=GraphConfig(batch_buckets=(1, 2, 4))) never runs more than 4 rows in a step (it used to admit
    16 and run 9 of them eagerly)."""
    from diffgraph import Engine
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated", prewarm=False)
    with pytest.raises(ValueError, match="above the largest batch bucket 4"):
        ModelRunner(tiny_engine.model, mode="graph", graphs=cfg, max_rows=16)
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as e:
        sizes = []
        costs = []
        e.step_listeners.append(lambda plan, seconds: (sizes.append(plan.n_rows), costs.append(plan.cost_rows)))
        # buckets count denoiser rows: a guidance-free image costs one, a classifier-free guided one two
        futures = [e.submit(e.make_request("a cat", num_images=n, num_inference_steps=3, seed=i, guidance_scale=g))
                   for i, (n, g) in enumerate(((3, 1.0), (2, 7.5), (4, 0.0), (1, 7.5), (1, 1.0)))]
        results = [f.result() for f in futures]
        with pytest.raises(ValueError, match="num_images 5 exceeds this engine's largest batch bucket 4"):
            e.make_request("a cat", num_images=5)
        with pytest.raises(ValueError, match="6 denoiser rows: classifier-free guidance costs 2 per image; use "
                                             "num_images <= 2"):
            e.submit(e.make_request("a cat", num_images=3, guidance_scale=7.5))
    assert [len(r) for r in results] == [3, 2, 4, 1, 1]
    assert sizes and max(sizes) <= 4 and sum(sizes) == 3 * 11 and max(costs) <= 4
    table = {(r["kind"], r["bucket"]): r for r in e.graph_table()}
    assert sum(r["replays"] for k, r in table.items() if k[0] == "step") == len(sizes)  # every step a replay


def test_capture_failure_falls_back_and_keeps_serving(emulated_worker, monkeypatch, tiny_engine):
    runner = emulated_worker.graph_runner
    real = runner._capture_emulated

    def failing(g, key, stats):
        if key == ("step", 64, 64, 2):
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(g, key, stats)

    monkeypatch.setattr(runner, "_capture_emulated", failing)
    key = (64, 64)
    _fill(emulated_worker, key, 2, seed=2)
    eager = ModelRunner(tiny_engine.model, mode="eager")
    _fill(eager, key, 2, seed=2)
    for _ in range(2):
        assert _step(emulated_worker, key, 2) is False
        _step(eager, key, 2)
    torch.testing.assert_close(emulated_worker.buffers(key).x[:2], eager.buffers(key).x[:2], atol=0, rtol=0)
    row = next(r for r in runner.table() if r["kind"] == "step" and r["bucket"] == 2)
    assert row["status"] == "failed" and "not permitted" in row["error"] and row["eager_fallbacks"] == 2
    # other keys still capture and replay
    _fill(emulated_worker, key, 1, seed=3)
    assert _step(emulated_worker, key, 1) is True


def test_verify_records_difference(tiny_engine):
    cfg = GraphConfig(batch_buckets=(2,), resolutions=((64, 64),), backend="emulated", verify=True)
    w = ModelRunner(tiny_engine.model, mode="graph", graphs=cfg)
    w.prewarm()
    rows = {(r["kind"], r["bucket"]): r for r in w.graph_runner.table()}
    assert rows[("step", 2)]["verify_max_abs"] == 0.0
    assert rows[("text", 2)]["status"] == "captured" and rows[("vae", 2)]["status"] == "captured"


def test_graphed_unet_in_stock_pipeline_equals_plain(tiny_engine):
    pipe = tiny_engine.diffusers_pipeline("euler", "default")
    kwargs = dict(num_inference_steps=4, guidance_scale=7.5, output_type="np", width=64, height=64)
    ref = pipe("a cat", num_images_per_prompt=3, generator=torch.Generator().manual_seed(3), **kwargs).images
    plain = pipe.unet
    try:
        pipe.unet = GraphedUNet(plain, batch_buckets=(2, 8), resolutions=[(64, 64)],
                                config=GraphConfig(batch_buckets=(2, 8), backend="emulated"))
        out = pipe("a cat", num_images_per_prompt=3, generator=torch.Generator().manual_seed(3), **kwargs).images
        table = pipe.unet.graph_table()
    finally:
        pipe.unet = plain
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    row = next(r for r in table if r["bucket"] == 8)
    assert row["replays"] == 4  # batch 6 (3 images x CFG) padded to 8, every step replayed


def test_graphed_unet_follows_lora_and_weight_changes(tiny_engine, tmp_path):
    """load_lora_weights, set_adapters, fuse_lora, unload_lora_weights and a replaced parameter change what the
    graphs depend on: each drops them (recaptured on next use, counted); an in-place copy_ keeps them. The images
    equal the plain pipeline's after every change (the GPU test checks the same with real CUDA graphs)."""
    import copy

    from lora_util import _write_diffusers

    path = str(tmp_path / "a.safetensors")
    _write_diffusers(tiny_engine, path, rank=4, seed=0)
    _write_diffusers(tiny_engine, str(tmp_path / "b.safetensors"), rank=4, seed=1)
    pipe = copy.deepcopy(tiny_engine.diffusers_pipeline("euler", "default"))
    kwargs = dict(num_inference_steps=3, guidance_scale=7.5, output_type="np", width=64, height=64)
    plain = pipe.unet
    graphed = GraphedUNet(plain, batch_buckets=(2,), resolutions=[(64, 64)],
                          config=GraphConfig(batch_buckets=(2,), backend="emulated"))

    def both() -> None:
        pipe.unet = plain
        ref = pipe("a cat", generator=torch.Generator().manual_seed(3), **kwargs).images
        pipe.unet = graphed
        out = pipe("a cat", generator=torch.Generator().manual_seed(3), **kwargs).images
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)

    both()
    steps = [("load", lambda: pipe.load_lora_weights(path, adapter_name="a"), 1),
             ("second adapter", lambda: pipe.load_lora_weights(str(tmp_path / "b.safetensors"), adapter_name="b"), 1),
             ("set_adapters", lambda: pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 1.0]), 1),
             ("copy_", lambda: plain.conv_in.weight.data.copy_(plain.conv_in.weight * 1.1), 0),
             ("fuse", lambda: pipe.fuse_lora(lora_scale=0.7), 1),
             ("unfuse", lambda: pipe.unfuse_lora(), 1),
             ("unload", lambda: pipe.unload_lora_weights(), 1),
             ("new parameter", lambda: setattr(plain.conv_in, "weight", torch.nn.Parameter(plain.conv_in.weight * 0.9)), 1)]
    for name, change, recaptures in steps:
        pipe.unet = plain
        before = graphed.recaptures
        change()
        both()
        assert graphed.recaptures - before == recaptures, name
