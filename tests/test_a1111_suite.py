"""The requests AUTOMATIC1111's own API tests send (its test/ folder: txt2img, img2img, extras and the list and
options routes), re-created here with their checks and with assertions on what comes back: sizes, counts, seeds,
pixels where a rule fixes them (the extras upscalers, the SD upscale script's grid, inpainting's kept pixels) and the
refusals that remain, each naming its field. One in-process server on `random:tiny` (CPU) for the module; images are
64x64 with 3 steps, as that suite asks.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from diffgraph.upscalers import Postprocess, combine_tiles, postprocess, split_tiles, tile_count, upscale
from diffgraph.server.a1111_scripts import tile_seeds
from server_util import served

# the body AUTOMATIC1111's txt2img tests start from: every field its UI sends, "Euler a" with eta 0, a fixed seed here
TXT2IMG = {"prompt": "example prompt", "negative_prompt": "", "styles": [], "seed": 321, "subseed": -1,
           "subseed_strength": 0, "seed_resize_from_h": -1, "seed_resize_from_w": -1, "sampler_index": "Euler a",
           "batch_size": 1, "n_iter": 1, "steps": 3, "cfg_scale": 7, "width": 64, "height": 64,
           "restore_faces": False, "tiling": False, "enable_hr": False, "denoising_strength": 0,
           "firstphase_width": 0, "firstphase_height": 0, "eta": 0, "s_churn": 0, "s_tmax": 0, "s_tmin": 0,
           "s_noise": 1}
IMG2IMG_ONLY = {"init_images": None, "resize_mode": 0, "denoising_strength": 0.75, "mask": None, "mask_blur": 4,
                "inpainting_fill": 0, "inpaint_full_res": False, "inpaint_full_res_padding": 0,
                "inpainting_mask_invert": False, "include_init_images": False, "override_settings": {}}


def png64(image: Image.Image, **texts: str) -> str:
    """A PIL image as AUTOMATIC1111's tests send it: a data URL of a base64 PNG (with `texts` as text chunks)."""
    chunks = PngImagePlugin.PngInfo()
    for key, value in texts.items():
        chunks.add_text(key, value)
    out = io.BytesIO()
    image.save(out, "PNG", pnginfo=chunks)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def decoded(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text)))


def picture(size: int = 64) -> Image.Image:
    """An RGBA test picture: colour ramps, its right quarter half transparent."""
    y, x = np.mgrid[0:size, 0:size]
    rgba = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size, np.full_like(x, 255)], -1)
    rgba[:, 3 * size // 4:, 3] = 128
    return Image.fromarray(rgba.astype(np.uint8), "RGBA")


def square_mask(size: int = 64) -> Image.Image:
    mask = np.zeros((size, size), np.uint8)
    mask[16:48, 16:48] = 255
    return Image.fromarray(mask, "L").convert("RGB")


@pytest.fixture(scope="module")
def client():
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as engine:
        with served(engine, ServerConfig(model="random:tiny", device="cpu")) as c:
            yield c


@pytest.fixture(scope="module")
def img2img_body():
    return {**TXT2IMG, **IMG2IMG_ONLY, "init_images": [png64(picture())]}


def txt2img(client, **changes):
    return client.post("/sdapi/v1/txt2img", json={**TXT2IMG, **changes})


# -- txt2img ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, size, count", [
    ({}, (64, 64), 1), ({"negative_prompt": "example negative prompt"}, (64, 64), 1),
    ({"height": 128}, (64, 128), 1), ({"n_iter": 2}, (64, 64), 2), ({"batch_size": 2}, (64, 64), 2),
    ({"prompt": "((emphasis)), (emphasis1:1.1), [to:1], [from::2], [from:to:0.3], [alt|alt1]"}, (64, 64), 1),
    ({"sampler_index": "DDIM"}, (64, 64), 1), ({"sampler_index": "UniPC"}, (64, 64), 1),
    ({"sampler_index": "PLMS"}, (64, 64), 1),
])
def test_txt2img_as_automatic1111s_suite_sends_it(client, changes, size, count):
    r = txt2img(client, **changes)
    assert r.status_code == 200, r.text
    answer = r.json()
    info = json.loads(answer["info"])
    assert [decoded(i).size for i in answer["images"]] == [size] * count
    assert info["all_seeds"] == [321 + i for i in range(count)] and info["steps"] == 3 and info["cfg_scale"] == 7
    assert info["sampler_name"] == changes.get("sampler_index", "Euler a")
    assert info["negative_prompt"] == changes.get("negative_prompt", "")


@pytest.mark.parametrize("changes, field, words", [
    ({"restore_faces": True}, "restore_faces", "out of scope"),
])
def test_txt2img_refusals_that_remain_name_their_field(client, changes, field, words):
    """What the suite asks that is not served yet (face restoration never): a 400 that says which field and why."""
    r = txt2img(client, **changes)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    if field:
        assert r.json()["error"]["param"] == field


def test_txt2img_with_tiling_performed(client):
    """AUTOMATIC1111's tiling test: its body with tiling true is served; the infotext says `Tiling: True` (as
    AUTOMATIC1111 writes it) and the image is not the plain one of the same seed (tests/test_tiling.py checks it
    against diffusers with circular convolutions)."""
    tiled, plain = txt2img(client, tiling=True), txt2img(client)
    assert tiled.status_code == 200 and plain.status_code == 200, tiled.text
    assert "Tiling: True" in json.loads(tiled.json()["info"])["infotexts"][0]
    assert "Tiling" not in json.loads(plain.json()["info"])["infotexts"][0]
    images = [np.asarray(decoded(r.json()["images"][0]).convert("RGB"), np.int16) for r in (tiled, plain)]
    assert np.abs(images[0] - images[1]).max() > 10


def test_txt2img_with_hrfix_performed(client):
    """AUTOMATIC1111's hires fix test: its body (denoising_strength 0, read as the hires default 0.7 with a warning)
    with enable_hr; the second pass at hr_scale 2 (the default) from the "Latent" upscale (the default)."""
    r = txt2img(client, enable_hr=True)
    assert r.status_code == 200, r.text
    answer = r.json()
    info = json.loads(answer["info"])
    assert [decoded(i).size for i in answer["images"]] == [(128, 128)]
    assert info["extra_generation_params"] == {"Denoising strength": 0.7, "Hires upscale": 2.0}
    assert (info["width"], info["height"]) == (64, 64) and "Hires upscale: 2" in info["infotexts"][0]


# -- img2img ---------------------------------------------------------------------------------------------------------
def test_img2img_as_automatic1111s_suite_sends_it(client, img2img_body):
    r = client.post("/sdapi/v1/img2img", json=img2img_body)
    assert r.status_code == 200, r.text
    (image,) = r.json()["images"]
    assert decoded(image).size == (64, 64)
    assert json.loads(r.json()["info"])["extra_generation_params"]["Denoising strength"] == 0.75
    assert r.json()["parameters"]["init_images"] is None  # include_init_images false


@pytest.mark.parametrize("invert", [False, True])
def test_inpainting_keeps_the_pixels_the_mask_keeps(client, img2img_body, invert):
    r = client.post("/sdapi/v1/img2img", json={**img2img_body, "mask": png64(square_mask()),
                                               "inpainting_mask_invert": invert, "mask_blur": 0})
    assert r.status_code == 200, r.text
    out = np.asarray(decoded(r.json()["images"][0]).convert("RGB")).astype(int)
    flat = Image.new("RGBA", (64, 64), (255, 255, 255, 255))
    flat.alpha_composite(picture())
    source = np.asarray(flat.convert("RGB")).astype(int)
    inside, outside = np.zeros((64, 64), bool), np.ones((64, 64), bool)
    inside[18:46, 18:46], outside[14:50, 14:50] = True, False  # clear of the square's edge
    kept, repainted = (inside, outside) if invert else (outside, inside)
    assert np.array_equal(out[kept], source[kept])
    assert np.abs(out[repainted] - source[repainted]).mean() > 5


def test_sd_upscale_script_makes_the_upscaled_image_from_its_tiles(client, img2img_body):
    body = {**img2img_body, "script_name": "sd upscale", "script_args": ["", 8, "Lanczos", 2.0]}
    r = client.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 200, r.text
    (image,) = r.json()["images"]
    info = json.loads(r.json()["info"])
    assert decoded(image).size == (128, 128)
    assert info["extra_generation_params"]["SD upscale upscaler"] == "Lanczos"
    assert info["infotexts"][0].endswith("SD upscale overlap: 8, SD upscale upscaler: Lanczos")
    assert decoded(image).info["parameters"] == info["infotexts"][0]
    assert client.get("/sdapi/v1/scripts").json()["img2img"] == ["sd upscale"]
    bad = client.post("/sdapi/v1/img2img", json={**body, "script_args": ["", 8, "ESRGAN_4x", 2.0]})
    assert bad.status_code == 400 and "ESRGAN_4x" in bad.json()["error"]["message"]
    on_txt2img = txt2img(client, script_name="sd upscale")
    assert on_txt2img.status_code == 400 and on_txt2img.json()["error"]["param"] == "script_name"


def test_tiles_cut_and_pasted_back_unchanged_give_the_image():
    image = picture(128).convert("RGB")
    grid = split_tiles(image, 64, 64, 8)
    assert len(grid.flat()) == tile_count(128, 128, 64, 64, 8) == 9
    assert [t.x for t in grid.tiles[0]] == [0, 32, 64] and [row[0].y for row in grid.tiles] == [0, 32, 64]
    again = combine_tiles(grid, [t.image for t in grid.flat()])
    assert np.abs(np.asarray(again).astype(int) - np.asarray(image)).max() <= 1  # the ramp's 8-bit rounding
    # the script's seeds: each pass starts one higher, each batch one above the last batch's first seed
    assert tile_seeds(10, 3, 1, 2) == (10, 11, 12, 11, 12, 13)
    assert tile_seeds(10, 4, 2, 1) == (10, 11, 11, 12)


# -- extras ----------------------------------------------------------------------------------------------------------
EXTRAS = {"resize_mode": 0, "show_extras_results": True, "gfpgan_visibility": 0, "codeformer_visibility": 0,
          "codeformer_weight": 0, "upscaling_resize": 2, "upscaling_resize_w": 128, "upscaling_resize_h": 128,
          "upscaling_crop": True, "upscaler_1": "Lanczos", "upscaler_2": "None", "extras_upscaler_2_visibility": 0}


def test_extra_single_image_upscales_as_pillow_does(client):
    source = picture()
    r = client.post("/sdapi/v1/extra-single-image", json={**EXTRAS, "image": png64(source, Software="test")})
    assert r.status_code == 200, r.text
    out = decoded(r.json()["image"])
    assert out.size == (128, 128)
    assert np.array_equal(np.asarray(out.convert("RGB")),
                          np.asarray(source.convert("RGB").resize((128, 128), Image.LANCZOS)))
    assert out.info["postprocessing"] == "Postprocess upscale by: 2, Postprocess upscaler: Lanczos"
    assert out.info["Software"] == "test"  # the input's texts come back, as AUTOMATIC1111 keeps them
    assert r.json()["html_info"] == "<p>Postprocess upscale by: 2, Postprocess upscaler: Lanczos</p>"


def test_extra_single_image_with_the_image_alone_returns_it(client):
    """AUTOMATIC1111's suite posts only the image (and an unknown `model`): upscaler "None" leaves it as it is."""
    r = client.post("/sdapi/v1/extra-single-image", json={"image": png64(picture()), "model": "clip"})
    assert r.status_code == 200, r.text
    assert np.array_equal(np.asarray(decoded(r.json()["image"])), np.asarray(picture().convert("RGB")))
    assert r.headers["x-diffgraph-ignored-fields"] == "model"


def test_extras_to_a_size_cropped_and_a_second_upscaler_blended(client):
    source = picture()
    body = {**EXTRAS, "resize_mode": 1, "upscaling_resize_w": 96, "upscaling_resize_h": 80, "upscaler_2": "Nearest",
            "extras_upscaler_2_visibility": 0.5}
    r = client.post("/sdapi/v1/extra-batch-images", json={**body, "imageList": [
        {"data": png64(source), "name": "a.png"}, {"data": png64(source.rotate(90)), "name": "b.png"}]})
    assert r.status_code == 200, r.text
    images = [decoded(i) for i in r.json()["images"]]
    step = Postprocess(to_size=True, width=96, height=80, upscaler="Lanczos", second="Nearest", second_visibility=0.5)
    expected = postprocess(source.convert("RGB"), step)
    assert [i.size for i in images] == [(96, 80)] * 2 and np.array_equal(np.asarray(images[0]), np.asarray(expected))
    lanczos = upscale(source.convert("RGB"), "Lanczos", 1.5)  # 64 -> 96 (the larger factor), then cut to 96x80
    assert lanczos.size == (96, 96) and not np.array_equal(np.asarray(expected), np.asarray(lanczos.crop((0, 8, 96, 88))))


@pytest.mark.parametrize("changes, field", [
    ({"gfpgan_visibility": 0.5}, "gfpgan_visibility"), ({"codeformer_visibility": 1}, "codeformer_visibility"),
    ({"upscaler_1": "R-ESRGAN 4x+"}, "upscaler_1"), ({"upscaling_resize": 0}, "upscaling_resize"),
    ({"resize_mode": 2}, "resize_mode"), ({"upscaling_resize": 200}, "upscaling_resize"),
])
def test_extras_refusals_name_their_field(client, changes, field):
    r = client.post("/sdapi/v1/extra-single-image", json={**EXTRAS, **changes, "image": png64(picture())})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    if "visibility" in field:
        assert "face restoration" in r.json()["error"]["message"]


# -- lists and options -----------------------------------------------------------------------------------------------
def test_options_write_reads_back_the_web_ui_option(client):
    before = client.get("/sdapi/v1/options").json()["send_seed"]
    assert client.post("/sdapi/v1/options", json={"send_seed": not before}).status_code == 200
    assert client.get("/sdapi/v1/options").json()["send_seed"] is (not before)
    wrong = client.post("/sdapi/v1/options", json={"send_seed": "yes"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "send_seed"
    assert client.post("/sdapi/v1/options", json={"send_seed": before}).status_code == 200
    assert client.get("/sdapi/v1/options").json()["send_seed"] is before


def test_the_list_routes_of_the_suite_answer(client):
    got = {path: client.get(f"/sdapi/v1/{path}") for path in (
        "cmd-flags", "samplers", "upscalers", "sd-models", "hypernetworks", "face-restorers", "realesrgan-models",
        "prompt-styles", "embeddings")}
    assert all(r.status_code == 200 for r in got.values()), {p: r.text for p, r in got.items()}
    assert got["cmd-flags"].json()["ckpt"] == "random:tiny" and got["cmd-flags"].json()["use_cpu"] == ["all"]
    assert {"Euler a", "DDIM", "UniPC", "PLMS"} <= {s["name"] for s in got["samplers"].json()}
    assert [u["name"] for u in got["upscalers"].json()] == ["None", "Lanczos", "Nearest"]
    assert [m["model_name"] for m in got["sd-models"].json()] == ["random:tiny"]
    assert [got[p].json() for p in ("hypernetworks", "face-restorers", "realesrgan-models", "prompt-styles")] == [[]] * 4
    assert got["embeddings"].json() == {"loaded": {}, "skipped": {}}
