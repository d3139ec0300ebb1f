"""The parts of the AUTOMATIC1111 routes that need no server (issue 34, point 1): the request and answer models hold
every field of tests/fixtures/a1111_api_fields.json (transcribed from AUTOMATIC1111 v1.10's modules/api/models.py)
with its default, the pixel work of img2img (masks, resize modes, the "only masked" box, the fill, the paste back),
and which key a request carries (Bearer, or HTTP Basic's password)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffgraph.server.a1111_inpaint import MaskOptions, crop_box, fill, prepare, read_mask, resize
from diffgraph.server.a1111_protocol import (Img2ImgBody, ProgressResponse, ProgressState, TextToImageResponse,
                                             Txt2ImgBody, plan_body)
from diffgraph.server.auth import caller_key
from diffgraph.api.protocol import APIError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "a1111_api_fields.json").read_text())


@pytest.mark.parametrize("model,name", [(Txt2ImgBody, "txt2img_request"), (Img2ImgBody, "img2img_request")])
def test_request_models_have_every_field_with_its_default(model, name):
    fields = FIXTURE[name]
    assert sorted(model.model_fields) == sorted(fields)
    assert {k: f.default for k, f in model.model_fields.items()} == fields
    assert model.model_validate({k: None for k in fields})  # null: the default


def test_answer_models_have_automatic1111s_fields():
    assert set(FIXTURE["txt2img_response"]) <= set(TextToImageResponse.model_fields)
    assert set(TextToImageResponse.model_fields) - set(FIXTURE["txt2img_response"]) == {"warnings"}
    assert sorted(ProgressResponse.model_fields) == sorted(FIXTURE["progress_response"])
    assert sorted(ProgressState.model_fields) == sorted(FIXTURE["progress_state"])


def test_seeds_count_and_clip_stop():
    plan = plan_body(Txt2ImgBody(prompt="a", seed=7, subseed=3, batch_size=2, n_iter=3), None, None, None)
    assert plan.seeds == (7, 8, 9, 10, 11, 12) and plan.subseeds == (3, 4, 5, 6, 7, 8) and plan.clip_stop == 1
    keyed = plan_body(Txt2ImgBody(prompt="a"), None, 3, None)
    assert keyed.clip_stop == 3 and keyed.create["clip_skip"] == 2 and keyed.create["prompt_syntax"] == "a1111"
    overridden = plan_body(Txt2ImgBody(prompt="a", override_settings={"CLIP_stop_at_last_layers": 1}), None, 3, 1)
    assert overridden.create["clip_skip"] is None
    assert plan_body(Txt2ImgBody(prompt="a"), None, None, 1).clip_stop == 2  # the server's --clip-skip
    with pytest.raises(APIError, match="the 'ADetailer' script is not supported"):
        plan_body(Txt2ImgBody(prompt="a", alwayson_scripts={"ADetailer": {"args": [True, {}]}}), None, None, None)
    off = {"controlnet": {"args": [{"enabled": False}]}, "ADetailer": {"args": [False]}, "x": {}}
    assert plan_body(Txt2ImgBody(prompt="a", alwayson_scripts=off), None, None, None).warnings == ()


def test_crop_box_pads_keeps_the_aspect_and_stays_inside():
    mask = Image.new("L", (200, 100), 0)
    mask.paste(255, (90, 40, 110, 60))                  # a 20x20 square
    assert crop_box(mask, 0, 64, 64) == (90, 40, 110, 60)
    assert crop_box(mask, 10, 64, 64) == (80, 30, 120, 70)
    x1, y1, x2, y2 = crop_box(mask, 10, 128, 64)         # widened to 2:1 about its middle
    assert (x2 - x1, y2 - y1) == (80, 40) and (x1 + x2) // 2 == 100
    edge = Image.new("L", (200, 100), 0)
    edge.paste(255, (0, 0, 10, 90))                     # against the left edge: shifted inside
    x1, y1, x2, y2 = crop_box(edge, 0, 64, 64)
    assert x1 == 0 and (x2 - x1, y2 - y1) == (90, 90)
    assert crop_box(Image.new("L", (64, 64), 0), 4, 64, 64) is None


def test_resize_modes():
    image = Image.fromarray(np.arange(100 * 50 * 3, dtype=np.uint32).reshape(50, 100, 3).astype(np.uint8))
    for mode in (0, 1, 2):
        assert resize(image, mode, 64, 64).size == (64, 64)
    stripes = np.zeros((40, 80, 3), np.uint8)
    stripes[0] = 200                                    # the top row
    filled = np.asarray(resize(Image.fromarray(stripes), 2, 80, 80))
    assert (filled[:20] == 200).all() and (filled[60:] == 0).all()  # the gaps repeat the edge rows


def test_masks_as_automatic1111_reads_them():
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[:, :32, 3] = 0                                 # transparent left half, opaque right
    mask = np.asarray(read_mask(Image.fromarray(rgba, "RGBA"), invert=False))
    assert (mask[:, :32] == 0).all() and (mask[:, 32:] == 255).all()  # opaque = repaint
    gray = Image.new("L", (64, 64), 255)
    assert (np.asarray(read_mask(gray, invert=True)) == 0).all()


def test_fill_takes_the_colours_around_the_mask():
    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[:, :32] = (200, 0, 0)
    pixels[:, 32:] = (0, 0, 200)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    out = fill(pixels, mask).astype(int)
    assert np.array_equal(out[mask == 0], pixels[mask == 0].astype(int))
    assert out[32, 18, 0] > out[32, 18, 2] and out[32, 45, 2] > out[32, 45, 0]  # red side stays red, blue blue


def test_only_masked_goes_back_where_it_came_from():
    image = Image.fromarray(np.full((96, 128, 3), 100, np.uint8))
    mask = Image.new("L", (128, 96), 0)
    mask.paste(255, (70, 30, 90, 50))
    edit = prepare(image, mask, MaskOptions(blur_x=0, blur_y=0, padding=6, fill=False), 64, 64, 0.75)
    assert edit.box == (64, 24, 96, 56) and edit.edit.image.shape == (64, 64, 3) and edit.edit.strength == 0.75
    out = edit.finish(np.full((64, 64, 3), 250, np.uint8))
    assert out.shape == (96, 128, 3)
    assert (out[30:50, 70:90] == 250).all() and (out[:30] == 100).all() and (out[:, :70] == 100).all()
    blank = prepare(image, Image.new("L", (128, 96), 0), MaskOptions(), 64, 64, 0.5)
    assert blank.edit.mask is None and blank.warning and blank.base is None  # image-to-image, as AUTOMATIC1111 does


def test_the_key_a_request_carries():
    keys = (b"alpha", b"beta")

    def scope(header: bytes) -> dict:
        return {"headers": [(b"authorization", header)]}
    assert caller_key(scope(b"Bearer beta"), keys) == 1
    assert caller_key(scope(b"Basic " + base64.b64encode(b"anyone:alpha")), keys) == 0
    assert caller_key(scope(b"Basic " + base64.b64encode(b"alpha:")), keys) is None  # the password is the key
    assert caller_key(scope(b"Basic !!!"), keys) is None and caller_key(scope(b"Bearer "), keys) is None
    assert caller_key({"headers": []}, keys) is None


def test_controlnet_units_become_controls():
    """AUTOMATIC1111's ControlNet units (a1111_controlnet.py): the extension's model names (with their hash, or a
    served path's last part), modules, weights, windows, modes and canny thresholds; bad units are 400s naming the
    unit's field."""
    import base64
    import io

    from PIL import Image

    from diffgraph.server.a1111_controlnet import controlnet_units, units_to_controls
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 255, 255)).save(buf, format="PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    served = lambda: ["sd15/control_v11p_sd15_canny", "outline"]
    scripts = {"ControlNet": {"args": [
        {"input_image": image, "model": "control_v11p_sd15_canny [d14c016b]", "module": "canny", "weight": 0.7,
         "threshold_a": 50, "threshold_b": -1, "guidance_end": 0.8, "processor_res": 512, "pixel_perfect": True},
        {"image": {"image": image, "mask": None}, "model": "outline", "guessmode": True, "low_vram": False},
        {"enabled": False, "model": "outline"}]}}
    units = controlnet_units(scripts)
    assert len(units) == 2
    a, b = units_to_controls(units, served, 1 << 20, 1 << 20)
    assert (a["model"], a["preprocess"], a["scale"], a["end"], a["canny_low"], a["canny_high"]) == (
        "sd15/control_v11p_sd15_canny", "canny", 0.7, 0.8, 50, 200)
    assert a["resize_mode"] == "Crop and Resize" and a["control_mode"] == "Balanced" and a["image"].size == (16, 16)
    assert (b["model"], b["preprocess"], b["control_mode"]) == ("outline", "none", "control")
    for unit, field, needle in [({"model": "outline"}, "input_image", "needs its control image"),
                                ({"model": "nope [abc]", "input_image": image}, "model", "served: sd15/"),
                                ({"model": "outline", "input_image": image, "mask": image}, "mask", "masked")]:
        with pytest.raises(APIError, match=needle) as info:
            units_to_controls([unit], served, 1 << 20, 1 << 20)
        assert info.value.param == f"alwayson_scripts.controlnet.args[0].{field}"


def test_controlnet_units_as_the_extension_reads_them():
    """Thresholds outside the canny sliders' 1..255 (-1 among them) take their defaults 100 / 200, a low above the high
    goes to OpenCV as it is (its Canny swaps them: the map is the same), unknown unit keys are named and ignored,
    and an img2img unit without its image takes the first init image."""
    import cv2

    from diffgraph.control_maps import control_map
    from diffgraph.request import ControlInput
    from diffgraph.server.a1111_controlnet import ignored_keys, units_to_controls
    rng = np.random.default_rng(1)
    picture = Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8))
    image, init = _b64(picture), _b64(Image.new("RGB", (24, 24), (9, 9, 9)))
    served = lambda: ["outline"]
    units = [{"input_image": image, "model": "outline", "module": "canny", "threshold_a": a, "threshold_b": b}
             for a, b in ((-1, -1), (0, 300), (200, 100), (None, 150.0))]
    controls = units_to_controls(units, served, 1 << 20, 1 << 20)
    assert [(c["canny_low"], c["canny_high"]) for c in controls] == [(100, 200), (100, 200), (200, 100), (100, 150.0)]
    swapped = ControlInput(**{**controls[2], "image": np.asarray(controls[2]["image"])})  # no refusal
    pixels = np.asarray(picture)
    assert np.array_equal(control_map(swapped)[:, :, 0], cv2.Canny(pixels, 100, 200))
    assert control_map(swapped).any()
    odd = [{"model": "outline", "input_image": image, "sketch": 1, "advanced_weighting": None, "enabled": True}]
    assert ignored_keys(odd) == ["alwayson_scripts.controlnet.args[0].sketch",
                                 "alwayson_scripts.controlnet.args[0].advanced_weighting"]
    assert len(units_to_controls(odd, served, 1 << 20, 1 << 20)) == 1
    bare = [{"model": "outline", "module": "none"}]
    fallback, = units_to_controls(bare, served, 1 << 20, 1 << 20, init_image=init)
    assert fallback["image"].size == (24, 24) and fallback["image"].getpixel((0, 0)) == (9, 9, 9)
    with pytest.raises(APIError, match="needs its control image"):
        units_to_controls(bare, served, 1 << 20, 1 << 20)  # txt2img: no image to fall back to
    with pytest.raises(APIError) as info:
        units_to_controls(bare, served, 1 << 20, 1 << 20, init_image="////")
    assert info.value.param == "init_images[0]"


def _b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
