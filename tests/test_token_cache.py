"""Step caching per row on a token family (models/families/token_cache.py): TaylorSeer on Z-Image, and the cache's
fields held only by groups with a cache row (FLUX.2's: test_flux2.py).

The reference is TaylorSeer's algorithm written here on diffusers' own `ZImagePipeline` (a plain flow-matching Euler
loop over the transformer): the transformer's forward is wrapped so that at a full evaluation it runs and the
output and its finite differences are kept per batch item, and at a cached one it does not run and returns
F + D1 k + D2 k^2 / 2 by hand. Tiny random folders in fp32 on the CPU (test_zimage.py's `folders`)."""

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.token_cache import TaylorKey, TaylorState, cached_denoise, forecast_plan, taylor_key

from loop_util import images_together
from test_zimage import folders, oracle  # noqa: F401 (its module-scoped folders fixture)

SIZE = dict(height=64, width=64)


@pytest.fixture(scope="module")
def engines(folders):
    made = {name: Engine(model=path, device="cpu") for name, (path, _) in folders.items()}
    yield made
    for e in made.values():
        e.close()


def _kw(cache=None, **kw):
    out = dict(prompt="a red fox in the snow", num_inference_steps=6, seed=7, **SIZE)
    out.update(kw)
    if cache is not None:
        out["extras"] = {"step_cache": cache}
    return out


def _hooked(pipe, interval: int, order: int):
    """Wraps the pipeline's transformer with TaylorSeer by hand; returns the function that unwraps it."""
    net = pipe.transformer
    forward = net.forward
    state = {"e": 0, "last": None, "width": 0, "terms": []}

    def taylor(xs, t, embeds, **kw):
        e = state["e"]
        state["e"] += 1
        if e % interval == 0 or state["last"] is None or len(xs) != state["width"]:
            out = forward(xs, t, embeds, **kw)[0]
            fresh = [o.float() for o in out]
            if state["last"] is None or len(xs) != state["width"]:  # the first, or CFG's branches changed
                state["terms"] = [[f, None, None] for f in fresh]
            else:
                dist = e - state["last"]
                new = []
                for f, (f0, d1, _) in zip(fresh, state["terms"]):
                    g1 = (f - f0) / dist
                    new.append([f, g1, (g1 - d1) / dist if order >= 2 and d1 is not None else None])
                state["terms"] = new
            state["last"], state["width"] = e, len(xs)
            return (out,)
        k = e - state["last"]
        guess = [f0 + (0 if d1 is None else d1 * k) + (0 if d2 is None else d2 * k * k / 2)
                 for f0, d1, d2 in state["terms"]]
        return (guess,)
    net.forward = taylor
    return lambda: delattr(net, "forward")


@pytest.mark.parametrize("name,interval,order,guidance,steps", [
    ("Z-Image-Turbo", 2, 1, 1.0, 6), ("Z-Image-Turbo", 3, 2, 1.0, 7), ("Z-Image", 2, 2, 3.0, 6)])
def test_taylorseer_equals_the_algorithm_by_hand_on_the_pipeline(folders, engines, name, interval, order, guidance,
                                                                  steps):
    engine, pipe = engines[name], folders[name][1]
    cache = {"method": "taylorseer", "interval": interval, "order": order}
    got = images_together(engine, [_kw(cache, guidance_scale=guidance, num_inference_steps=steps)])[0]
    plain = images_together(engine, [_kw(guidance_scale=guidance, num_inference_steps=steps)])[0]
    unwrap = _hooked(pipe, interval, order)
    try:
        want = oracle(pipe, "a red fox in the snow", (64, 64), steps, guidance, 7)
    finally:
        unwrap()
    assert np.abs(got - want).max() <= 1
    assert np.abs(got - plain).max() > 1  # it forecast something


def test_off_changes_no_image_and_interval_1_is_the_uncached_image(engines):
    engine = engines["Z-Image-Turbo"]
    plain = images_together(engine, [_kw()])[0]
    for cache in ("off", {"method": "taylorseer", "interval": 1, "order": 2}):
        np.testing.assert_array_equal(images_together(engine, [_kw(cache)])[0], plain)


def test_cached_uncached_and_other_interval_rows_together_equal_each_alone(engines):
    engine = engines["Z-Image"]
    requests = [_kw({"method": "taylorseer", "interval": 2}, seed=1, guidance_scale=3.0),
                _kw(seed=2, guidance_scale=3.0),
                _kw({"method": "taylorseer", "interval": 3, "order": 2}, seed=3, num_inference_steps=7),
                _kw("auto", seed=4, guidance_scale=2.0, prompt="a lighthouse on a cliff at dusk, waves")]
    alone = [images_together(engine, [r])[0] for r in requests]
    together = images_together(engine, requests)
    for a, b in zip(alone, together):
        assert np.abs(a - b).max() <= 1


def test_the_plan_forecasts_from_the_differences_that_exist_and_a_branch_change_runs_full():
    reuse = np.array([0, 1, 0, 1, 0, 1, 1], dtype=bool)
    r, c1, c2 = forecast_plan(reuse, np.ones(7), 2)
    np.testing.assert_array_equal(r, reuse)
    np.testing.assert_allclose(c1, [0, 0, 0.5, 1, 0.5, 1, 2])  # F only at 1; 1/dist at full ones; k where D1 exists
    np.testing.assert_allclose(c2, [0, 0, 0, 0, 0.5, 0.5, 2])  # D2 from the third full evaluation on: k^2 / 2
    r, c1, c2 = forecast_plan(reuse, np.array([1, 1, 1, 1, 2, 2, 2]), 1)
    np.testing.assert_array_equal(r, [0, 1, 0, 1, 0, 1, 1])
    np.testing.assert_allclose(c1, [0, 0, 0.5, 1, 0, 0, 0])  # guidance from evaluation 4: the differences restart
    r, _, _ = forecast_plan(reuse, np.array([1, 1, 1, 2, 2, 2, 2]), 1)
    np.testing.assert_array_equal(r, [0, 1, 0, 0, 0, 1, 1])  # evaluation 3 changes branches: it runs full


def test_the_transformer_runs_over_the_gathered_rows_and_the_others_are_forecast():
    """`cached_denoise` with a stand-in denoiser that records the rows it saw: gathered, only the rows that run; not
    gathered (per-row denoiser state in the step), every row, the same outputs."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(4, 5, 3, generator=g), torch.tensor([900.0, 800.0, 700.0, 600.0])
    cond, mask = {"embeds": torch.randn(4, 2, 3, generator=g)}, torch.ones(4, 5, dtype=torch.bool)
    seen = []

    def denoise(x, t, cond, rows):
        seen.append(x.shape[0])
        return x * t.view(-1, 1, 1) / 1000 + cond["embeds"][:, :1] * rows["image_mask"].unsqueeze(-1)
    terms = torch.randn(8, 3, 5, 3, generator=g)
    before = terms.clone()
    # row 0 no cache, row 1 forecast (k = 2, order 2), row 2 keeps its output (1 / dist = 0.5), row 3 forecast
    # (k = 1, order 1); slots 0, 2, 5, 6
    state = TaylorState(torch.tensor([False, False, True, False]), torch.tensor([False, True, False, True]),
                        torch.tensor([0.0, 2.0, 0.5, 1.0]), torch.tensor([0.0, 2.0, 0.5, 0.0]),
                        torch.tensor([0, 2, 5, 6]), terms)
    # the two rows that run; three (a forecast row pads the count, its output replaced); every row
    for run, rows in ((2, 2), (3, 3), (None, 4)):
        terms.copy_(before)
        out = cached_denoise(denoise, x, t, cond, {"image_mask": mask, "taylor.key": TaylorKey(run),
                                                   "taylor.state": state})
        assert seen.pop() == rows
        full = denoise(x, t, cond, {"image_mask": mask})
        torch.testing.assert_close(out[[0, 2]], full[[0, 2]])
        torch.testing.assert_close(out[1], before[2, 0] + 2 * before[2, 1] + 2 * before[2, 2])
        torch.testing.assert_close(out[3], before[6, 0] + before[6, 1])
        d1 = (full[2] - before[5, 0]) * 0.5
        torch.testing.assert_close(terms[5], torch.stack([full[2], d1, (d1 - before[5, 1]) * 0.5]))
        torch.testing.assert_close(terms[[0, 1, 2, 3, 4, 6, 7]], before[[0, 1, 2, 3, 4, 6, 7]])
    on, reuse = np.array([False, True, True, True, True]), np.array([False, True, False, True, False])
    assert taylor_key(on, reuse) == TaylorKey(4) and taylor_key(on, on) == TaylorKey(1)
    assert taylor_key(on, reuse, gather=False) == TaylorKey(None) and taylor_key(on & False, reuse & False) is None
    assert taylor_key(on[:3], reuse[:3]) == TaylorKey(2)
    assert taylor_key(on[:3], reuse[:3] & False) == TaylorKey(None)  # 3 rows run: rounded up to 4, all of them


BAD = [({"method": "taylorseer", "interval": 0}, "step_cache.interval", "out of range"),
       ({"method": "taylorseer", "order": 3}, "step_cache.order", "1 or 2"),
       ({"method": "taylorseer", "interval": float("nan")}, "step_cache.interval", "integer"),
       ({"method": "deepcache", "interval": 3}, "step_cache.method", "UNet"),
       ({"method": "teacache"}, "step_cache.method", "taylorseer"),
       ({"method": "taylorseer", "every": 2}, "step_cache.every", "no field"),
       ("sometimes", "step_cache", "unknown"),
       # the first-block cache's (test_first_block_cache.py)
       ({"method": "first_block", "threshold": float("nan")}, "step_cache.threshold", "finite number >= 0"),
       ({"method": "first_block", "threshold": -0.1}, "step_cache.threshold", "finite number >= 0"),
       ({"method": "first_block"}, "step_cache.threshold", "missing"),
       ({"method": "first_block", "threshold": "0.1"}, "step_cache.threshold", "finite number >= 0"),
       ({"method": "first_block", "threshold": True}, "step_cache.threshold", "finite number >= 0"),
       ({"method": "first_block", "threshold": 0.1, "interval": 2}, "step_cache.interval", "no field")]


def test_bad_values_are_one_line_param_errors_naming_the_field(engines):
    engine = engines["Z-Image-Turbo"]
    for value, field, words in BAD:
        with pytest.raises(ParamError) as e:
            engine.submit(GenerationRequest.create(model=engine.info, **_kw(value)))
        assert e.value.param == field and words in str(e.value) and "\n" not in str(e.value), (value, str(e.value))


def test_the_server_default_applies_to_requests_that_name_none(folders, engines):
    plain = images_together(engines["Z-Image-Turbo"], [_kw()])[0]
    cached = images_together(engines["Z-Image-Turbo"], [_kw({"method": "taylorseer", "interval": 3})])[0]
    settings = {"step_cache": {"step_cache": '{"method": "taylorseer", "interval": 3}'}}
    with Engine(model=folders["Z-Image-Turbo"][0], device="cpu", capability_settings=settings) as e:
        np.testing.assert_array_equal(images_together(e, [_kw()])[0], cached)
        np.testing.assert_array_equal(images_together(e, [_kw("off")])[0], plain)
    with pytest.raises(ValueError, match="setting step-cache: .* is for UNet models"):
        Engine(model=folders["Z-Image-Turbo"][0], device="cpu",
               capability_settings={"step_cache": {"step_cache": '{"method": "deepcache"}'}})


def test_in_graph_mode_steps_with_cache_rows_replay_their_graphs_and_equal_the_eager_engine(folders, engines):
    from diffgraph.config import GraphConfig

    eager = engines["Z-Image"]
    requests = [_kw({"method": "taylorseer", "interval": 2}, seed=1, guidance_scale=3.0),
                _kw(seed=2),
                _kw({"method": "taylorseer", "interval": 3, "order": 2}, seed=3, num_inference_steps=7)]
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), backend="emulated")
    with Engine(model=folders["Z-Image"][0], device="cpu", mode="graph", graphs=cfg) as g:
        alone = images_together(g, requests[:1])[0]
        np.testing.assert_array_equal(alone, images_together(eager, requests[:1])[0])
        together = images_together(g, requests)
        g.core.call_between_steps(lambda: None).result()  # the last step's count is in (it follows the results)
        steps = g.core.stats["steps"]
        table = [r for r in g.runner.graph_table() if r["kind"].startswith("step")]
    for a, b in zip(images_together(eager, requests), together):
        assert np.abs(a.astype(int) - b).max() <= 1
    assert not any(r["eager_fallbacks"] for r in table)
    # every step replayed a graph, the cached ones their own variants (captured at first use)
    assert sum(r["replays"] for r in table) == steps
    cached = {r["kind"] for r in table if r["replays"] and "step_cache" in r["kind"]}
    assert {"step_step_cache_all", "step_step_cache_run0"} <= cached and any("run" in k for k in cached - {
        "step_step_cache_run0"}), cached


CACHE_FIELDS = ("taylor.terms", "fbc.kept")


def test_a_group_without_cache_rows_holds_no_cache_fields_and_a_cached_row_still_equals_its_reference(folders,
                                                                                                       engines):
    """The step caches' fields are lazy: a group holds none of them until a row of their method is admitted, then
    every row's (what a step reads): a TaylorSeer row brings `taylor.terms` and no first-block residuals, and the
    engine's buffer bytes grow by exactly that."""
    engine, pipe = engines["Z-Image-Turbo"], folders["Z-Image-Turbo"][1]
    seen = []

    def record(plan, seconds):
        groups = list(engine.runner.groups.values())
        seen.append(([(b.fields["taylor.terms"].nbytes, b.fields["fbc.kept"].nbytes) for b in groups],
                     [(b.num_rows, tuple(b.x.shape[1:])) for b in groups], engine.memory()["buffer_bytes"]))

    def run(requests):
        seen.clear()
        images = images_together(engine, requests)
        engine.core.call_between_steps(lambda: None).result()  # the last step's listener has run (after results)
        return images, list(seen)
    engine.step_listeners.append(record)
    try:
        (plain,), uncached = run([_kw(seed=2)])
        got, cached = run([_kw({"method": "taylorseer", "interval": 2}), _kw(seed=2)])
    finally:
        engine.step_listeners.remove(record)
    assert len(uncached) == 6 and all(held == [(0, 0)] for held, _, _ in uncached)
    (rows, (tokens, channels)), = cached[0][1]
    terms = rows * 2 * 3 * tokens * channels * 4  # [rows, 2 branches, F D1 D2, tokens, channels] fp32
    assert len(cached) == 6 and all(held == [(terms, 0)] and total == uncached[0][2] + terms
                                    for held, _, total in cached)
    unwrap = _hooked(pipe, 2, 1)
    try:
        want = oracle(pipe, "a red fox in the snow", (64, 64), 6, 1.0, 7)
    finally:
        unwrap()
    assert np.abs(got[0] - want).max() <= 1 and np.abs(got[1] - plain).max() <= 1
