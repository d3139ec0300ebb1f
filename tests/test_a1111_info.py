"""AUTOMATIC1111's information and housekeeping routes (server/a1111_info.py) and GET / POST /sdapi/v1/options over
every option AUTOMATIC1111 has, in-process on `digits` (CPU), with an API key, a --vae and a --controlnet-dir given
as absolute paths (cmd-flags shows neither the key nor the paths)."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
from PIL import Image

from diffgraph.server.a1111_info import LATENT_UPSCALE_MODES
from server_util import b64png, served

KEY = "sk-info-test-key-0123456789"
SMALL = {"prompt": "a handwritten digit three", "negative_prompt": "blurry", "width": 64, "height": 64, "steps": 3,
         "seed": 1234}
A1111_DEFAULTS = json.loads(files("diffgraph.server").joinpath("a1111_options.json").read_text("utf-8"))["defaults"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    controlnets = tmp_path_factory.mktemp("controlnets")
    vae = tmp_path_factory.mktemp("vae") / "my-vae.safetensors"  # named, never loaded: the engine is built here
    vae.write_bytes(b"")
    engine = Engine("digits", device="cpu")
    config = ServerConfig(model="digits", device="cpu", api_keys=(KEY,), vae=str(vae), controlnet_dir=str(controlnets),
                          max_image_pixels=256 * 256)
    with served(engine, config) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def test_png_info_reads_back_what_txt2img_wrote(client):
    made = client.post("/sdapi/v1/txt2img", json=SMALL)
    assert made.status_code == 200, made.text
    r = client.post("/sdapi/v1/png-info", json={"image": made.json()["images"][0]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["info"] == json.loads(made.json()["info"])["infotexts"][0]
    p = body["parameters"]
    assert (p["Prompt"], p["Negative prompt"]) == (SMALL["prompt"], SMALL["negative_prompt"])
    assert (p["Seed"], p["Steps"], p["Size"], p["Size-1"], p["Size-2"]) == ("1234", "3", "64x64", "64", "64")
    assert "parameters" not in body["items"] and "diffgraph" in body["items"]  # the other texts it carries


def test_png_info_of_a_bare_image_is_empty_and_of_a_huge_one_a_400(client):
    r = client.post("/sdapi/v1/png-info", json={"image": b64png(Image.new("RGB", (8, 8)))})
    assert r.status_code == 200 and r.json() == {"info": "", "items": {}, "parameters": {}}, r.text
    huge = client.post("/sdapi/v1/png-info", json={"image": b64png(Image.new("L", (512, 512)))})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "image_too_large", huge.text
    for body in ({"image": "not base64 at all!"}, {}, ["image"]):
        assert client.post("/sdapi/v1/png-info", json=body).status_code == 400


def test_lists_answer_in_a1111_shapes(client):
    assert client.get("/sdapi/v1/sd-vae").json() == [{"model_name": "my-vae", "filename": "my-vae.safetensors"}]
    assert client.get("/sdapi/v1/latent-upscale-modes").json() == [{"name": n} for n in LATENT_UPSCALE_MODES]
    assert client.get("/sdapi/v1/latent-upscale-modes").json()[0] == {"name": "Latent"}
    for path in ("prompt-styles", "hypernetworks", "face-restorers", "realesrgan-models", "script-info"):
        r = client.get(f"/sdapi/v1/{path}")
        assert r.status_code == 200 and r.json() == [], (path, r.text)
    assert client.get("/sdapi/v1/scripts").json() == {"txt2img": [], "img2img": []}


def test_refresh_reload_and_unload_answer_as_a1111(client):
    for path in ("refresh-checkpoints", "refresh-loras", "refresh-embeddings", "refresh-vae"):
        r = client.post(f"/sdapi/v1/{path}")
        assert r.status_code == 200 and r.json() is None, (path, r.text)
    for path in ("reload-checkpoint", "unload-checkpoint"):
        r = client.post(f"/sdapi/v1/{path}")
        assert r.status_code == 200 and r.json() == {}, (path, r.text)
    assert client.post("/sdapi/v1/txt2img", json=SMALL).status_code == 200  # still serving after the unload
    assert client.post("/sdapi/v1/refresh-loras", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_cmd_flags_hold_no_absolute_path_and_no_key(client):
    r = client.get("/sdapi/v1/cmd-flags")
    assert r.status_code == 200, r.text
    flags = r.json()
    assert flags["ckpt"] == "digits" and flags["vae_path"] == "my-vae.safetensors" and flags["api"] is True
    assert flags["controlnet_dir"] and not flags["controlnet_dir"].startswith("/")
    assert flags["api_auth"] is None and flags["port"] == 8000
    assert KEY not in r.text and '"/' not in r.text


def test_memory_has_a1111_ram_and_cuda_sections(client):
    r = client.get("/sdapi/v1/memory")
    assert r.status_code == 200, r.text
    ram, cuda = r.json()["ram"], r.json()["cuda"]
    assert set(ram) == {"free", "used", "total"} and ram["free"] + ram["used"] == ram["total"]
    assert 0 < ram["used"] < ram["total"]
    assert cuda == {"error": "unavailable"}  # a CPU engine, as AUTOMATIC1111 without CUDA


def test_options_hold_every_a1111_option_and_keep_the_unsupported_ones(client):
    options = client.get("/sdapi/v1/options").json()
    assert set(A1111_DEFAULTS) <= set(options)
    assert options["sd_model_checkpoint"] == "digits" and options["CLIP_stop_at_last_layers"] == 1
    assert options["eta_ancestral"] == 1.0 and options["samples_format"] == "png" and options["jpeg_quality"] == 80
    try:
        r = client.post("/sdapi/v1/options", json={**options, "samples_format": "jpg", "jpeg_quality": 95,
                                                   "not_an_option": 1, "CLIP_stop_at_last_layers": 2})
        assert r.status_code == 200 and r.json() is None, r.text
        assert r.headers["X-Diffgraph-Ignored-Fields"] == "samples_format, jpeg_quality, not_an_option"
        after = client.get("/sdapi/v1/options").json()
        assert after == {**options, "CLIP_stop_at_last_layers": 2}
        same = client.post("/sdapi/v1/options", json={"samples_format": "png"})
        assert same.status_code == 200 and "X-Diffgraph-Ignored-Fields" not in same.headers
    finally:
        client.post("/sdapi/v1/options", json={"CLIP_stop_at_last_layers": 1})


def test_override_settings_take_any_a1111_option_at_its_default_value(client):
    defaults = {"eta_ancestral": 1.0, "jpeg_quality": 80}
    ok = client.post("/sdapi/v1/txt2img", json={**SMALL, "override_settings": defaults})
    assert ok.status_code == 200, ok.text
    changed = client.post("/sdapi/v1/txt2img", json={**SMALL, "override_settings": {"jpeg_quality": 95}})
    assert changed.status_code == 400 and changed.json()["error"]["param"] == "override_settings.jpeg_quality"
