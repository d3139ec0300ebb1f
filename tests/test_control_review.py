"""Review of the conditioning paths (ControlNets, IP-Adapters) for faults a request can trigger: each bad input is a
ParamError naming its field (an HTTP 400), never a hang, a memory blow-up or another request's failure."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph import Engine
from diffgraph.request import MAX_CONTROL_PIXELS, ParamError

from control_util import control_image, make_controlnet

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """random:tiny with three ControlNets and two ControlNet slots (the default --max-controlnets), plus a ControlNet
    taking 9 input channels (an inpainting UNet's, not the latents a ControlNet is given)."""
    from diffusers import ControlNetModel
    folder = tmp_path_factory.mktemp("review-controlnets")
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        for i, name in enumerate(("a", "b", "c")):
            make_controlnet(plain.model.denoiser, str(folder / name), seed=i)
        net = ControlNetModel.from_unet(plain.model.denoiser)
        net.conv_in = torch.nn.Conv2d(9, net.conv_in.out_channels, 3, padding=1)
        net.register_to_config(in_channels=9)
        net.save_pretrained(str(folder / "nine"), safe_serialization=True)
        ControlNetModel.from_unet(plain.model.denoiser, conditioning_channels=1).save_pretrained(str(folder / "gray"))
        with Engine(model=plain.model, controlnet_dir=str(folder), max_controlnets=2) as e:
            yield e


def _together(engine, reqs):
    futures: list = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in reqs)).result()
    return futures


def test_more_distinct_controlnets_than_slots_is_a_param_error_not_a_request_that_waits_forever(engine):
    controls = [dict(model=n, image=control_image(64, 1)) for n in "abc"]
    with pytest.raises(ParamError, match="at most 2 at once") as info:
        engine.submit(engine.make_request(PROMPT, num_inference_steps=2, seed=1, controls=controls))
    assert info.value.param == "controls"
    # the same ControlNet three times is one slot
    same = [dict(model="a", image=control_image(64, i)) for i in range(3)]
    assert engine.generate(PROMPT, num_inference_steps=2, seed=1, controls=same).arrays.shape == (1, 64, 64, 3)


def test_requests_in_flight_with_more_controlnets_than_the_host_cache_all_complete(engine):
    """Three requests, each its own ControlNet, queued at once on two slots: the third's resolve used to drop the
    first's host copy, and the first then failed ("dropped from host memory; retry")."""
    reqs = [engine.make_request(PROMPT, num_inference_steps=2, seed=i,
                                controls=[dict(model=n, image=control_image(64, i))]) for i, n in enumerate("abc")]
    alone = [engine.run(r).arrays for r in reqs]
    together = [f.result(timeout=300).arrays for f in _together(engine, reqs)]
    for a, t in zip(alone, together):
        assert np.abs(a - t).max() * 255 <= 1.0


@pytest.mark.parametrize("name,field", [("nine", "in_channels"), ("gray", "conditioning_channels")])
def test_a_controlnet_of_other_input_channels_is_refused_and_fails_no_other_request(engine, name, field):
    bad = engine.make_request(PROMPT, num_inference_steps=2, seed=1, controls=[dict(model=name,
                                                                                   image=control_image(64, 1))])
    with pytest.raises(ParamError, match=field) as info:
        engine.submit(bad)
    assert info.value.param == "controls"
    plain = engine.make_request(PROMPT, num_inference_steps=2, seed=2)
    assert engine.run(plain).arrays.shape == (1, 64, 64, 3)


@pytest.fixture
def no_huge_resizes(monkeypatch):
    """Fails any PIL resize to more than MAX_CONTROL_PIXELS (what an extreme aspect used to ask for: an 8x2M image
    for a 1024x1024 output is a 256Gpx intermediate) before it allocates."""
    resize = Image.Image.resize

    def guarded(self, size, *args, **kwargs):
        assert size[0] * size[1] <= MAX_CONTROL_PIXELS, f"a {size[0]}x{size[1]} resize"
        return resize(self, size, *args, **kwargs)
    monkeypatch.setattr(Image.Image, "resize", guarded)


def test_crop_and_resize_of_an_extreme_aspect_is_a_param_error_not_a_huge_resize(engine, no_huge_resizes):
    from diffgraph.control_maps import fit_map
    strip = np.zeros((8, 4096, 3), np.uint8)
    with pytest.raises(ParamError, match="crop_and_resize") as info:
        fit_map(strip, 1024, 1024, "crop_and_resize")
    assert info.value.param == "controls"
    with pytest.raises(ParamError, match="crop_and_resize"):
        engine.submit(engine.make_request(PROMPT, num_inference_steps=1, seed=1, controls=[
            dict(model="a", image=np.zeros((8, 300_000, 3), np.uint8), resize_mode="crop_and_resize")]))
    assert fit_map(strip, 1024, 1024, "resize_and_fill").shape == (1024, 1024, 3)  # the other modes stay bounded


def test_an_extreme_aspect_image_prompt_is_a_param_error_not_a_huge_resize(tmp_path, no_huge_resizes):
    from test_ip_adapter import make_ip_adapter
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as plain:
        make_ip_adapter(plain.model.denoiser, tmp_path, "base", seed=1)
        with Engine(model=plain.model, ip_adapter_dir=str(tmp_path)) as e:
            # the test encoder's side is 32: 8x140000 would be resized to 32x560000 (a real encoder's 224: 224x3.9M)
            narrow = np.zeros((8, 140_000, 3), np.uint8)
            with pytest.raises(ParamError, match="too long and narrow") as info:
                e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(images=[narrow]))
            assert info.value.param == "image_prompts"
            ok = e.generate(PROMPT, num_inference_steps=1, seed=1, image_prompts=dict(images=[narrow[:, :8000]]))
            assert ok.arrays.shape == (1, 64, 64, 3)
