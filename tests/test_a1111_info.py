"""AUTOMATIC1111's information and housekeeping routes (server/a1111_info.py), GET / POST /sdapi/v1/options over
every option AUTOMATIC1111 has, and the styles of a --styles file applied and listed, in-process on `digits` (CPU),
with an API key, a --vae, a --controlnet-dir and --styles given as absolute paths (cmd-flags shows neither the key
nor the paths)."""

from __future__ import annotations

import base64
import io
import json
from importlib.resources import files

import numpy as np

import pytest
from PIL import Image

from diffgraph.server.a1111_info import LATENT_UPSCALE_MODES
from server_util import b64png, served

KEY = "sk-info-test-key-0123456789"
SMALL = {"prompt": "a handwritten digit three", "negative_prompt": "blurry", "width": 64, "height": 64, "steps": 3,
         "seed": 1234}
# AUTOMATIC1111's styles.csv: quoted fields, a `#` comment row, a style with {prompt} and one appended
STYLES_CSV = (
    'name,prompt,negative_prompt\n'
    'frame,"a drawing of {prompt}, centered",\n'
    'ink,ink lines,"smudges, lowres"\n'
    '# kept for later,old,text\n'
    'quoted,"one, two ""three""",{prompt} and noise\n'
    'double,{prompt} {prompt},\n'
)
A1111_DEFAULTS = json.loads(files("diffgraph.server").joinpath("a1111_options.json").read_text("utf-8"))["defaults"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    controlnets = tmp_path_factory.mktemp("controlnets")
    vae = tmp_path_factory.mktemp("vae") / "my-vae.safetensors"  # named, never loaded: the engine is built here
    vae.write_bytes(b"")
    styles = tmp_path_factory.mktemp("styles") / "styles.csv"
    styles.write_text(STYLES_CSV, encoding="utf-8-sig")  # AUTOMATIC1111 writes a BOM
    engine = Engine("digits", device="cpu")
    config = ServerConfig(model="digits", device="cpu", api_keys=(KEY,), vae=str(vae), controlnet_dir=str(controlnets),
                          max_image_pixels=256 * 256, styles=str(styles), max_prompt_bytes=512)
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
    for path in ("hypernetworks", "face-restorers", "realesrgan-models"):
        r = client.get(f"/sdapi/v1/{path}")
        assert r.status_code == 200 and r.json() == [], (path, r.text)
    assert client.get("/sdapi/v1/scripts").json() == {"txt2img": [], "img2img": ["sd upscale"]}
    (upscale,) = client.get("/sdapi/v1/script-info").json()
    assert upscale["name"] == "sd upscale" and upscale["is_img2img"] and not upscale["is_alwayson"]
    assert [a["label"] for a in upscale["args"]] == [None, "Tile overlap", "Upscaler", "Scale Factor"]
    assert upscale["args"][2]["choices"] == ["None", "Lanczos", "Nearest"]


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
    assert flags["api_auth"] is None and flags["port"] == 8000 and flags["styles_file"] == ["styles.csv"]
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


# -- styles (--styles) ----------------------------------------------------------------------------------------------
def _styled(client, route: str = "txt2img", **body) -> tuple[dict, dict]:
    r = client.post(f"/sdapi/v1/{route}", json={**SMALL, **body})
    assert r.status_code == 200, r.text
    return r.json(), json.loads(r.json()["info"])


def _pixels(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))).convert("RGB"))


def test_prompt_styles_lists_the_files_styles_as_a1111(client):
    """AUTOMATIC1111's PromptStyleItem list, in the file's order, without its `#` comment row."""
    assert client.get("/sdapi/v1/prompt-styles").json() == [
        {"name": "frame", "prompt": "a drawing of {prompt}, centered", "negative_prompt": ""},
        {"name": "ink", "prompt": "ink lines", "negative_prompt": "smudges, lowres"},
        {"name": "quoted", "prompt": 'one, two "three"', "negative_prompt": "{prompt} and noise"},
        {"name": "double", "prompt": "{prompt} {prompt}", "negative_prompt": ""}]


def test_styles_apply_in_order_to_both_prompts_before_anything_reads_them(client):
    """`frame` takes the prompt at {prompt}, then `ink` is appended after ", " (its negative too, after the body's);
    the image is the styled prompts' image, the infotext and `info` carry them, `parameters` echoes the body."""
    answer, info = _styled(client, styles=["frame", "ink"])
    prompt = "a drawing of a handwritten digit three, centered, ink lines"
    negative = "blurry, smudges, lowres"
    assert (info["prompt"], info["negative_prompt"], info["all_negative_prompts"]) == (prompt, negative, [negative])
    assert info["infotexts"][0].startswith(f"{prompt}\nNegative prompt: {negative}\nSteps: 3, ")
    assert info["styles"] == ["frame", "ink"] and "warnings" not in answer
    assert (answer["parameters"]["prompt"], answer["parameters"]["styles"]) == (SMALL["prompt"], ["frame", "ink"])
    plain, _ = _styled(client, prompt=prompt, negative_prompt=negative)
    assert np.array_equal(_pixels(answer), _pixels(plain))
    other_order = _styled(client, styles=["ink", "frame"])[1]  # the order is the body's
    assert other_order["prompt"] == "a drawing of a handwritten digit three, ink lines, centered"


def test_a_style_without_prompt_is_appended_and_with_prompt_substituted(client):
    info = _styled(client, styles=["quoted"], negative_prompt="")[1]  # an empty side adds no comma
    assert (info["prompt"], info["negative_prompt"]) == ('a handwritten digit three, one, two "three"', " and noise")
    info = _styled(client, route="img2img", styles=["quoted"], denoising_strength=0.5,
                   init_images=[b64png(Image.new("RGB", (64, 64), "white"))])[1]
    assert (info["prompt"], info["negative_prompt"]) == ('a handwritten digit three, one, two "three"',
                                                         "blurry and noise")


def test_an_unknown_style_is_skipped_with_a_warning(client):
    answer, info = _styled(client, styles=["nope", "ink", "nope"])
    assert info["prompt"] == "a handwritten digit three, ink lines"
    assert answer["warnings"] == ["styles ['nope'] were ignored: not in the styles file (GET /sdapi/v1/prompt-styles "
                                  "lists its styles)"]


def test_styles_that_grow_a_prompt_past_the_limit_get_a_400_naming_styles(client):
    r = client.post("/sdapi/v1/txt2img", json={**SMALL, "styles": ["double"] * 40})  # 2**40 prompts, never built
    assert r.status_code == 400 and r.json()["error"]["param"] == "styles", r.text
    assert "512 bytes" in r.json()["error"]["message"]


def test_a_malformed_styles_file_is_refused_at_start_in_one_line(tmp_path, capsys):
    from diffgraph.server.cli import main
    bad = tmp_path / "my-styles.csv"
    bad.write_text('name,prompt,negative_prompt\nink,ink lines,\nsplit,a, b, c\n')
    assert main(["--model", "digits", "--device", "cpu", "--styles", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("diffgraph: error: styles ") and str(bad) in err, err
    assert "line 3: the row has 4 fields, the header 3" in err, err
