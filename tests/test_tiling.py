"""AUTOMATIC1111's tiling (`GenerationRequest.tiling`): a tiling request's image equals diffusers' pipeline run with
every Conv2d of its UNet and VAE set to circular padding by hand (what AUTOMATIC1111 does), eagerly and through the
tiling groups' own graphs (emulated on the CPU); tiling and plain rows submitted together each equal alone; no
padding mode is left behind; the infotext carries `Tiling: True` and reads it back; a DiT family refuses it in one
line."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine, GenerationRequest
from diffgraph.config import GraphConfig
from diffgraph.errors import ParamError
from diffgraph.image_metadata import embed, infotext, parse_infotext, read_request
from diffgraph.models.circular import circular_padding
from diffgraph.request import TILING
from loop_util import together

PROMPT = "a tiled floor of red and blue stones"
STEPS = 4


def _convs(*modules):
    return [m for module in modules for m in module.modules() if isinstance(m, torch.nn.Conv2d)]


@contextlib.contextmanager
def _circular_by_hand(*modules):
    """AUTOMATIC1111's `apply_circular`: every Conv2d's padding_mode set to "circular", back to "zeros" after."""
    convs = _convs(*modules)
    for m in convs:
        m.padding_mode = "circular"
    try:
        yield
    finally:
        for m in convs:
            m.padding_mode = "zeros"


def _reference(engine, width, height, seed, image=None, strength=None):
    """diffusers' pipeline on the engine's modules (its default sampler, Euler), every Conv2d circular."""
    task = "text" if image is None else "img2img"
    pipe = engine.diffusers_pipeline("euler", "default", task=task)
    extra = {} if image is None else {"image": image, "strength": strength}
    with _circular_by_hand(pipe.unet, pipe.vae):
        return pipe(PROMPT, width=width, height=height, num_inference_steps=STEPS,
                    guidance_scale=engine.model.default_guidance, generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="np", **extra).images


def _levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() * 255)


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_a_tiling_request_equals_diffusers_with_circular_convolutions(request, model):
    e = request.getfixturevalue(f"{model}_engine")
    ours = e.generate(PROMPT, width=64, height=96, num_inference_steps=STEPS, seed=5, tiling=True)
    plain = e.generate(PROMPT, width=64, height=96, num_inference_steps=STEPS, seed=5)
    ref = _reference(e, 64, 96, 5)
    assert ours.arrays.shape == ref.shape == (1, 96, 64, 3)
    assert ours.arrays.std() > 1e-3
    assert _levels(ours.arrays, ref) <= 1.0
    assert _levels(plain.arrays, ref) > 10  # the padding mode changes the image: the comparison means something


def test_a_tiling_edit_encodes_circularly_too(tiny_engine):
    """Image-to-image: the VAE's encoder pads circularly as well (AUTOMATIC1111 sets every Conv2d of the model)."""
    e = tiny_engine
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    ours = e.generate(PROMPT, image=image, strength=0.75, num_inference_steps=STEPS, seed=8, tiling=True)
    ref = _reference(e, 64, 64, 8, image=image, strength=0.75)
    assert _levels(ours.arrays, ref) <= 1.0


def test_tiling_and_plain_rows_together_each_equal_alone(tiny_engine):
    """Tiling rows are a group of their own: the loop alternates its steps with the plain group's, each under its
    own padding, and every image equals the one its request makes alone."""
    e = tiny_engine
    kinds = [dict(tiling=True), dict(), dict(tiling=True, guidance_scale=1.0, num_images=2), dict(num_images=2)]
    requests = [e.make_request(PROMPT, num_inference_steps=STEPS, seed=20 + i, **k) for i, k in enumerate(kinds)]
    alone = [e.run(r).arrays for r in requests]
    keys, live = [], []

    def listener(plan, seconds):
        keys.append(plan.key)
        live.append(e.live_rows())
    e.step_listeners.append(listener)
    try:
        both = [r.arrays for r in together(e, requests)]
    finally:
        e.step_listeners.remove(listener)
    assert set(keys) == {(64, 64), (64, 64, TILING)}
    assert any(a != b for a, b in zip(keys, keys[1:]))  # the two groups' steps interleaved
    # the live rows are listed per resolution (as /status and /metrics show them), the tiling group's counted in
    assert {k for rows in live for k in rows} == {(64, 64)} and max(rows.get((64, 64), 0) for rows in live) == 6
    for i, (a, t) in enumerate(zip(alone, both)):
        assert _levels(a, t) <= 1.0, (i, kinds[i])
    assert _levels(alone[0], alone[1]) > 10  # tiling changed its image


def test_no_padding_mode_is_left_behind(tiny_engine):
    """A plain request after a tiling one makes the same image as before it, and every Conv2d pads with zeros again."""
    e = tiny_engine
    before = e.generate(PROMPT, num_inference_steps=STEPS, seed=31)
    e.generate(PROMPT, num_inference_steps=STEPS, seed=31, tiling=True)
    after = e.generate(PROMPT, num_inference_steps=STEPS, seed=31)
    np.testing.assert_array_equal(before.arrays, after.arrays)
    assert {m.padding_mode for m in _convs(e.model.denoiser, e.model.vae)} == {"zeros"}


def test_circular_padding_restores_each_mode_after_an_error():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3, padding=1), torch.nn.Conv2d(1, 1, 3, padding=1,
                                                                                   padding_mode="reflect"))
    with pytest.raises(RuntimeError, match="boom"):
        with circular_padding(net):
            assert [m.padding_mode for m in net] == ["circular", "circular"]
            raise RuntimeError("boom")
    assert [m.padding_mode for m in net] == ["zeros", "reflect"]


def test_the_tiling_groups_own_graphs_equal_the_eager_images(tiny_engine):
    """Graph mode (emulated on the CPU): tiling rows replay their own step and VAE graphs, registered at the first
    tiling row, over their own buffers; their images equal the eager engine's, and the plain graphs' are unchanged."""
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((64, 64),), backend="emulated")
    with Engine(model=tiny_engine.model, device="cpu", dtype="fp32", mode="graph", graphs=cfg) as g:
        kinds = {r["kind"] for r in g.graph_table()}
        assert not any(k.endswith(TILING) for k in kinds)  # nothing captured at start-up for tiling
        tiled = g.generate(PROMPT, num_inference_steps=STEPS, seed=41, tiling=True)
        plain = g.generate(PROMPT, num_inference_steps=STEPS, seed=41)
        replays = {r["kind"]: r["replays"] for r in g.graph_table() if r["replays"]}
    assert replays.get("step_tiling", 0) >= STEPS and replays.get("vae_tiling", 0) == 1, replays
    assert replays.get("step", 0) >= STEPS and replays.get("vae", 0) == 1, replays
    assert _levels(tiled.arrays, tiny_engine.generate(PROMPT, num_inference_steps=STEPS, seed=41,
                                                      tiling=True).arrays) <= 1.0
    assert _levels(plain.arrays, tiny_engine.generate(PROMPT, num_inference_steps=STEPS, seed=41).arrays) <= 1.0


def test_the_infotext_says_tiling_and_reads_it_back():
    request = GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=7.0, seed=3, tiling=True)
    plain = GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=7.0, seed=3)
    text = infotext(request, "tiny")
    assert "Tiling: True" in text.splitlines()[-1] and "Tiling" not in infotext(plain, "tiny")
    assert parse_infotext(text)["tiling"] is True and "tiling" not in parse_infotext(infotext(plain, "tiny"))
    png = embed("png", Image.new("RGB", (8, 8)), request, "tiny")
    fields = read_request(png)
    assert fields["tiling"] is True
    assert GenerationRequest.create(**{k: v for k, v in fields.items() if k != "model"}).tiling is True


def test_tiling_must_be_a_bool():
    with pytest.raises(ParamError, match="tiling must be true or false") as e:
        GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=7.0, tiling="yes")
    assert e.value.param == "tiling"


def test_a_dit_family_refuses_tiling_in_one_line():
    with Engine(model="random:zimage-tiny", device="cpu", dtype="fp32") as z:
        assert not z.info.tiling
        with pytest.raises(ParamError) as made:
            z.make_request(PROMPT, tiling=True)
        with pytest.raises(ParamError) as submitted:  # built without the model's info: refused at submit
            z.submit(GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=1.0, tiling=True))
    for e in (made, submitted):
        assert e.value.param == "tiling" and "\n" not in str(e.value)
        assert "zimage" in str(e.value) and "send tiling false" in str(e.value)


def test_the_routes_bodies_carry_tiling():
    """AUTOMATIC1111's `tiling` (and its infotext's `Tiling: True`, read where the body leaves tiling out) and the
    images body's `tiling` reach the request's keywords; the images body takes only true or false."""
    from diffgraph.api.protocol import ImageGenerationRequest
    from diffgraph.server.a1111_protocol import Txt2ImgBody, plan_body

    assert plan_body(Txt2ImgBody(prompt="a", tiling=True), None, None, None).create["tiling"] is True
    assert "tiling" not in plan_body(Txt2ImgBody(prompt="a"), None, None, None).create
    read = Txt2ImgBody(prompt="a", infotext="a\nSteps: 3, Seed: 5, Size: 64x64, Tiling: True")
    assert plan_body(read, None, None, None).create["tiling"] is True
    assert ImageGenerationRequest(prompt="a", tiling=True).request_params()["tiling"] is True
    assert ImageGenerationRequest(prompt="a").request_params()["tiling"] is False
    with pytest.raises(ValueError, match="tiling"):
        ImageGenerationRequest(prompt="a", tiling="yes")


def test_lora_convolution_side_paths_refuse_tiling(tiny_engine):
    """Side paths on convolutions (the LoRA manager's conv option) pad with zeros: such an engine refuses tiling."""
    from diffgraph.engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_engine.model)
    request = GenerationRequest.create(PROMPT, width=64, height=64, guidance_scale=7.0, tiling=True)
    assert runner.request_plan(request).num_steps == request.num_inference_steps
    runner.slot_shape = (2, 8, 1)  # (slots, max rank, convolution side paths), as such an engine's runner has it
    with pytest.raises(ParamError, match="convolution LoRA side paths") as e:
        runner.request_plan(request)
    assert e.value.param == "tiling"
