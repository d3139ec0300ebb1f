"""AUTOMATIC1111's API on `diffgraph serve --model digits` (issue 34, point 1), driven by the real `webuiapi` client
from PyPI and by raw JSON: txt2img (seeds, PNG info, the same pixels as /v1/images/generations), img2img with a mask
and "only masked", the lists, progress (with its live preview) while a job runs, interrupt and skip, keys (Bearer
and Basic) and per-key options, every field of AUTOMATIC1111's request models (tests/fixtures/a1111_api_fields.json) accepted, nulls
included, and every unsupported value or bad input answered 400 naming its field.

One module server with two API keys and a `--model-dir` holding digits-xl (sd_model_checkpoint per key and per
request); images are 64x64 with a few steps. The jobs that must still be running when progress is read are long (the
engine's most steps) and end by /interrupt, so no test waits on a wall-clock guess. Answers as AUTOMATIC1111 gives
them (hashes, LoRA, samplers) on `random:tiny` in process.

Then, in process on `digits` (conftest's `digits_client`, default settings): every sampler and scheduler name the
listings give accepted, unknown keys ignored and named, loose values coerced, Euler a with eta 0, a palette mask,
model_name as sd_model_checkpoint (a --model-dir server of its own); an /interrupt while a request's images are being
submitted; hostile infotexts and prompts sized before they are parsed and parsed on a worker thread while /health
answers.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
from PIL import Image

from offloop_util import HeldParser, post_while_probing

from diffgraph import prompt_syntax as syntax
from diffgraph.models.presets import shipped_preset_folder
from diffgraph.request import GenerationResult, RequestAborted
from diffgraph.server import a1111, a1111_protocol
from diffgraph.server.a1111_inpaint import read_mask, resize
from diffgraph.server.process import ServerProcess
from server_util import served

webuiapi = pytest.importorskip("webuiapi")

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "a1111_api_fields.json").read_text())
KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
SMALL = {"prompt": "a handwritten digit three", "width": 64, "height": 64, "steps": 3, "seed": 1}
LONG_STEPS = 200   # the engine's most: a job still running when progress is read
BOUND_S = 600      # a failure bound for loops that wait for a state, never a timing assumption


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")  # a second model, of another family, for sd_model_checkpoint
    shutil.copytree(shipped_preset_folder("digits-xl"), models / "xl" / "digits-xl")
    s = ServerProcess("--request-timeout", "900", "--api-key", KEY_A, "--api-key", KEY_B, "--model-dir", str(models),
                      model="digits")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


def _client(server, key: str):
    host, port = server.url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=4)
    api.set_auth("someone", key)
    return api


@pytest.fixture(scope="module")
def api(server):
    return _client(server, KEY_A)


@pytest.fixture(scope="module")
def other(server):
    return _client(server, KEY_B)


def post(server, path: str, body, key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{server.url}/sdapi/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=BOUND_S)


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB")).astype(int)


def b64png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def source(size: int = 96) -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))


def square_mask(size: int, lo: int, hi: int) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (lo, lo, hi, hi))
    return mask


def running(thread: threading.Thread, client, predicate) -> dict:
    """Polls the key's /progress until `predicate` holds (bounded; fails at once if the job already ended)."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and thread.is_alive():
        progress = client.get_progress()
        if predicate(progress):
            return progress
        time.sleep(0.02)
    raise AssertionError("the job ended (or never started) before /progress showed it running")


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def work():
        try:
            out["result"] = fn()
        except Exception as e:  # re-raised by the test
            out["error"] = e
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, out


# -- the webuiapi client --------------------------------------------------------------------------------------------
def test_txt2img_images_seeds_and_png_info(api):
    r = api.txt2img(prompt="a handwritten digit seven", width=64, height=64, steps=4, seed=11, batch_size=2,
                    n_iter=2)
    assert [im.size for im in r.images] == [(64, 64)] * 4
    assert r.info["all_seeds"] == [11, 12, 13, 14] and r.info["seed"] == 11
    assert sorted(r.info) == sorted(FIXTURE["info"])
    assert sorted(r.parameters) == sorted(FIXTURE["txt2img_request"])
    for i, image in enumerate(r.images):
        assert image.info["parameters"] == r.info["infotexts"][i]
        assert f"Seed: {11 + i}," in r.info["infotexts"][i] and "Sampler: Euler a" in r.info["infotexts"][i]
    alone = api.txt2img(prompt="a handwritten digit seven", width=64, height=64, steps=4, seed=13)
    # each image is reproducible alone: the same up to the rounding of batched float math (the engine's own tests:
    # batched rows equal each alone within 1e-4)
    assert np.abs(pixels(alone.image) - pixels(r.images[2])).max() <= 1


def test_txt2img_equals_images_generations(server, api):
    # 12 steps: the A1111 request gets a live preview at step 10 (for /progress), which leaves the image as it is
    r = api.txt2img(prompt="a handwritten (digit:1.1) five", sampler_name="Euler", scheduler="Automatic", width=64,
                    height=64, steps=12, cfg_scale=5, seed=21)
    v1 = httpx.post(server.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY_A}"},
                    timeout=BOUND_S, json={"prompt": "a handwritten (digit:1.1) five", "size": "64x64", "seed": 21,
                                           "num_inference_steps": 12, "guidance_scale": 5, "sampler": "euler",
                                           "prompt_syntax": "a1111"})
    assert v1.status_code == 200, v1.text
    expected = Image.open(io.BytesIO(base64.b64decode(v1.json()["data"][0]["b64_json"])))
    assert np.array_equal(pixels(r.image), pixels(expected))


def test_webuiapi_ddim_with_its_default_eta_equals_images_generations_with_eta(server, api):
    """webuiapi sends eta 1.0 with every request: DDIM runs it as diffusers' DDIM eta 1 (it was refused), the image
    the images API gives for the same eta, and the infotext says so as AUTOMATIC1111's does."""
    r = api.txt2img(prompt="a handwritten digit three", sampler_name="DDIM", width=64, height=64, steps=6,
                    cfg_scale=5, seed=31)
    assert "Sampler: DDIM" in r.info["infotexts"][0] and "Eta DDIM: 1" in r.info["infotexts"][0]
    v1 = httpx.post(server.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY_A}"},
                    timeout=BOUND_S, json={"prompt": "a handwritten digit three", "size": "64x64", "seed": 31,
                                           "num_inference_steps": 6, "guidance_scale": 5, "sampler": "ddim",
                                           "eta": 1.0, "prompt_syntax": "a1111"})
    assert v1.status_code == 200, v1.text
    expected = Image.open(io.BytesIO(base64.b64decode(v1.json()["data"][0]["b64_json"])))
    assert np.array_equal(pixels(r.image), pixels(expected))

def test_controlnet_units_from_webuiapi_equal_images_generations_controls(server, api):
    """webuiapi's ControlNetUnit (its defaults: Resize and Fill, thresholds 64 / 64) against the digits model's
    built-in `outline` ControlNet gives /v1/images/generations' image for the same controls; the extension's model
    and module lists answer."""
    outline = Image.new("RGB", (48, 64))
    outline.paste(Image.new("RGB", (20, 40), (255, 255, 255)), (14, 12))
    unit = webuiapi.ControlNetUnit(image=outline, module="canny", model="outline [0123abcd]", weight=0.9,
                                   guidance_end=0.8)
    r = api.txt2img(prompt="a handwritten digit one", sampler_name="Euler", width=64, height=64, steps=6, seed=5,
                    cfg_scale=5, controlnet_units=[unit], alwayson_scripts={})  # webuiapi's own default dict keeps
    # the units it adds for every later call (a mutable default): a fresh one keeps them to this call
    body = {"prompt": "a handwritten digit one", "size": "64x64", "seed": 5, "num_inference_steps": 6,
            "guidance_scale": 5, "sampler": "euler", "prompt_syntax": "a1111",
            "controls": [{"model": "outline", "image": b64png(outline), "preprocess": "canny", "canny_low": 64,
                          "canny_high": 64, "scale": 0.9, "end": 0.8, "resize_mode": "resize_and_fill"}]}
    v1 = httpx.post(server.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY_A}"},
                    timeout=BOUND_S, json=body)
    assert v1.status_code == 200, v1.text
    expected = Image.open(io.BytesIO(base64.b64decode(v1.json()["data"][0]["b64_json"])))
    assert np.array_equal(pixels(r.image), pixels(expected))
    plain = httpx.post(server.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY_A}"},
                       timeout=BOUND_S, json=dict(body, controls=None))
    assert not np.array_equal(pixels(r.image), pixels(Image.open(io.BytesIO(base64.b64decode(
        plain.json()["data"][0]["b64_json"])))))
    headers = {"Authorization": f"Bearer {KEY_A}"}
    assert httpx.get(server.url + "/controlnet/model_list", headers=headers).json() == {"model_list": ["outline"]}
    assert "canny" in httpx.get(server.url + "/controlnet/module_list", headers=headers).json()["module_list"]
    labels = httpx.get(server.url + "/controlnet/module_list?alias_names=true", headers=headers).json()
    assert labels["module_list"] == ["none", "canny", "invert (from white bg & black line)"] == list(
        labels["module_detail"])
    assert labels["module_detail"]["canny"] == {"model_free": False, "sliders": [  # the extension's, its slider values
        {"name": "Resolution", "value": 512, "min": 64, "max": 2048, "step": 8},
        {"name": "Low Threshold", "value": 100, "min": 1, "max": 255, "step": 1},
        {"name": "High Threshold", "value": 200, "min": 1, "max": 255, "step": 1}]}
    assert labels["module_detail"]["invert (from white bg & black line)"] == {"model_free": False, "sliders": []}


def test_controlnet_units_as_the_extension_reads_them(server):
    """An img2img unit without its own image takes the init image; thresholds of -1 are canny's 100 / 200, and 200 /
    100 (a low above the high) the same edges (OpenCV swaps them); an unknown unit key is ignored and named."""
    outline = Image.new("RGB", (64, 64))
    outline.paste(Image.new("RGB", (20, 40), (255, 255, 255)), (22, 12))
    body = {**SMALL, "steps": 4, "sampler_name": "Euler", "init_images": [b64png(outline)], "denoising_strength": 0.9}
    unit = {"model": "outline", "module": "canny", "threshold_a": -1, "threshold_b": -1, "weight": 1.5}

    def img2img(*units: dict) -> httpx.Response:
        r = post(server, "img2img", {**body, "alwayson_scripts": {"controlnet": {"args": list(units)}}})
        assert r.status_code == 200, r.text
        return r
    bare = img2img({**unit, "sketch": True})
    assert bare.headers["X-Diffgraph-Ignored-Fields"] == "alwayson_scripts.controlnet.args%5B0%5D.sketch"
    given = img2img({**unit, "input_image": b64png(outline)})
    swapped = img2img({**unit, "input_image": b64png(outline), "threshold_a": 200, "threshold_b": 100})
    assert bare.json()["images"] == given.json()["images"] == swapped.json()["images"]
    assert img2img().json()["images"] != bare.json()["images"]  # the unit ran


def test_controlnet_detected_maps_follow_the_images_as_the_extension_appends_them(server):
    """Each unit's detected map comes after the request's images (its `save_detected_map`, default true): OpenCV's
    Canny of the unit's image at the image size; with the hires fix the second pass's map, then the first pass's; a
    unit with save_detected_map false adds none. The seeds and infotexts stay the generated images'."""
    outline = Image.new("RGB", (64, 64))
    outline.paste(Image.new("RGB", (20, 40), (255, 255, 255)), (22, 12))
    edges = np.repeat(cv2.Canny(np.asarray(outline), 100, 200)[:, :, None], 3, axis=2).astype(int)
    unit = {"model": "outline", "module": "canny", "input_image": b64png(outline), "threshold_a": -1,
            "threshold_b": -1}

    def txt2img(*units: dict, **body) -> tuple[list[Image.Image], dict]:
        r = post(server, "txt2img", {**SMALL, "steps": 2, **body, "alwayson_scripts": {"ControlNet": {
            "args": list(units)}}})
        assert r.status_code == 200, r.text
        return [Image.open(io.BytesIO(base64.b64decode(i))) for i in r.json()["images"]], json.loads(r.json()["info"])
    images, info = txt2img(unit, {**unit, "save_detected_map": False}, {**unit, "save_detected_map": "true"},
                           batch_size=2)
    assert len(images) == 4 and len(info["all_seeds"]) == len(info["infotexts"]) == 2
    assert [i.size for i in images] == [(64, 64)] * 4
    assert np.array_equal(pixels(images[2]), edges) and np.array_equal(pixels(images[3]), edges)
    assert "parameters" in images[0].info and "parameters" not in images[2].info  # a map, not a generated image
    images, _ = txt2img({**unit, "save_detected_map": False})
    assert len(images) == 1
    images, _ = txt2img(unit, enable_hr=True, hr_scale=2, denoising_strength=0.5)
    assert [i.size for i in images] == [(128, 128), (128, 128), (64, 64)] and np.array_equal(pixels(images[2]), edges)
    resized = Image.fromarray(edges.astype(np.uint8)).resize((128, 128), Image.LANCZOS)  # "Crop and Resize", square
    assert np.array_equal(pixels(images[1]), pixels(resized))


def test_controlnet_thresholds_out_of_range_take_the_sliders_defaults_logged_in_the_extensions_words(caplog):
    from diffgraph.server.a1111_controlnet import thresholds
    with caplog.at_level(logging.INFO, logger="diffgraph.server"):
        assert thresholds("canny", -100, 300) == (100, 200)
        assert thresholds("canny", -1, None) == (100, 200)  # -1: the clients' "unset", taken without a word
        assert thresholds("canny", 50.5, "x") == (50.5, "x")  # in range; not a number: the request's 400
    assert [r.getMessage() for r in caplog.records] == [
        "[canny.threshold_a] Invalid value(-100.0), using default value 100.",
        "[canny.threshold_b] Invalid value(300.0), using default value 200."]


def test_img2img_with_a_mask_only_masked_and_whole(api):
    src, mask = source(96), square_mask(96, 40, 60)
    common = dict(images=[src], mask_image=mask, prompt="a handwritten digit eight", width=64, height=64, steps=6,
                  seed=5, denoising_strength=0.9, mask_blur=2)
    only = api.img2img(inpaint_full_res=True, inpaint_full_res_padding=8, **common)
    out = pixels(only.image)
    assert only.image.size == (96, 96)  # only the masked box ran (at 64x64), pasted back into the whole image
    far = np.ones((96, 96), bool)
    far[30:70, 30:70] = False           # beyond the square and its blur
    assert np.array_equal(out[far], pixels(src)[far])
    assert np.abs(out[44:56, 44:56] - pixels(src)[44:56, 44:56]).mean() > 5
    assert "Size: 64x64" in only.info["infotexts"][0] and "Denoising strength: 0.9" in only.info["infotexts"][0]
    assert only.info["extra_generation_params"]["Inpaint area"] == "Only masked"

    whole = api.img2img(inpaint_full_res=False, **common)
    resized = pixels(src.resize((64, 64), Image.Resampling.LANCZOS))
    near = np.ones((64, 64), bool)
    near[14:53, 14:53] = False          # the square scaled to 64x64, with its resampling and blur
    assert whole.image.size == (64, 64) and np.array_equal(pixels(whole.image)[near], resized[near])

    plain = api.img2img(images=[src], prompt="a handwritten digit eight", width=64, height=64, steps=6, seed=5)
    assert plain.image.size == (64, 64) and np.abs(pixels(plain.image) - resized).mean() > 1


def test_lists_have_automatic1111s_fields(api):
    models = api.get_sd_models()
    assert [sorted(m) for m in models] == [sorted(FIXTURE["sd_model_item"])] * 2
    assert api.util_get_model_names() == ["digits", "xl/digits-xl"]
    samplers = {s["name"]: s for s in api.get_samplers()}
    assert all(sorted(s) == sorted(FIXTURE["sampler_item"]) for s in samplers.values())
    assert {"Euler a", "Euler", "DPM++ 2M", "DDIM"} <= set(samplers)
    assert samplers["DPM++ 2M"]["options"] == {"scheduler": "karras"}
    schedulers = api.get_schedulers()
    assert all(sorted(s) == sorted(FIXTURE["scheduler_item"]) for s in schedulers)
    assert {"automatic", "karras", "exponential"} <= set(api.util_get_scheduler_names())
    assert all(sorted(x) == sorted(FIXTURE["lora_item"]) for x in api.get_loras())
    assert sorted(api.get_embeddings()) == sorted(FIXTURE["embeddings_response"])
    assert [u["name"] for u in api.get_upscalers()] == ["None", "Lanczos", "Nearest"]
    assert sorted(api.get_scripts()) == sorted(FIXTURE["scripts_list"])
    options = api.get_options()
    assert set(FIXTURE["options"]) <= set(options) and options["sd_model_checkpoint"] == "digits"
    assert api.util_get_current_model() == "digits"
    progress = api.get_progress()
    assert sorted(progress) == sorted(FIXTURE["progress_response"])
    assert sorted(progress["state"]) == sorted(FIXTURE["progress_state"])
    assert progress["progress"] == 0 and progress["state"]["job_count"] == 0


def test_progress_while_a_job_runs_then_interrupt(server, api, other):
    thread, out = in_thread(lambda: api.txt2img(prompt="a handwritten digit one", width=64, height=64,
                                                steps=LONG_STEPS, seed=30, batch_size=2))
    progress = running(thread, api, lambda p: p["current_image"] is not None)  # a live preview, every 10 steps
    state = progress["state"]
    assert state["job"] == "txt2img" and state["job_count"] == 2 and state["sampling_steps"] == LONG_STEPS
    assert state["sampling_step"] >= 10 and 0 < progress["progress"] < 1 and progress["eta_relative"] >= 0
    preview = Image.open(io.BytesIO(base64.b64decode(progress["current_image"])))
    assert preview.format == "PNG" and preview.size[0] > 0
    bare = httpx.get(server.url + "/sdapi/v1/progress", params={"skip_current_image": "true"}, auth=("a", KEY_A),
                     timeout=BOUND_S).json()
    assert bare["current_image"] is None and bare["state"]["job_count"] == 2
    assert other.get_progress()["state"]["job_count"] == 0  # the other key's requests only
    other.interrupt()                                        # ... and its interrupt stops none of this key's
    assert api.get_progress()["state"]["job_count"] == 2
    api.interrupt()
    thread.join(BOUND_S)
    assert "error" not in out, out.get("error")
    r = out["result"]
    assert r.images == [] and r.info["all_seeds"] == [30, 31] and "interrupt" in r.json["warnings"][0]
    api.util_wait_for_ready(check_interval=0.05)  # idle again: progress 0 and job_count 0


def test_skip_stops_only_the_current_image(api):
    thread, out = in_thread(lambda: api.txt2img(prompt="a handwritten digit two", width=64, height=64, steps=60,
                                                seed=40, batch_size=2))
    running(thread, api, lambda p: p["state"]["sampling_step"] >= 1)
    api.skip()
    thread.join(BOUND_S)
    assert "error" not in out, out.get("error")
    r = out["result"]
    assert len(r.images) == 1 and "Seed: 41," in r.info["infotexts"][0] and r.info["all_seeds"] == [40, 41]


def test_prompts_are_read_in_automatic1111s_syntax(server, api):
    tagged = api.txt2img(prompt="a handwritten (digit:1.2) four <lora:pencil:0.8>", sampler_name="Euler", width=64,
                         height=64, steps=4, seed=8)
    assert "<lora:pencil:0.8>" in tagged.info["infotexts"][0]
    v1 = httpx.post(server.url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY_A}"},
                    timeout=BOUND_S, json={"prompt": "a handwritten (digit:1.2) four", "size": "64x64", "seed": 8,
                                           "num_inference_steps": 4, "guidance_scale": 7, "sampler": "euler",
                                           "prompt_syntax": "a1111", "loras": [{"name": "pencil", "scale": 0.8}]})
    assert v1.status_code == 200, v1.text  # the tag is the adapter at that scale, not text
    expected = Image.open(io.BytesIO(base64.b64decode(v1.json()["data"][0]["b64_json"])))
    assert np.array_equal(pixels(tagged.image), pixels(expected))


# -- keys and options ----------------------------------------------------------------------------------------------
def test_bearer_and_basic_auth(server):
    url = server.url + "/sdapi/v1/options"
    refused = httpx.get(url, timeout=BOUND_S)
    assert refused.status_code == 401 and 'Basic realm="diffgraph"' in refused.headers.get_list("www-authenticate")
    assert "HTTP Basic" in refused.json()["error"]["message"]
    assert httpx.get(url, auth=("someone", "wrong"), timeout=BOUND_S).status_code == 401
    assert httpx.get(url, auth=("anyone", KEY_B), timeout=BOUND_S).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=BOUND_S).status_code == 200


def test_sd_model_checkpoint_picks_the_model_per_key_and_per_request(api, other):
    try:
        api.util_set_model("xl/digits-xl")
        assert api.util_get_current_model() == "xl/digits-xl" and other.util_get_current_model() == "digits"
        r = api.txt2img(**SMALL)
        assert r.info["sd_model_name"] == "xl/digits-xl" and "Model: xl/digits-xl" in r.info["infotexts"][0]
        assert other.txt2img(**SMALL).info["sd_model_name"] == "digits"
        once = other.txt2img(**SMALL, override_settings={"sd_model_checkpoint": "xl/digits-xl"})
        assert once.info["sd_model_name"] == "xl/digits-xl" and other.util_get_current_model() == "digits"
    finally:
        api.set_options({"sd_model_checkpoint": "digits"})
    assert api.util_get_current_model() == "digits"


def test_options_are_per_key(server, api, other):
    try:
        api.set_options({"CLIP_stop_at_last_layers": 2})
        assert api.get_options()["CLIP_stop_at_last_layers"] == 2
        assert other.get_options()["CLIP_stop_at_last_layers"] == 1
        r = api.txt2img(**{k: v for k, v in SMALL.items()})
        assert r.info["clip_skip"] == 2 and "Clip skip: 2" in r.info["infotexts"][0]
        assert "Clip skip" not in other.txt2img(**SMALL).info["infotexts"][0]
    finally:
        api.set_options({"CLIP_stop_at_last_layers": 1})
    api.util_set_model("digits")
    assert api.util_get_current_model() == "digits"
    for body, param in (({"sd_model_checkpoint": "nope"}, "sd_model_checkpoint"),
                        ({"CLIP_stop_at_last_layers": 13}, "CLIP_stop_at_last_layers")):
        r = post(server, "options", body)
        assert r.status_code == (404 if param == "sd_model_checkpoint" else 400), r.text
        assert r.json()["error"]["param"] == param, r.text
    r = post(server, "options", {"sd_vae": "x.vae"})  # accepted, its value kept (as a client's whole set is)
    assert r.status_code == 200 and r.headers["X-Diffgraph-Ignored-Fields"] == "sd_vae", r.text
    assert api.get_options()["sd_vae"] == "Automatic"
    r = post(server, "options", {"sd_vae": "Automatic", "sd_model_checkpoint": "digits", "samples_format": "png"})
    assert r.status_code == 200 and r.json() is None
    assert post(server, "options", ["sd_model_checkpoint"]).status_code == 400


def test_tiling_null_is_the_tiling_option(server, api):
    """AUTOMATIC1111's `tiling` option: POST /sdapi/v1/options sets it per key, and a body's `tiling` null (or left
    out) takes it, as AUTOMATIC1111's processing does; an explicit false does not; override_settings sets it for one
    request."""
    def infotext(answer: dict) -> str:
        return json.loads(answer["info"])["infotexts"][0]

    explicit = post(server, "txt2img", {**SMALL, "tiling": True}).json()
    try:
        assert post(server, "options", {"tiling": True}).status_code == 200
        assert api.get_options()["tiling"] is True
        null = post(server, "txt2img", {**SMALL, "tiling": None}).json()
        assert "Tiling: True" in infotext(null) and null["images"] == explicit["images"]
        assert "Tiling" not in infotext(post(server, "txt2img", {**SMALL, "tiling": False}).json())
        assert "Tiling" not in infotext(post(server, "txt2img", {**SMALL, "tiling": None}, key=KEY_B).json())
        refused = post(server, "options", {"tiling": "yes"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tiling"
    finally:
        post(server, "options", {"tiling": False})
    assert api.get_options()["tiling"] is False
    assert "Tiling" not in infotext(post(server, "txt2img", SMALL).json())
    overridden = post(server, "txt2img", {**SMALL, "override_settings": {"tiling": True}}).json()
    assert overridden["images"] == explicit["images"]


def test_eta_noise_seed_delta_is_applied(server, api):
    """AUTOMATIC1111's eta_noise_seed_delta option (per key, or override_settings): an ancestral sampler's later noise
    from seed + delta, written as `ENSD` in the infotext and read back from an `infotext` field."""
    body = {**SMALL, "sampler_name": "Euler a"}
    plain = post(server, "txt2img", body).json()
    try:
        assert post(server, "options", {"eta_noise_seed_delta": 31337}).status_code == 200
        assert api.get_options()["eta_noise_seed_delta"] == 31337
        keyed = post(server, "txt2img", body).json()
    finally:
        post(server, "options", {"eta_noise_seed_delta": 0})
    text = json.loads(keyed["info"])["infotexts"][0]
    assert "ENSD: 31337" in text and keyed["images"] != plain["images"]
    overridden = post(server, "txt2img", {**body, "override_settings": {"eta_noise_seed_delta": 31337}}).json()
    pasted = post(server, "txt2img", {"infotext": text}).json()
    assert overridden["images"] == keyed["images"] == pasted["images"]
    refused = post(server, "options", {"eta_noise_seed_delta": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "eta_noise_seed_delta"


# -- raw JSON: every field -----------------------------------------------------------------------------------------
def _init(**body) -> dict:
    return {"init_images": [b64png(source(64))], **SMALL, **body}


@pytest.mark.parametrize("route", ["txt2img", "img2img"])
def test_every_field_of_automatic1111s_model_is_accepted_nulls_too(server, route):
    fields = FIXTURE[f"{route}_request"]
    extra = _init(mask=b64png(square_mask(64, 16, 48))) if route == "img2img" else SMALL
    for body in ({**fields, **extra}, {**{k: None for k in fields}, **extra}):
        r = post(server, route, body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert sorted(answer) == sorted(FIXTURE[f"{route}_response"])
        excluded = FIXTURE["request_fields_excluded_from_parameters"]
        assert sorted(answer["parameters"]) == sorted(k for k in fields if k not in excluded)
        assert sorted(json.loads(answer["info"])) == sorted(FIXTURE["info"]) and len(answer["images"]) == 1


UNSUPPORTED = [
    ({"enable_hr": True, "hr_upscaler": "SwinIR_4x"}, "hr_upscaler", "not available here"),
    ({"restore_faces": True}, "restore_faces", "face restoration"),
    ({"s_churn": 0.5}, "s_churn", "send 0"),
    ({"s_min_uncond": 0.2}, "s_min_uncond", "send 0"), ({"s_noise": 0.9}, "s_noise", "send 1"),
    ({"refiner_checkpoint": "sdxl_refiner"}, "refiner_checkpoint", "refiners"),
    ({"firstpass_image": "abc"}, "firstpass_image", "send null"),
    ({"disable_extra_networks": True}, "disable_extra_networks", "<lora:...>"),
    ({"script_name": "x/y/z plot"}, "script_name", "is not available on this route"),
    ({"alwayson_scripts": {"ControlNet": {"args": [{"module": "depth_midas", "model": "outline",
                                                    "input_image": "eA=="}]}}},
     "alwayson_scripts.controlnet.args[0].module", "send its map with module"),
    ({"alwayson_scripts": {"ControlNet": {"args": [{"module": "canny", "model": "control_v11p_sd15_canny [d14c016b]",
                                                    "input_image": "eA=="}]}}},
     "alwayson_scripts.controlnet.args[0].model", "not served here; served: outline"),
    ({"alwayson_scripts": {"ADetailer": {"args": [True, {}]}}}, "alwayson_scripts.ADetailer", "not supported"),
    ({"sampler_name": "DPM2 a", "eta": 0.5}, "eta", "eta 1"), ({"sampler_name": "DDIM", "eta": 1.5}, "eta", "[0, 1]"),
    ({"override_settings": {"sd_vae": "x.vae"}}, "override_settings.sd_vae", "cannot be overridden"),
    ({"override_settings": {"sd_model_checkpoint": "nope"}}, "override_settings.sd_model_checkpoint", "'nope'"),
    ({"override_settings": {"CLIP_stop_at_last_layers": 0}}, "override_settings.CLIP_stop_at_last_layers", "1..12"),
]
BAD = [
    ({"sampler_name": "DPM adaptive"}, "sampler_name", "not supported: its step count adapts"),
    ({"sampler_name": "Euler CFG++"}, "sampler_name", "not supported here"),
    ({"sampler_name": "Eulr"}, "sampler_name", "did you mean"),
    ({"scheduler": "Linear Quadratic"}, "scheduler", "not supported yet"),
    ({"steps": 0}, "steps", "steps 0 is out of range"), ({"steps": "twenty"}, "steps", "must be an integer"),
    ({"cfg_scale": -1}, "cfg_scale", "cfg_scale -1"), ({"width": 500}, "width", "use 496 or 504"),
    ({"batch_size": 0}, "batch_size", "at least 1"), ({"batch_size": 9, "n_iter": 2}, "n_iter", "at most 16"),
    ({"seed": -2}, "seed", "-1 (random)"),
    ({"subseed_strength": 1.5}, "subseed_strength", "[0, 1]"), ({"subseed_strength": -0.2}, "subseed_strength", None),
    ({"seed_resize_from_w": -5, "seed_resize_from_h": 64}, "seed_resize_from_w", "-1 or 0 (no resize)"),
    ({"subseed": -7, "subseed_strength": 0.3}, "subseed", "-1 (random)"),
    ({"prompt": "a [" + "|".join("abcdefghijklmnopq") + "]", "steps": 20}, "prompt", "more than 16"),
    ({"prompt": "a <lora:nope:1>"}, "prompt", "'nope' is unknown"),
    ({"infotext": "x\nSteps: nine, Sampler: Euler, Seed: 1"}, "infotext", "not a number"),
]
IMG2IMG_BAD = [
    ({"init_images": None}, "init_images", "init_images is required"),
    ({"init_images": ["not base64 at all!"]}, "init_images[0]", None),
    ({"init_images": ["http://example.com/a.png"]}, "init_images[0]", "does not fetch URLs"),
    ({"init_images": [b64png(source(64))] * 2, "batch_size": 3}, "init_images", "send 1"),
    ({"denoising_strength": 0}, "denoising_strength", "denoising_strength 0"),
    ({"inpainting_fill": 2}, "inpainting_fill", "latent noise"), ({"resize_mode": 3}, "resize_mode", "allowed"),
    ({"mask_round": False}, "mask_round", "send true"), ({"latent_mask": "abc"}, "latent_mask", "send null"),
    ({"initial_noise_multiplier": 0.5}, "initial_noise_multiplier", "send 1"),
    ({"mask_blur": -1, "mask": b64png(square_mask(64, 8, 40))}, "mask_blur", "0..256"),
    ({"inpainting_mask_invert": 2}, "inpainting_mask_invert", "0 (repaint"),
    ({"mask": "////"}, "mask", None),
]


@pytest.mark.parametrize("route,body,param,needle", [("txt2img", *c) for c in UNSUPPORTED + BAD]
                         + [("img2img", *c) for c in IMG2IMG_BAD + UNSUPPORTED[1:4]])
def test_unsupported_and_bad_values_get_a_400_naming_the_field(server, route, body, param, needle):
    r = post(server, route, {**(_init() if route == "img2img" else SMALL), **body})
    assert r.status_code == (404 if param.endswith("sd_model_checkpoint") else 400), r.text  # an unknown model: 404
    error = r.json()["error"]
    assert error["param"] == param, error
    assert needle is None or needle in error["message"], error["message"]


def test_fields_that_shape_the_answer(server):
    def answer(route="txt2img", **body) -> dict:
        r = post(server, route, {**(_init() if route == "img2img" else SMALL), **body})
        assert r.status_code == 200, r.text
        return {**r.json(), "info": json.loads(r.json()["info"])}

    ignored = answer(styles=["cinematic"], save_images=True, alwayson_scripts={"ControlNet": {"args": []}})
    assert any("styles" in w for w in ignored["warnings"]) and any("save_images" in w for w in ignored["warnings"])
    assert "warnings" not in answer()
    hidden = answer(send_images=False, n_iter=2, seed=-1)
    seeds = hidden["info"]["all_seeds"]
    assert hidden["images"] == [] and len(hidden["info"]["infotexts"]) == 2 and seeds[1] == seeds[0] + 1
    karras = answer(sampler_name="DPM++ 2M")["info"]["infotexts"][0]  # "Automatic": the sampler's own schedule
    assert "Sampler: DPM++ 2M, Schedule type: Karras" in karras
    exponential = answer(sampler_name="DPM++ 2M", scheduler="exponential")["info"]["infotexts"][0]
    assert "Schedule type: Exponential" in exponential
    still = answer(sampler_name="DDIM", eta=0)
    assert still["info"]["sampler_name"] == "DDIM"
    noisy = answer(sampler_name="DDIM", eta=1.0)  # webuiapi's default eta: DDIM with eta 1 (diffusers' DDIM eta)
    assert noisy["images"][0] != still["images"][0] and "Eta DDIM: 1" in noisy["info"]["infotexts"][0]
    assert answer(sampler_name="Euler", eta=0.3, s_tmax=0, s_tmin=0, s_noise=1)["info"]["sampler_name"] == "Euler"
    text = ("a handwritten digit two\nNegative prompt: blurry\n"
            "Steps: 2, Sampler: DPM++ 2M, CFG scale: 4, Seed: 9, Size: 64x64")
    pasted = post(server, "txt2img", {"infotext": text, "steps": 3})
    told = json.loads(pasted.json()["info"])  # the infotext fills the fields the body does not set (not steps)
    assert (told["prompt"], told["negative_prompt"], told["seed"], told["steps"], told["sampler_name"], told["width"]) \
        == ("a handwritten digit two", "blurry", 9, 3, "DPM++ 2M", 64)
    assert answer("img2img")["parameters"]["init_images"] is None
    assert answer("img2img", include_init_images=True)["parameters"]["init_images"] == _init()["init_images"]


# -- answers as AUTOMATIC1111 gives them, on random:tiny in process ------------------------------------------------
TINY = {"prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 3, "sampler_name": "Euler"}


@pytest.fixture(scope="module")
def tiny(tiny_engine, tmp_path_factory):
    """random:tiny with a LoRA folder (styles/ink.safetensors), served as if --model were a checkpoint file (its
    hash is the file's; the engine is the tiny one); hashes cached in a folder of the test's."""
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from lora_util import _write_kohya
    root = tmp_path_factory.mktemp("tiny")
    (root / "loras" / "styles").mkdir(parents=True)
    _write_kohya(tiny_engine, str(root / "loras" / "styles" / "ink.safetensors"))
    (root / "tiny.safetensors").write_bytes(os.urandom(4096))
    config = ServerConfig(model=str(root / "tiny.safetensors"), device="cpu", lora_dir=str(root / "loras"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFGRAPH_CACHE", str(root / "cache"))
        with Engine("random:tiny", device="cpu", dtype="fp32", lora_dir=str(root / "loras"), max_loras=4) as engine, \
                served(engine, config) as client:
            yield client, root


def _tiny_txt2img(client, **body) -> tuple[dict, dict]:
    r = client.post("/sdapi/v1/txt2img", json={**TINY, **body})
    assert r.status_code == 200, r.text
    return r.json(), json.loads(r.json()["info"])


def _hash_becomes(client, want: str, before: str | None = None) -> None:
    """Waits until the answers carry `want` as sd_model_hash (null, or `before`, until the background hash is done)."""
    deadline = time.monotonic() + 120  # a failure bound: the hash is made on a background thread
    while (got := _tiny_txt2img(client, steps=1)[1]["sd_model_hash"]) != want:
        assert got in (None, before) and time.monotonic() < deadline, got
        threading.Event().wait(0.05)


def test_model_and_lora_hashes_as_automatic1111_writes_them(tiny):
    """sd_model_hash and `Model hash` are the first 10 hex digits of the checkpoint's sha256; `Lora hashes` each
    adapter's first 12 of its sha256 after the safetensors header (AUTOMATIC1111's LoRA hash), in the infotext and
    in the image; restore_faces false."""
    client, root = tiny
    model_hash = hashlib.sha256((root / "tiny.safetensors").read_bytes()).hexdigest()[:10]
    _hash_becomes(client, model_hash)
    answer, info = _tiny_txt2img(client, prompt="a red fox <lora:styles/ink:0.6>")
    data = (root / "loras" / "styles" / "ink.safetensors").read_bytes()
    lora_hash = hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()[:12]
    text = info["infotexts"][0]
    assert info["sd_model_hash"] == model_hash and info["restore_faces"] is False
    assert f'Size: 64x64, Model hash: {model_hash}, Model: "random:tiny"' in text
    assert f'Lora hashes: "styles/ink: {lora_hash}"' in text
    assert Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))).text["parameters"] == text
    _, plain = _tiny_txt2img(client)
    assert "Lora hashes" not in plain["infotexts"][0] and plain["sd_model_hash"] == model_hash


def test_a_checkpoint_is_hashed_per_file_version(tiny):
    """`sd_model_hash` is the checkpoint's short hash once the background hash is known (null before: no request
    waits for it), and a rewritten checkpoint is hashed again (tests/test_file_hashes.py counts the reads)."""
    client, root = tiny
    checkpoint = root / "tiny.safetensors"
    before = checkpoint.read_bytes()
    old = hashlib.sha256(before).hexdigest()[:10]
    _hash_becomes(client, old)
    try:
        checkpoint.write_bytes(b"another version")  # a new size and mtime: hashed again
        new = hashlib.sha256(b"another version").hexdigest()[:10]
        _hash_becomes(client, new, old)
    finally:
        checkpoint.write_bytes(before)
    _hash_becomes(client, old, new)  # known again before the next test compares whole images


def test_lora_paths_are_relative_to_the_lora_folder(tiny):
    client, root = tiny
    loras = client.get("/sdapi/v1/loras").json()
    assert [(x["name"], x["path"]) for x in loras] == [("styles/ink", "styles/ink.safetensors")]
    assert str(root) not in client.get("/sdapi/v1/loras").text


def test_an_empty_prompt_makes_the_empty_prompts_image(tiny):
    """AUTOMATIC1111 takes an empty prompt on txt2img (the empty prompt's conditioning), as the Python API does;
    OpenAI's generations route still asks for one (tests/test_server.py)."""
    client, _ = tiny
    answer, info = _tiny_txt2img(client, prompt="")
    assert info["prompt"] == "" and info["infotexts"][0].startswith("Steps: 2, ")
    other, _ = _tiny_txt2img(client)
    assert answer["images"][0] != other["images"][0]
    assert _tiny_txt2img(client, prompt=None)[0]["images"] == answer["images"]  # null: the default, ""


def test_variation_seeds_as_automatic1111_mixes_them(tiny, tiny_engine):
    """subseed_strength mixes each image's subseed into its noise (the engine's `variation`, the same image), and
    the infotext says so; strength 0 (and -1 sizes) is the seed alone; seed_resize_from_w/h changes the noise."""
    client, _ = tiny
    body = {"subseed": 11, "subseed_strength": 0.3, "batch_size": 2}
    answer, info = _tiny_txt2img(client, **body)
    assert info["all_subseeds"] == [11, 12] and info["subseed_strength"] == 0.3
    for i, text in enumerate(info["infotexts"]):
        assert f"Variation seed: {11 + i}, Variation seed strength: 0.3" in text and "Seed resize" not in text
    images = [pixels(Image.open(io.BytesIO(base64.b64decode(b)))) for b in answer["images"]]
    direct = tiny_engine.generate("a red fox", width=64, height=64, num_inference_steps=2, seed=4, sampler="euler",
                                  guidance_scale=7.0, prompt_syntax="a1111", output_format="png",
                                  variation={"subseed": 12, "strength": 0.3})  # the second image's seeds
    # the same image (to a rounding step: the route's two rows ran in one batch)
    assert np.abs(images[1] - pixels(Image.open(io.BytesIO(direct.encoded[0])))).max() <= 1
    plain = _tiny_txt2img(client, subseed=11, subseed_strength=0, seed_resize_from_w=-1, seed_resize_from_h=-1)
    none = _tiny_txt2img(client)
    assert plain[0]["images"][0] == none[0]["images"][0] and "Variation" not in plain[1]["infotexts"][0]
    assert np.abs(pixels(Image.open(io.BytesIO(base64.b64decode(plain[0]["images"][0])))).astype(int)
                  - images[0].astype(int)).max() > 2
    resized, info = _tiny_txt2img(client, seed_resize_from_w=32, seed_resize_from_h=96)
    assert "Seed resize from: 32x96" in info["infotexts"][0] and resized["images"][0] != none[0]["images"][0]
    again, _ = _tiny_txt2img(client, infotext=info["infotexts"][0])  # the infotext's settings make it again
    assert np.array_equal(*(pixels(Image.open(io.BytesIO(base64.b64decode(a["images"][0])))) for a in (again, resized)))


def test_ddim_cfgpp_by_its_automatic1111_label_and_alias(tiny):
    """sampler_name "DDIM CFG++" (and its alias ddim_cfgpp) runs diffgraph's ddim_cfgpp with the body's eta: the
    images route's image for the same request, listed by GET /sdapi/v1/samplers, written in the infotext (eta as
    "Eta DDIM", as AUTOMATIC1111 writes it for its timestep samplers) and read back from it."""
    client, _ = tiny
    answer, info = _tiny_txt2img(client, sampler_name="DDIM CFG++", cfg_scale=6, steps=3, eta=0.4)
    text = info["infotexts"][0]
    assert info["sampler_name"] == "DDIM CFG++" and "Sampler: DDIM CFG++" in text and "Eta DDIM: 0.4" in text
    alias, _ = _tiny_txt2img(client, sampler_name="ddim_cfgpp", cfg_scale=6, steps=3, eta=0.4)
    assert alias["images"] == answer["images"]
    v1 = client.post("/v1/images/generations", json={"prompt": TINY["prompt"], "size": "64x64", "seed": TINY["seed"],
                                                     "num_inference_steps": 3, "guidance_scale": 6, "eta": 0.4,
                                                     "sampler": "ddim_cfgpp", "prompt_syntax": "a1111"})
    assert v1.status_code == 200, v1.text
    image = Image.open(io.BytesIO(base64.b64decode(answer["images"][0])))
    expected = Image.open(io.BytesIO(base64.b64decode(v1.json()["data"][0]["b64_json"])))
    assert np.array_equal(pixels(image), pixels(expected))
    ddim, _ = _tiny_txt2img(client, sampler_name="DDIM", cfg_scale=6, steps=3, eta=0.4)
    assert ddim["images"] != answer["images"]
    listed = {s["name"]: s for s in client.get("/sdapi/v1/samplers").json()}
    assert listed["DDIM CFG++"] == {"name": "DDIM CFG++", "aliases": ["ddim_cfgpp"], "options": {}}
    pasted = client.post("/sdapi/v1/txt2img", json={"infotext": text})
    assert pasted.status_code == 200, pasted.text
    assert json.loads(pasted.json()["info"])["sampler_name"] == "DDIM CFG++"
    assert pasted.json()["images"] == answer["images"]


# -- in process on digits: requests AUTOMATIC1111 (or diffgraph's own listings) accept, and faults found in review ---
IN_PROCESS = {"prompt": "a handwritten digit three", "width": 64, "height": 64, "steps": 2, "seed": 1}


@pytest.fixture
def client(digits_client):
    return digits_client


def test_every_sampler_and_scheduler_name_the_listings_give_is_accepted(client):
    """GET /samplers lists k_dpmpp_3m_sde, k_dpm_2_a, k_lcm and /schedulers SGMUniform: each was a 400."""
    samplers = client.get("/sdapi/v1/samplers").json()
    assert {"DPM++ 2S a", "DPM++ 2M SDE Heun", "Restart", "DPM fast"} <= {s["name"] for s in samplers}
    assert {"Uniform", "Polyexponential", "KL Optimal", "Align Your Steps", "Turbo", "DDIM"} <= {
        s["label"] for s in client.get("/sdapi/v1/schedulers").json()}
    for name in {a for s in samplers for a in [s["name"], *s["aliases"]]}:
        r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "sampler_name": name, "steps": 1})
        assert r.status_code == 200, (name, r.text)
    for s in client.get("/sdapi/v1/schedulers").json():
        for name in [s["name"], s["label"], *(s["aliases"] or [])]:
            r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "sampler_name": "Euler", "scheduler": name})
            assert r.status_code == 200, (name, r.text)
    plain = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "sampler_name": "DPM++ 2M"}).json()
    blank = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "sampler_name": "DPM++ 2M", "scheduler": ""})
    assert blank.status_code == 200, blank.text  # AUTOMATIC1111 reads "" as Automatic (Karras for DPM++ 2M)
    assert blank.json()["images"] == plain["images"]


def test_a_controlnet_module_that_is_not_a_string_is_a_400(client):
    unit = {"model": "outline", "module": ["canny"], "input_image": b64png(Image.new("RGB", (64, 64)))}
    r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "alwayson_scripts": {"controlnet": {"args": [unit]}}})
    assert r.status_code == 400, r.text  # was 500 (TypeError: unhashable type: 'list')
    assert r.json()["error"]["param"] == "alwayson_scripts.controlnet.args[0].module"


def test_a_palette_mask_is_read_by_its_colours_in_resize_and_fill():
    mask = Image.new("P", (32, 64), 0)
    mask.putpalette([255, 255, 255, 0, 0, 0] + [0] * 762)  # index 0 is white: repaint everywhere
    assert np.asarray(read_mask(mask, False)).min() == 255
    filled = read_mask(resize(mask, 2, 64, 64), False)  # was the indices as gray: 0, repaint nowhere
    assert np.asarray(filled).min() == 255


def test_sd_model_checkpoint_takes_the_model_name_sd_models_lists(tmp_path):
    from diffgraph.server.process import ServerProcess
    shutil.copytree(shipped_preset_folder("digits"), tmp_path / "sub" / "other")
    server = ServerProcess("--model-dir", str(tmp_path), model="digits")
    try:
        server.wait_ready()
        listed = httpx.get(f"{server.url}/sdapi/v1/sd-models", timeout=300).json()
        name = next(m["model_name"] for m in listed if m["title"] == "sub/other")
        assert name == "sub_other"  # AUTOMATIC1111's model_name; it takes it back as sd_model_checkpoint
        r = httpx.post(f"{server.url}/sdapi/v1/options", json={"sd_model_checkpoint": name}, timeout=300)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/sdapi/v1/options", timeout=300).json()["sd_model_checkpoint"] == "sub/other"
    finally:
        server.stop(timeout=30)


def test_unknown_keys_are_ignored_and_named_in_a_header_and_values_are_coerced(client):
    """AUTOMATIC1111's models ignore keys they do not know and coerce values (its own test bodies send
    `seed_enable_extras`, `sampler_noise_scheduler_override`, `inpainting_mask_invert: false`)."""
    typed = client.post("/sdapi/v1/txt2img", json=IN_PROCESS)
    loose = client.post("/sdapi/v1/txt2img", json={
        **IN_PROCESS, "steps": str(IN_PROCESS["steps"]), "width": 64.0, "height": "64", "cfg_scale": 7, "seed": "1",
        "seed_enable_extras": True, "sampler_noise_scheduler_override": None, "negative_prompt_2": "x"})
    assert typed.status_code == loose.status_code == 200, loose.text
    assert loose.json()["images"] == typed.json()["images"]
    assert loose.headers["x-diffgraph-ignored-fields"] == \
        "seed_enable_extras, sampler_noise_scheduler_override, negative_prompt_2"
    assert "x-diffgraph-ignored-fields" not in typed.headers
    assert "seed_enable_extras" not in loose.json()["parameters"]  # not echoed as if it were read
    init = {"init_images": [b64png(Image.new("RGB", (64, 64), (90, 120, 200)))], "denoising_strength": 0.5}
    r = client.post("/sdapi/v1/img2img", json={**IN_PROCESS, **init, "inpainting_mask_invert": False,
                                                "include_init_images": "false"})
    assert r.status_code == 200, r.text
    many = {f"unknown_{i:02d}_" + "n" * 80: i for i in range(25)} | {"a b/ü": 1}
    r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, **many})
    names = r.headers["x-diffgraph-ignored-fields"].split(", ")
    assert r.status_code == 200 and len(names) == 21 and names[-1] == "(+6 more)", names
    assert all(len(n) == 64 for n in names[:20]) and names[0] == "unknown_00_" + "n" * 53
    for bad, needle in (({"steps": "twenty"}, "integer"), ({"width": 64.5}, "integer"), ({"tiling": "maybe"}, "true or false")):
        r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
        assert needle in r.json()["error"]["message"].lower(), r.text


def test_euler_a_with_eta_0_is_euler(client):
    """AUTOMATIC1111 runs its ancestral samplers with the request's eta; its own test body sends eta 0 with Euler a."""
    euler = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "steps": 4, "sampler_name": "Euler"})
    silent = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "steps": 4, "sampler_name": "Euler a", "eta": 0})
    usual = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, "steps": 4, "sampler_name": "Euler a"})
    assert euler.status_code == silent.status_code == usual.status_code == 200, silent.text
    pixels = [np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))), dtype=np.int16)
              for r in (euler, silent, usual)]
    assert np.abs(pixels[0] - pixels[1]).max() <= 1
    assert np.abs(pixels[0] - pixels[2]).max() > 10


class HeldHandle:
    """An image in the engine that runs until it is aborted (or the test lets it finish): its end is an event of
    the test, never a step count racing the interrupt."""

    def __init__(self, request, finish: threading.Event):
        self.request, self.request_id, self.finish = request, request.request_id, finish
        self.aborted = threading.Event()
        self.dropped_previews = 0

    def abort(self) -> bool:
        self.aborted.set()
        return True

    async def events(self):
        while not (self.aborted.is_set() or self.finish.is_set()):
            await asyncio.sleep(0.01)
        if self.aborted.is_set():
            raise RequestAborted(self.request_id)
        yield GenerationResult(self.request_id, None, self.request.seed, {}, self.request, [b"png"])


def test_an_interrupt_while_a_requests_images_are_submitted_stops_all_of_them(client, monkeypatch):
    """The request became the key's job only once every image was queued: an /interrupt after its first image was in
    the engine (the job had begun, AUTOMATIC1111's state.begin) but before the last was accepted found no job, and
    every image ran to the end."""
    second_entered, accept_second, finish = threading.Event(), threading.Event(), threading.Event()
    handles: list[HeldHandle] = []

    async def submit(state, request, progress, client=None, deadline=None, http=None):
        if handles:  # the second image: the engine answers when the test says
            second_entered.set()
            await asyncio.to_thread(accept_second.wait, BOUND_S)
        handles.append(HeldHandle(request, finish))
        return handles[-1]

    monkeypatch.setattr(a1111, "submit", submit)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=client.post("/sdapi/v1/txt2img",
                                                                      json={**IN_PROCESS, "batch_size": 2})))
    thread.start()
    try:
        assert second_entered.wait(BOUND_S), "the second image is being submitted"
        assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 1  # the job has begun
        assert client.post("/sdapi/v1/interrupt").status_code == 200
        accept_second.set()
        thread.join(BOUND_S)
    finally:
        accept_second.set()
        finish.set()  # before the fix nothing aborted them: they end here, not at the request timeout
        thread.join(BOUND_S)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert [h.aborted.is_set() for h in handles] == [True, True]
    assert r.json()["images"] == [] and "2 of 2 images were stopped" in r.json()["warnings"][0]
    assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0


LIMIT = 4096  # the default --max-prompt-bytes of the module's server


def test_the_longest_hostile_infotext_is_read_off_the_event_loop_while_health_answers(client, monkeypatch):
    """An infotext whose settings line ends in a long run with no ':' (AUTOMATIC1111's re_param rescanned it from
    every start: 96,000 characters froze every route, /health included, for minutes), at the infotext limit: read
    on a worker thread while /health answers, and its settings honoured."""
    held = HeldParser(a1111_protocol.parse_infotext)
    monkeypatch.setattr(a1111_protocol, "parse_infotext", held)
    head = "a handwritten digit three\nSteps: 2, Sampler: Euler, Seed: 5, Size: 64x64, Note"
    text = head + " x" * ((a1111_protocol.infotext_limit(LIMIT) - len(head)) // 2)
    r, health = post_while_probing(client, held, "/sdapi/v1/txt2img", {"infotext": text})
    assert (health, held.first) == (200, (False, True))
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert (info["prompt"], info["seed"], info["steps"], info["width"], info["sampler_name"]) == \
        ("a handwritten digit three", 5, 2, 64, "Euler")


def test_an_infotext_over_its_limit_is_refused_before_it_is_read(client, monkeypatch):
    held = HeldParser(a1111_protocol.parse_infotext)
    monkeypatch.setattr(a1111_protocol, "parse_infotext", held)
    r = client.post("/sdapi/v1/txt2img", json={"infotext": "a" * 96_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "infotext"
    assert f"the limit is {a1111_protocol.infotext_limit(LIMIT)}" in r.json()["error"]["message"]
    assert held.calls == 0


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_prompt_over_the_limit_is_refused_before_it_is_parsed(client, monkeypatch, field):
    """20,000 characters of '<a:' (quadratic in the tag pattern) were parsed, on the event loop, before the limit
    refused them."""
    held = HeldParser(syntax.schedule_a1111)
    monkeypatch.setattr(syntax, "schedule_a1111", held)
    r = client.post("/sdapi/v1/txt2img", json={**IN_PROCESS, field: "<a:" * 6666})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert f"has 19998 bytes (UTF-8); the limit is {LIMIT} (--max-prompt-bytes)" in r.json()["error"]["message"]
    assert held.calls == 0


@pytest.mark.parametrize("prompt,needle", [
    ("x <lora" + " " * (LIMIT - 7), "does not close"),
    ("<lora:a:" + "1" * (LIMIT - 10) + "x>", "is not a number"),
], ids=["spaces after <lora", "long scale"])
def test_the_worst_prompts_within_the_limit_are_parsed_off_the_event_loop(client, monkeypatch, prompt, needle):
    held = HeldParser(syntax.schedule_a1111)
    monkeypatch.setattr(syntax, "schedule_a1111", held)
    r, health = post_while_probing(client, held, "/sdapi/v1/txt2img", {**IN_PROCESS, "prompt": prompt})
    assert (health, held.first) == (200, (False, True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and needle in r.json()["error"]["message"]
