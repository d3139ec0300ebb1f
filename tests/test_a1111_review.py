"""Review of the AUTOMATIC1111 routes: requests AUTOMATIC1111 (or diffgraph's own listings) accept that were refused
or crashed here. In-process on `digits` (CPU), except the model_name case, which needs --model-dir's routing."""

from __future__ import annotations

import base64
import io
import shutil

import httpx
import numpy as np
import pytest
from PIL import Image

from diffgraph.models.presets import shipped_preset_folder
from diffgraph.server.a1111_inpaint import read_mask, resize
from server_util import b64png, served

SMALL = {"prompt": "a handwritten digit three", "width": 64, "height": 64, "steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def client():
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    engine = Engine("digits", device="cpu")
    with served(engine, ServerConfig(model="digits", device="cpu")) as c:
        yield c


def test_every_sampler_and_scheduler_name_the_listings_give_is_accepted(client):
    """GET /samplers lists k_dpmpp_3m_sde, k_dpm_2_a, k_lcm and /schedulers SGMUniform: each was a 400."""
    samplers = client.get("/sdapi/v1/samplers").json()
    assert {"DPM++ 2S a", "DPM++ 2M SDE Heun", "Restart", "DPM fast"} <= {s["name"] for s in samplers}
    assert {"Uniform", "Polyexponential", "KL Optimal", "Align Your Steps", "Turbo", "DDIM"} <= {
        s["label"] for s in client.get("/sdapi/v1/schedulers").json()}
    for name in {a for s in samplers for a in [s["name"], *s["aliases"]]}:
        r = client.post("/sdapi/v1/txt2img", json={**SMALL, "sampler_name": name, "steps": 1})
        assert r.status_code == 200, (name, r.text)
    for s in client.get("/sdapi/v1/schedulers").json():
        for name in [s["name"], s["label"], *(s["aliases"] or [])]:
            r = client.post("/sdapi/v1/txt2img", json={**SMALL, "sampler_name": "Euler", "scheduler": name})
            assert r.status_code == 200, (name, r.text)
    plain = client.post("/sdapi/v1/txt2img", json={**SMALL, "sampler_name": "DPM++ 2M"}).json()
    blank = client.post("/sdapi/v1/txt2img", json={**SMALL, "sampler_name": "DPM++ 2M", "scheduler": ""})
    assert blank.status_code == 200, blank.text  # AUTOMATIC1111 reads "" as Automatic (Karras for DPM++ 2M)
    assert blank.json()["images"] == plain["images"]


def test_a_controlnet_module_that_is_not_a_string_is_a_400(client):
    unit = {"model": "outline", "module": ["canny"], "input_image": b64png(Image.new("RGB", (64, 64)))}
    r = client.post("/sdapi/v1/txt2img", json={**SMALL, "alwayson_scripts": {"controlnet": {"args": [unit]}}})
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
    typed = client.post("/sdapi/v1/txt2img", json=SMALL)
    loose = client.post("/sdapi/v1/txt2img", json={
        **SMALL, "steps": str(SMALL["steps"]), "width": 64.0, "height": "64", "cfg_scale": 7, "seed": "1",
        "seed_enable_extras": True, "sampler_noise_scheduler_override": None, "negative_prompt_2": "x"})
    assert typed.status_code == loose.status_code == 200, loose.text
    assert loose.json()["images"] == typed.json()["images"]
    assert loose.headers["x-diffgraph-ignored-fields"] == \
        "seed_enable_extras, sampler_noise_scheduler_override, negative_prompt_2"
    assert "x-diffgraph-ignored-fields" not in typed.headers
    assert "seed_enable_extras" not in loose.json()["parameters"]  # not echoed as if it were read
    init = {"init_images": [b64png(Image.new("RGB", (64, 64), (90, 120, 200)))], "denoising_strength": 0.5}
    r = client.post("/sdapi/v1/img2img", json={**SMALL, **init, "inpainting_mask_invert": False,
                                                "include_init_images": "false"})
    assert r.status_code == 200, r.text
    many = {f"unknown_{i:02d}_" + "n" * 80: i for i in range(25)} | {"a b/ü": 1}
    r = client.post("/sdapi/v1/txt2img", json={**SMALL, **many})
    names = r.headers["x-diffgraph-ignored-fields"].split(", ")
    assert r.status_code == 200 and len(names) == 21 and names[-1] == "(+6 more)", names
    assert all(len(n) == 64 for n in names[:20]) and names[0] == "unknown_00_" + "n" * 53
    for bad, needle in (({"steps": "twenty"}, "integer"), ({"width": 64.5}, "integer"), ({"tiling": "maybe"}, "true or false")):
        r = client.post("/sdapi/v1/txt2img", json={**SMALL, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
        assert needle in r.json()["error"]["message"].lower(), r.text


def test_euler_a_with_eta_0_is_euler(client):
    """AUTOMATIC1111 runs its ancestral samplers with the request's eta; its own test body sends eta 0 with Euler a."""
    euler = client.post("/sdapi/v1/txt2img", json={**SMALL, "steps": 4, "sampler_name": "Euler"})
    silent = client.post("/sdapi/v1/txt2img", json={**SMALL, "steps": 4, "sampler_name": "Euler a", "eta": 0})
    usual = client.post("/sdapi/v1/txt2img", json={**SMALL, "steps": 4, "sampler_name": "Euler a"})
    assert euler.status_code == silent.status_code == usual.status_code == 200, silent.text
    pixels = [np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))), dtype=np.int16)
              for r in (euler, silent, usual)]
    assert np.abs(pixels[0] - pixels[1]).max() <= 1
    assert np.abs(pixels[0] - pixels[2]).max() > 10
