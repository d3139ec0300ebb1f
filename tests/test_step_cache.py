"""Step caching per row (models/families/unet_cache.py): DeepCache on the SD families' UNets.

The reference is the paper's algorithm written here on diffusers' own pipeline: the UNet runs whole at every
evaluation, and on a cached one a pre-hook on the up layer that consumes skip branch m's residual replaces the
hidden state entering it with the one kept at the last full evaluation (the deep path's output), so only the
shallow path's fresh values reach the output."""

import math

import numpy as np
import pytest
import torch

from diffgraph import Engine
from diffgraph.errors import ParamError
from diffgraph.models.families.unet_cache import (CacheKey, CacheRows, DeepCache, branch_shapes, cache_key,
                                                   cached_unet, full_evaluations, nonuniform_steps, read_step_cache,
                                                   residual_owners)
from diffgraph.request import GenerationRequest
from server_util import served

PROMPT = "a lighthouse at dusk"
SIZE = dict(width=64, height=64)


def _unet_inputs(model, rows=3, seed=0):
    u = model.denoiser
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, u.config.in_channels, 8, 12, generator=g)
    ehs = torch.randn(rows, 77, u.config.cross_attention_dim, generator=g)
    added = None
    if u.config.addition_embed_type == "text_time":
        added = {"text_embeds": torch.randn(rows, model.text_encoders[-1].config.projection_dim, generator=g),
                 "time_ids": torch.tensor([[64.0, 96, 0, 0, 64, 96]] * rows)}
    return x, torch.tensor([900.0, 500.0, 10.0][:rows]), ehs, added


def _rows(branch, reuse, store):
    """`CacheRows` of denoiser rows 0.. (their skip branch or -1, their reuse flag), slot = row."""
    return CacheRows(torch.tensor(branch) + 1, torch.tensor(reuse), torch.arange(len(branch)), store)


def _up_layer_at(unet, branch):
    """The up resnet consuming residual `branch` (diffusers pops the residuals deepest first)."""
    layers = [r for b in unet.up_blocks for r in b.resnets]
    return layers[len(layers) - 1 - branch]


@pytest.mark.parametrize("engine_name", ["tiny_engine", "tiny_xl_engine"])
def test_the_split_forward_equals_the_unet_and_reuses_exactly_the_kept_feature(engine_name, request):
    model = request.getfixturevalue(engine_name).model
    u = model.denoiser
    x, t, ehs, added = _unet_inputs(model)
    branches = len(residual_owners(u))
    shapes = branch_shapes(u, tuple(x.shape[1:]))
    size = max(math.prod(s) for s in shapes)
    with torch.no_grad():
        ref = u(x, t, encoder_hidden_states=ehs, added_cond_kwargs=added, return_dict=False)[0]
        none = _rows([-1] * 3, [False] * 3, torch.zeros(3, size))
        assert torch.equal(cached_unet(u, x, t, ehs, CacheKey(()), none, added=added), ref)
        for branch in range(branches):
            # a full evaluation keeping every row's feature: the UNet's output, the feature the hook sees
            store = torch.zeros(3, size)
            seen = []
            hook = _up_layer_at(u, branch).register_forward_pre_hook(
                lambda mod, args: seen.append(args[0][:, :shapes[branch][0]].clone()))
            u(x, t, encoder_hidden_states=ehs, added_cond_kwargs=added)
            hook.remove()
            save = CacheKey(((branch, None),))
            assert torch.equal(cached_unet(u, x, t, ehs, save, _rows([branch] * 3, [False] * 3, store), added=added),
                               ref)
            assert seen[0].shape[1:] == shapes[branch]
            torch.testing.assert_close(store[:, :seen[0][0].numel()].view(seen[0].shape), seen[0], rtol=0, atol=0)
            # row 1 reuses it at other inputs (gathered out of the deep path); rows 0 and 2 run whole
            x2 = x + 0.1
            reusing = _rows([-1, branch, -1], [False, True, False], store)
            out = cached_unet(u, x2, t, ehs, CacheKey(((branch, 2),)), reusing, added=added)
            plain = u(x2, t, encoder_hidden_states=ehs, added_cond_kwargs=added, return_dict=False)[0]
            torch.testing.assert_close(out[[0, 2]], plain[[0, 2]], rtol=0, atol=1e-5)
            hook = _up_layer_at(u, branch).register_forward_pre_hook(
                lambda mod, args: (torch.cat([seen[0][1:2].expand(3, -1, -1, -1),
                                              args[0][:, shapes[branch][0]:]], 1), *args[1:]))
            hooked = u(x2, t, encoder_hidden_states=ehs, added_cond_kwargs=added, return_dict=False)[0]
            hook.remove()
            torch.testing.assert_close(out[1], hooked[1], rtol=0, atol=1e-5)
            # not gathered (a step with per-row denoiser state: LoRA rows, image prompts), or gathered into more
            # rows than need it (the deep rows rounded up: the reusing row runs deep, its output dropped): the same
            for deep in (None, 3):
                torch.testing.assert_close(cached_unet(u, x2, t, ehs, CacheKey(((branch, deep),)), reusing,
                                                       added=added), out, rtol=0, atol=1e-5)
            assert (out[1] - plain[1]).abs().max() > 1e-4  # the kept feature, not a fresh one
            torch.testing.assert_close(store[:, :seen[0][0].numel()].view(seen[0].shape), seen[0], rtol=0, atol=0)


def test_the_step_key_counts_the_rows_going_deeper_per_branch_rounded_up():
    # rows: no cache, branch 0 reusing, branch 0 saving, branch 2 reusing, branch 2 reusing
    branch, reuse = np.array([-1, 0, 0, 2, 2]), np.array([False, True, False, True, True])
    assert cache_key(branch, reuse) == CacheKey(((0, 4), (2, 2)))  # 4 go past branch 0, 2 past branch 2
    assert cache_key(branch, reuse, gather=False) == CacheKey(((0, None), (2, None)))
    assert cache_key(np.array([0, 0]), np.array([False, False])) == CacheKey(((0, None),))  # all save: no split
    assert cache_key(np.array([1, 1, 1]), np.array([True] * 3)) == CacheKey(((1, 0),))  # none goes deeper
    assert cache_key(np.array([-1, -1]), np.array([False] * 2)) is None
    assert str(CacheKey(((0, 4), (2, None)))) == "_b0k4_b2"


def test_the_split_forward_adds_controlnet_residuals_as_the_unet_does(tiny_engine):
    from diffgraph.features.control import residual_shapes

    model = tiny_engine.model
    u = model.denoiser
    x, t, ehs, _ = _unet_inputs(model)
    g = torch.Generator().manual_seed(1)
    res = [torch.randn(3, *s, generator=g) for s in residual_shapes(u.config, tuple(x.shape[1:]))]
    kw = {"down_block_additional_residuals": res[:-1], "mid_block_additional_residual": res[-1]}
    size = max(math.prod(s) for s in branch_shapes(u, tuple(x.shape[1:])))
    with torch.no_grad():
        ref = u(x, t, encoder_hidden_states=ehs, return_dict=False, **kw)[0]
        store = torch.zeros(3, size)
        save = _rows([2] * 3, [False] * 3, store)
        assert torch.equal(cached_unet(u, x, t, ehs, CacheKey(((2, None),)), save, residuals=kw), ref)
        reuse = _rows([-1, 2, -1], [False, True, False], store)
        out = cached_unet(u, x, t, ehs, CacheKey(((2, 2),)), reuse, residuals=kw)  # the kept feature is fresh
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_the_plan_is_deepcache_s_uniform_and_nonuniform_schedules():
    np.testing.assert_array_equal(full_evaluations(DeepCache(interval=3), 8), [1, 0, 0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(full_evaluations(DeepCache(interval=1), 3), [1, 1, 1])
    # "auto": the cheapest setting of BENCHMARKS.md's quality table within its bounds, on digits and digits-xl alike
    assert read_step_cache("auto") == DeepCache(interval=2, branch=0, schedule="uniform")
    # DeepCache's sample_from_quad_center(50, 17, center=15, pow=1.4), its README's 50-step setting, run as published
    assert nonuniform_steps(50, 17, 15, 1.4) == [0, 3, 6, 8, 11, 13, 15, 17, 20, 22, 25, 28, 32, 35, 38, 42, 46]
    assert nonuniform_steps(20, 10, 10, 1.4) == [0, 3, 5, 7, 9, 10, 11, 13, 15, 17]
    full = full_evaluations(DeepCache(interval=4, schedule="nonuniform", center=3), 10)
    assert full[0] == 1 and full.sum() == 3


def _request(engine, cache=None, **kw):
    extras = {} if cache is None else {"step_cache": cache}
    return GenerationRequest.create(PROMPT, model=engine.info, extras=extras,
                                    **{"num_inference_steps": 6, "seed": 5, **SIZE, **kw})


def _together(engine, requests):
    """The requests' images, all admitted between the same two steps (they share every step)."""
    futures = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in requests)).result()
    return [f.result(timeout=600).arrays for f in futures]


def _reference(engine, spec, steps, seed, sampler="euler", guidance=None):
    """diffusers' pipeline with the UNet hooked as DeepCache describes (see the module's docstring)."""
    pipe = engine.diffusers_pipeline(sampler)
    u = pipe.unet
    up = _up_layer_at(u, spec.branch)
    full = full_evaluations(spec, steps)
    state = {"eval": 0, "kept": None}
    channels = branch_shapes(u, (4, 8, 8))[spec.branch][0]

    def pre(mod, args):
        if full[state["eval"]]:
            state["kept"] = args[0][:, :channels].clone()
            return None
        return (torch.cat([state["kept"], args[0][:, channels:]], 1), *args[1:])

    def count(mod, args, out):
        state["eval"] += 1
    hooks = [up.register_forward_pre_hook(pre), u.register_forward_hook(count)]
    try:
        return pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                    guidance_scale=engine.model.default_guidance if guidance is None else guidance,
                    output_type="np", **SIZE).images[0]
    finally:
        for h in hooks:
            h.remove()


def _levels(a, b):
    return np.abs(np.round(np.asarray(a) * 255) - np.round(np.asarray(b) * 255)).max()


@pytest.mark.parametrize("engine_name,cache", [
    ("tiny_engine", {"method": "deepcache", "interval": 3}),
    ("tiny_engine", {"method": "deepcache", "interval": 2, "branch": 2, "schedule": "nonuniform", "center": 2}),
    ("tiny_xl_engine", {"method": "deepcache", "interval": 3, "branch": 1}),
])
def test_deepcache_equals_the_paper_s_algorithm_on_diffusers_pipeline(engine_name, cache, request):
    engine = request.getfixturevalue(engine_name)
    out = engine.run(_request(engine, cache, sampler="euler", num_inference_steps=7)).arrays[0]
    ref = _reference(engine, read_step_cache(cache), 7, 5)
    plain = engine.run(_request(engine, sampler="euler", num_inference_steps=7)).arrays[0]
    assert _levels(out, ref) <= 1
    assert _levels(out, plain) > 1  # it cached something


def test_off_changes_no_image_and_interval_1_is_the_uncached_image(tiny_engine):
    plain = tiny_engine.run(_request(tiny_engine)).arrays
    for cache in ("off", {"method": "deepcache", "interval": 1, "branch": 3}):
        np.testing.assert_array_equal(tiny_engine.run(_request(tiny_engine, cache)).arrays, plain)


def test_cached_uncached_and_other_interval_rows_together_equal_each_alone(tiny_engine):
    requests = [_request(tiny_engine, {"method": "deepcache", "interval": 2}, seed=1, num_images=2),
                _request(tiny_engine, seed=2),
                _request(tiny_engine, {"method": "deepcache", "interval": 3, "branch": 1, "schedule": "nonuniform",
                                       "center": 2}, seed=3, sampler="heun", num_inference_steps=4),
                _request(tiny_engine, "auto", seed=4, guidance_scale=1.0)]
    alone = [tiny_engine.run(r).arrays for r in requests]
    together = _together(tiny_engine, requests)
    for a, b in zip(alone, together):
        assert _levels(a, b) <= 1
    assert _levels(alone[0][0], alone[0][1]) > 1


def test_an_evaluation_whose_cfg_branch_has_no_kept_feature_runs_full(tiny_engine):
    runner = tiny_engine.runner
    reuse = runner.program.columns["cache.reuse"]
    plan = runner.request_plan(_request(tiny_engine, {"method": "deepcache", "interval": 3}, num_inference_steps=9))
    np.testing.assert_array_equal(plan.coefs[:, reuse], [0, 1, 1, 0, 1, 1, 0, 1, 1])
    # guidance from step 5 on (a guidance interval): step 5 runs full (its second branch has no kept feature)
    late = _request(tiny_engine, {"method": "deepcache", "interval": 3}, num_inference_steps=9,
                    guidance_interval=(0.5, 1.0))
    plan = runner.request_plan(late)
    assert plan.branches.tolist() == [1] * 5 + [2] * 4
    np.testing.assert_array_equal(plan.coefs[:, reuse], [0, 1, 1, 0, 1, 0, 0, 1, 1])


BAD = [({"method": "teacache"}, "step_cache.method", "transformer"),
       ({"method": "tomesd"}, "step_cache.method", "unknown"),
       ({"method": "deepcache", "interval": 0}, "step_cache.interval", "out of range"),
       ({"method": "deepcache", "interval": 2.5}, "step_cache.interval", "integer"),
       ({"method": "deepcache", "branch": 9}, "step_cache.branch", "0..3"),
       ({"method": "deepcache", "schedule": "cosine"}, "step_cache.schedule", "uniform"),
       ({"method": "deepcache", "power": float("nan")}, "step_cache.power", "number"),
       ({"method": "deepcache", "every": 2}, "step_cache.every", "no field"),
       ("sometimes", "step_cache", "unknown"), (3, "step_cache", "must be")]


def test_bad_values_are_param_errors_naming_the_field(tiny_engine):
    for value, field, words in BAD:
        with pytest.raises(ParamError) as e:
            tiny_engine.submit(_request(tiny_engine, value))
        assert e.value.param == field and words in str(e.value) and "\n" not in str(e.value), (value, str(e.value))


def test_the_server_default_applies_is_recorded_and_bad_values_are_one_line_400s_over_http(tiny_engine):
    import argparse
    import base64

    from diffgraph.image_metadata import read_request

    from diffgraph.server import ServerConfig
    from diffgraph.server.cli import add_serve_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "random:tiny", "--step-cache", "auto"]))
    settings = config.engine_kwargs()["capability_settings"]
    assert settings == {"step_cache": {"step_cache": "auto"}}
    assert config_from_args(parser.parse_args([])).engine_kwargs()["capability_settings"] is None
    plain = tiny_engine.run(_request(tiny_engine)).arrays
    with Engine(model=tiny_engine.model, capability_settings=settings) as e:
        # the default is written into a request that names none (what its image's metadata records), not over "off"
        assert dict(_request(e).extras) == {"step_cache": "auto"} and e.info.extension_defaults == (("step_cache",
                                                                                                   "auto"),)
        assert dict(_request(e, "off").extras) == {"step_cache": "off"} and tiny_engine.info.extension_defaults == ()
        np.testing.assert_array_equal(e.run(_request(e)).arrays, e.run(_request(e, "auto")).arrays)
        # another engine over the same modules: its prompt cache may hold a prompt encoded in another batch, a float
        # apart (1e-6), so equal to far below a level
        np.testing.assert_allclose(e.run(_request(e, "off")).arrays, plain, atol=1e-5, rtol=0)
        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 4, "seed": 5}
        with served(e, ServerConfig(model="random:tiny", device="cpu")) as client:
            for value, field, words in BAD[:3]:
                r = client.post("/v1/images/generations", json={**body, "step_cache": value})
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == field and words in error["message"], r.text
                assert "\n" not in error["message"]
            auto = client.post("/v1/images/generations", json=body)
            off = client.post("/v1/images/generations", json={**body, "step_cache": "off"})
            assert auto.status_code == 200 and off.status_code == 200, off.text
            assert auto.json()["data"][0]["b64_json"] != off.json()["data"][0]["b64_json"]
            recorded = [read_request(base64.b64decode(r.json()["data"][0]["b64_json"]))["extras"] for r in (auto, off)]
            assert recorded == [{"step_cache": "auto"}, {"step_cache": "off"}]


@pytest.fixture
def graphed(monkeypatch):
    """Steps with cache rows replay their keys' graphs (`StepCacheRows.graphed`, the default, set here so that each
    test states it; on the emulated backend the graph machinery is checked)."""
    from diffgraph.models.families import unet_cache

    monkeypatch.setattr(unet_cache.StepCacheRows, "graphed", True)


def test_with_graphed_off_steps_with_cache_rows_run_eagerly_in_graph_mode_and_equal_the_eager_engine(tiny_engine,
                                                                                                   monkeypatch):
    from diffgraph.config import GraphConfig
    from diffgraph.models.families import unet_cache

    monkeypatch.setattr(unet_cache.StepCacheRows, "graphed", False)

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as g:
        request = _request(tiny_engine, {"method": "deepcache", "interval": 2}, num_inference_steps=4)
        np.testing.assert_allclose(g.run(request).arrays, tiny_engine.run(request).arrays, atol=1e-5, rtol=0)
        plain = _request(tiny_engine, None, num_inference_steps=4)
        np.testing.assert_allclose(g.run(plain).arrays, tiny_engine.run(plain).arrays, atol=1e-5, rtol=0)
        g.core.call_between_steps(lambda: None).result()
        assert _step_graphs(g) == {"step": (4, 0)}  # the plain request's steps replayed, the cached ones none
        assert g.core.stats["steps"] == 8


def _step_graphs(engine):
    """Per step graph kind that ran (cached ones: "step_step_cache_<key>"): its replays and the steps it ran eagerly
    (an uncovered shape: kind, bucket 0)."""
    out = {}
    for r in engine.runner.graph_table():
        if r["kind"].startswith("step"):
            replays, eager = out.get(r["kind"], (0, 0))
            out[r["kind"]] = (replays + (r["replays"] or 0), eager + (r["eager_fallbacks"] or 0))
    return {kind: counts for kind, counts in out.items() if counts != (0, 0)}


def test_in_graph_mode_steps_with_cache_rows_replay_their_graphs_and_equal_the_eager_engine(tiny_engine, graphed):
    from diffgraph.config import GraphConfig

    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as g:
        for cache, tiling in ((None, False), ({"method": "deepcache", "interval": 2}, False),
                              ({"method": "deepcache", "interval": 3, "branch": 2}, False),
                              ({"method": "deepcache", "interval": 2, "branch": 1}, True)):
            request = _request(tiny_engine, cache, num_inference_steps=4, tiling=tiling)
            # two engines: equal to far below a level (a prompt cached from another batch is a float apart)
            np.testing.assert_allclose(g.run(request).arrays, tiny_engine.run(request).arrays, atol=1e-5, rtol=0)
        # every step replayed a graph: full evaluations (every row keeps its feature) and cached ones (no row goes
        # deeper than its branch) each their own variant, captured at first use (a tiling row's: their tiling twins)
        assert _step_graphs(g) == {"step": (4, 0), "step_step_cache_b0": (2, 0), "step_step_cache_b0k0": (2, 0),
                                   "step_step_cache_b2": (2, 0), "step_step_cache_b2k0": (2, 0),
                                   "step_step_cache_b1_tiling": (2, 0), "step_step_cache_b1k0_tiling": (2, 0)}
        # a replaced denoiser drops the variants added while serving too (recaptured on next use)
        g.core.call_between_steps(lambda: g.runner.invalidate("step")).result()
        dropped = {r["kind"] for r in g.runner.graph_table() if r["invalidations"]}
        assert {"step_step_cache_b0k0", "step_step_cache_b1k0_tiling"} <= dropped


def test_in_graph_mode_mixed_cache_rows_replay_and_equal_each_alone(tiny_engine, graphed):
    from diffgraph.config import GraphConfig

    # 1 + 2 + 2 + 4 + 2 denoiser rows: padded buckets, rows at several branches, intervals and steps in one replay
    requests = [_request(tiny_engine, "auto", seed=4, guidance_scale=1.0),
                _request(tiny_engine, seed=2),
                _request(tiny_engine, {"method": "deepcache", "interval": 3, "branch": 1, "schedule": "nonuniform",
                                       "center": 2}, seed=3, sampler="heun", num_inference_steps=4),
                _request(tiny_engine, {"method": "deepcache", "interval": 2}, seed=1, num_images=2),
                _request(tiny_engine, {"method": "deepcache", "interval": 3, "branch": 3}, seed=6, sampler="dpmpp_2m")]
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as g:
        alone = [g.run(r).arrays for r in requests]
        g.core.call_between_steps(lambda: None).result()
        before, steps = _step_graphs(g), g.core.stats["steps"]
        together = _together(g, requests)
        g.core.call_between_steps(lambda: None).result()  # the last step's count is in (it follows the results)
        after, steps = _step_graphs(g), g.core.stats["steps"] - steps
    eager = [tiny_engine.run(r).arrays for r in requests]
    for a, b, c in zip(alone, together, eager):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        np.testing.assert_allclose(a, c, atol=1e-5, rtol=0)
    assert _levels(alone[3][0], alone[3][1]) > 1
    assert all(eager == 0 for _, eager in after.values())
    mixed = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after}
    assert sum(mixed.values()) == steps  # every step of the batch replayed a graph
    assert any("_b0k" in k and "_b1" in k and "_b3" in k for k, n in mixed.items() if n)  # gathered, three branches


def test_rows_done_at_a_shallow_branch_that_kept_every_row_give_way_at_a_deeper_one(tiny_engine, graphed):
    """At step 1 of these four (each guided: 8 denoiser rows) branch 0's stage keeps every row (6 go on: bucket 8) and
    branch 1's gathers 4: the rows that reuse at branch 0, still alive there, must give way to the rows that go on
    (the uncached row first); every row together equals itself alone."""
    from diffgraph.config import GraphConfig

    caches = [None, {"method": "deepcache", "interval": 3, "branch": 0}, {"method": "deepcache", "interval": 2,
              "branch": 1}, {"method": "deepcache", "interval": 4, "branch": 3}]
    requests = [_request(tiny_engine, c, seed=20 + i) for i, c in enumerate(caches)]
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg) as g:
        alone = [g.run(r).arrays for r in requests]
        together = _together(g, requests)
        kinds = set(_step_graphs(g))
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert "step_step_cache_b0_b1k4_b3k2" in kinds, kinds


def test_the_cli_caches_and_from_image_repeats_it(tmp_path):
    from PIL import Image

    from diffgraph.cli import main
    from diffgraph.image_metadata import read_request

    first, again, plain = (str(tmp_path / f"{n}.png") for n in ("first", "again", "plain"))
    common = ["--model", "random:tiny", "--device", "cpu", "--steps", "4", "--width", "64", "--height", "64",
              "--seed", "3", "-q"]
    cache = '{"method": "deepcache", "interval": 2, "branch": 1}'
    assert main(["generate", "a cat", "-o", first, *common, "--step-cache", cache]) == 0
    assert read_request(first)["extras"] == {"step_cache": {"method": "deepcache", "interval": 2, "branch": 1}}
    assert main(["generate", "--from-image", first, "-o", again, "--device", "cpu", "-q"]) == 0
    assert main(["generate", "--from-image", first, "-o", plain, "--device", "cpu", "-q", "--step-cache", "off"]) == 0
    pixels = [np.asarray(Image.open(p)) for p in (first, again, plain)]
    np.testing.assert_array_equal(pixels[1], pixels[0])
    assert np.abs(pixels[2].astype(int) - pixels[0]).max() > 1


def _beside(graphed, eager, first: dict, cache: dict, **kw) -> dict:
    """A cached request with another capability's rows (`first`: its keywords) and a cached plain one (`cache`, `kw`)
    submitted together to the graph-mode engine equal each alone on the eager one; its step graphs that ran (none
    eagerly)."""
    requests = [graphed.make_request(PROMPT, num_inference_steps=4, seed=7, width=64, height=64, **first),
                graphed.make_request(PROMPT, num_inference_steps=4, seed=8, width=64, height=64,
                                     extras={"step_cache": cache}, **kw)]
    alone = [eager.run(r).arrays for r in requests]
    together = _together(graphed, requests)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    ran = _step_graphs(graphed)
    assert all(n == 0 for _, n in ran.values()), ran
    return ran


def test_in_graph_mode_cache_rows_beside_lora_rows_run_every_row_deep_and_replay(tiny_engine, tmp_path, graphed):
    """A step with LoRA rows (per-row side-path state indexed by denoiser row) keeps every row in the deep path: its
    key says None at every branch, and it replays graphs as the gathered keys do."""
    from diffgraph.config import GraphConfig
    from lora_util import _write_diffusers

    _write_diffusers(tiny_engine, str(tmp_path / "style.safetensors"), rank=4, seed=0)
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), backend="emulated")
    kw = dict(device="cpu", dtype="fp32", lora_dir=str(tmp_path), max_loras=4, max_lora_rank=4)
    with Engine("random:tiny", mode="graph", graphs=cfg, **kw) as g, Engine("random:tiny", **kw) as eager:
        ran = _beside(g, eager, dict(loras=[("style", 1.0)], extras={"step_cache": {"method": "deepcache",
                                                                                   "interval": 2, "branch": 1}}),
                      {"method": "deepcache", "interval": 3})
    assert ran.get("step_lora1_step_cache_b0_b1", (0, 0))[0] > 0, ran  # every row deep, both branches' features


def test_in_the_compile_tier_cached_steps_compile_their_variants_and_equal_the_eager_engine(tiny_engine, tmp_path, graphed):
    """The compile tier (aot_eager on the CPU): a cached step's variant is traced whole at its first use (Dynamo's
    recompile limit raised for it: here patched to 1, below what the step needs) and its replays equal the eager
    engine."""
    from diffgraph.config import CompileConfig, GraphConfig

    torch._dynamo.reset()
    cfg = GraphConfig(batch_buckets=(2,), resolutions=((64, 64),), backend="emulated", capture_vae=False,
                      capture_text_encoder=False)
    with torch._dynamo.config.patch(recompile_limit=1), \
            Engine("random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg,
                   compile=CompileConfig(backend="aot_eager", cache_dir=str(tmp_path))) as compiled:
        step = next(c for c in compiled.runner.compiled if c.name == "the whole step")
        before = step.compiles
        request = _request(tiny_engine, {"method": "deepcache", "interval": 2, "branch": 1}, num_inference_steps=3)
        np.testing.assert_allclose(compiled.run(request).arrays, tiny_engine.run(request).arrays, atol=1e-5, rtol=0)
        assert step.compiles - before == 2 and step.failed is None and compiled.stats["compile_fallbacks"] == 0
        assert _step_graphs(compiled) == {"step_step_cache_b1": (2, 0), "step_step_cache_b1k0": (1, 0)}


def test_in_graph_mode_cache_rows_beside_controlnet_rows_replay_and_equal_the_eager_engine(tiny_engine, tmp_path, graphed):
    """ControlNet rows (their residuals computed before the step, over the step's bucket) beside cached rows: the
    rows going deeper read their residuals by their device indices; images equal the eager engine's."""
    from diffgraph.config import GraphConfig
    from control_util import control_image, make_controlnet

    make_controlnet(tiny_engine.model.denoiser, str(tmp_path / "edges"), seed=10)
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, mode="graph", graphs=cfg, controlnet_dir=str(tmp_path)) as g, \
            Engine(model=tiny_engine.model, controlnet_dir=str(tmp_path)) as eager:
        controls = [dict(model="edges", image=control_image(64, 1), scale=0.8)]
        ran = _beside(g, eager, dict(controls=controls, extras={"step_cache": {"method": "deepcache", "interval": 2,
                                                                                "branch": 2}}),
                      {"method": "deepcache", "interval": 3}, guidance_scale=1.0)
    assert any(k.startswith("step_controlon_step_cache_b0k") for k in ran), ran  # gathered, with control residuals
