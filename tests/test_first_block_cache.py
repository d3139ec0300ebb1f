"""The first-block cache per row on a token family (models/families/first_block_cache.py) on Z-Image.

The reference is the first-block rule written here on diffusers' own `ZImagePipeline`: the transformer's block list is
replaced by one module that runs the first block, compares its residual over the image's real tokens (every CFG
branch of the batch together) with the one kept from the last full evaluation, and either adds the kept
remaining-blocks residual or runs the remaining blocks and keeps both residuals. Tiny random folders in fp32 on the
CPU (test_zimage.py's `folders`)."""

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families.first_block_cache import FirstBlockStep, forced, run_blocks, sequential

from loop_util import images_together
from test_token_cache import _kw, engines  # noqa: F401 (its module-scoped engines fixture)
from test_zimage import folders  # noqa: F401 (its module-scoped folders fixture)

REAL_TOKENS = 16  # 64x64: an 8x8 latent in 2x2 patches


def _fb(threshold):
    return {"method": "first_block", "threshold": threshold}


class _ByHand(torch.nn.Module):
    """The first-block rule over diffusers' batch (one image: its CFG branches are the batch's items)."""

    def __init__(self, layers, threshold: float):
        super().__init__()
        self.inner, self.threshold = layers, threshold
        self.kept, self.rows, self.reused = None, 0, 0  # rows: the batch items of its full evaluations
        self.log = []  # (batch items, reused) per evaluation

    def forward(self, u, *args):
        u1 = self.inner[0](u, *args)
        first = (u1 - u)[:, :REAL_TOKENS]
        if self.kept is not None and self.kept[0].shape == first.shape:
            previous, rest = self.kept
            if ((first - previous).abs().mean() / previous.abs().mean()).item() < self.threshold:
                self.reused += 1
                self.log.append((u.shape[0], True))
                return u1 + rest
        out = u1
        for layer in self.inner[1:]:
            out = layer(out, *args)
        self.kept = (first, out - u1)
        self.rows += u.shape[0]
        self.log.append((u.shape[0], False))
        return out


def _by_hand(pipe, threshold: float, steps: int, guidance: float, **options) -> tuple[np.ndarray, _ByHand]:
    """The pipeline's image of `_kw`'s request at diffgraph's `guidance` with the rule by hand; `options` the
    pipeline's (cfg_truncation)."""
    net = pipe.transformer
    layers = net.layers
    hand = _ByHand(layers, threshold)
    net.layers = torch.nn.ModuleList([hand])
    try:
        image = pipe(prompt="a red fox in the snow", height=64, width=64, num_inference_steps=steps,
                     guidance_scale=guidance - 1.0, generator=torch.Generator().manual_seed(7), output_type="np",
                     **options).images[0]
        return (image * 255).round().astype(np.int16), hand
    finally:
        net.layers = layers


class _Counter:
    """Counts the rows the transformer's second block runs over (the remaining blocks' full evaluations)."""

    def __init__(self, engine):
        self.rows = 0
        self._handle = engine.model.denoiser.layers[1].register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.rows += args[0].shape[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.remove()


@pytest.mark.parametrize("name,threshold,guidance,truncation", [
    ("Z-Image-Turbo", 0.7, 1.0, 1.0), ("Z-Image", 0.7, 3.0, 1.0), ("Z-Image", 0.9, 3.0, 0.1)])
def test_first_block_equals_the_rule_by_hand_on_the_pipeline(folders, engines, name, threshold, guidance, truncation):
    """Truncation 0.1: guidance stops midway, the evaluation after it (one branch) runs full, as by hand."""
    engine, pipe = engines[name], folders[name][1]
    kw = _kw(guidance_scale=guidance, num_inference_steps=8)
    kw["extras"] = {"step_cache": _fb(threshold), **({"cfg_truncation": truncation} if truncation < 1 else {})}
    with _Counter(engine) as counter:
        got = images_together(engine, [kw])[0]
    plain = images_together(engine, [dict(kw, extras={k: v for k, v in kw["extras"].items() if k != "step_cache"})])[0]
    want, hand = _by_hand(pipe, threshold, 8, guidance, cfg_truncation=truncation)
    assert np.abs(got - want).max() <= 1
    assert 0 < hand.reused < 8 and counter.rows == hand.rows  # the same evaluations reused
    assert np.abs(got - plain).max() > 1  # it reused something
    if truncation < 1:
        change = next(e for e, (items, _) in enumerate(hand.log) if items == 1)
        assert 0 < change and not hand.log[change][1] and any(r for _, r in hand.log[change + 1:]), hand.log


def test_threshold_0_is_the_uncached_image_and_a_huge_one_reuses_after_the_first_evaluation(engines):
    engine = engines["Z-Image-Turbo"]
    plain = images_together(engine, [_kw()])[0]
    with _Counter(engine) as counter:
        np.testing.assert_array_equal(images_together(engine, [_kw(_fb(0))])[0], plain)
    assert counter.rows == 6  # every evaluation full
    with _Counter(engine) as counter:
        reused = images_together(engine, [_kw(_fb(1e30))])[0]
    assert counter.rows == 1 and np.abs(reused - plain).max() > 1  # only the first evaluation is full


def test_first_block_taylorseer_and_uncached_rows_together_equal_each_alone(engines):
    engine = engines["Z-Image"]
    requests = [_kw(_fb(0.7), seed=1, guidance_scale=3.0, num_inference_steps=8),
                _kw(seed=2, guidance_scale=3.0),
                _kw({"method": "taylorseer", "interval": 2}, seed=3, num_inference_steps=7),
                _kw(_fb(0.75), seed=4, prompt="a lighthouse on a cliff at dusk, waves", num_inference_steps=7),
                _kw({"method": "taylorseer", "interval": 3, "order": 2}, seed=5, guidance_scale=2.0)]
    alone = [images_together(engine, [r])[0] for r in requests]
    together = images_together(engine, requests)
    for a, b in zip(alone, together):
        assert np.abs(a - b).max() <= 1


def test_a_cfg_branch_change_runs_full():
    np.testing.assert_array_equal(forced(np.array([2, 2, 2, 1, 1, 2])), [1, 0, 0, 1, 0, 1])


def test_the_remaining_blocks_run_over_the_gathered_computing_rows_only():
    """`run_blocks` with stand-in blocks: a row whose first-block residual barely moved reuses its kept residual
    (gathered, the second block does not see it; not gathered, it does, and its output is replaced); a forced one and
    a row without the method compute and the forced one keeps its residuals anew; a step the host decided (all
    forced) computes every row whatever is kept (NaN here)."""
    g = torch.Generator().manual_seed(0)
    n, tokens, width = 3, 4, 5
    u = torch.randn(n, tokens + 2, width, generator=g)
    seen = []

    def first(h, scale):
        return h * 2 + scale

    def second(h, scale):
        seen.append(h.shape[0])
        return h * h + scale
    scale = torch.randn(n, 1, 1, generator=g)
    mask = torch.ones(n, tokens, dtype=torch.bool)
    u1 = first(u, scale)
    full = second(u1, scale)
    r1 = u1 - u
    kept = torch.randn(4, 2, tokens, width, generator=g)
    kept[0, 0] = r1[0, :tokens] * 1.01  # row 0 (slot 0): 1% apart
    kept[2, 0] = r1[1, :tokens] * 2     # row 1 (slot 2): far apart, and forced anyway
    before = kept.clone()
    for gather, rows in ((True, 2), (False, 3)):
        kept.copy_(before)
        seen.clear()
        step = FirstBlockStep((0, 1), (0, 2), (0, 1), (0.05, 0.05), (False, True), gather)
        out = run_blocks(sequential([first, second], tokens), u, (scale,), mask, (step, kept))
        assert seen == [rows] and out.shape == (n, tokens, width)  # gathered: rows 1 and 2 only
        torch.testing.assert_close(out[0], u1[0, :tokens] + before[0, 1])
        torch.testing.assert_close(out[1:], full[1:, :tokens])
        torch.testing.assert_close(kept[2], torch.stack([r1[1, :tokens], (full - u1)[1, :tokens]]))
        torch.testing.assert_close(kept[[0, 1, 3]], before[[0, 1, 3]])
    kept.fill_(float("nan"))
    forced_step = FirstBlockStep((0, 2), (0, 3), (0, 1), (0.5, 0.0), (True, False))
    assert forced_step.decided()
    out = run_blocks(sequential([first, second], tokens), u, (scale,), mask, (forced_step, kept))
    torch.testing.assert_close(out, full[:, :tokens])
    torch.testing.assert_close(kept[3], torch.stack([r1[2, :tokens], (full - u1)[2, :tokens]]))


def test_the_server_default_and_a_bad_threshold_over_http_is_a_one_line_400(folders, engines):
    from diffgraph.server import ServerConfig
    from server_util import served

    path = folders["Z-Image-Turbo"][0]
    cached = images_together(engines["Z-Image-Turbo"], [_kw(_fb(0.7))])[0]
    settings = {"step_cache": {"step_cache": '{"method": "first_block", "threshold": 0.7}'}}
    with Engine(model=path, device="cpu", capability_settings=settings) as e:
        np.testing.assert_array_equal(images_together(e, [_kw()])[0], cached)
        with served(e, ServerConfig(model=path, device="cpu")) as client:
            r = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "64x64",
                                                           "step_cache": {"method": "first_block",
                                                                          "threshold": "nan"}})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "step_cache.threshold", r.text
            assert "finite number" in error["message"] and "\n" not in error["message"]


def test_first_block_on_a_unet_model_is_refused_naming_the_field(tiny_engine):
    request = GenerationRequest.create(model=tiny_engine.info, prompt="a fox", num_inference_steps=2,
                                       extras={"step_cache": _fb(0.1)})
    with pytest.raises(ParamError) as e:
        tiny_engine.submit(request)
    assert e.value.param == "step_cache.method" and "transformer" in str(e.value) and "\n" not in str(e.value)


def test_in_graph_mode_steps_with_first_block_rows_run_eagerly_and_equal_the_eager_engine(folders, engines):
    from diffgraph.config import GraphConfig

    eager = engines["Z-Image-Turbo"]
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model=folders["Z-Image-Turbo"][0], device="cpu", mode="graph", graphs=cfg) as g:
        request = _kw(_fb(0.7), num_inference_steps=4)
        np.testing.assert_array_equal(images_together(g, [request])[0], images_together(eager, [request])[0])
        assert not any(r.get("replays") for r in g.runner.graph_runner.table() if r["kind"] == "step")
