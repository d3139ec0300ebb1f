"""AUTOMATIC1111's hires fix on /sdapi/v1/txt2img (`enable_hr`, server/a1111_hires.py over hires.py): each case's
images equal their two passes built by hand through the Python API, hires rows beside other work equal themselves
alone, the infotext entries AUTOMATIC1111 writes (and reads back from `infotext`), a model upscaler (a tiny ESRGAN
in --upscaler-dir, where spandrel is installed) as hr_upscaler, and the 400s by field. One in-process server on
`random:tiny` (CPU) whose engine also builds the references; 64x64 first passes, 2-3 steps."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from diffgraph.request import EditInput, ModelInfo
from server_util import b64png, served

BODY = {"prompt": "a red fox", "seed": 21, "steps": 3, "width": 64, "height": 64, "sampler_name": "Euler",
        "cfg_scale": 7, "enable_hr": True, "hr_scale": 1.5, "denoising_strength": 0.5, "hr_second_pass_steps": 2}


SPANDREL = importlib.util.find_spec("spandrel") is not None  # diffgraph[upscale]; CI installs it


@pytest.fixture(scope="module")
def upscaler_dir(tmp_path_factory):
    """A folder with a tiny 2x ESRGAN (upscaler_util.py), where spandrel is installed."""
    if not SPANDREL:
        return None
    from upscaler_util import tiny_esrgan
    root = tmp_path_factory.mktemp("upscalers")
    tiny_esrgan(root / "tiny_x2.safetensors")
    return str(root)


@pytest.fixture(scope="module")
def served_engine(upscaler_dir):
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as engine:
        with served(engine, ServerConfig(model="random:tiny", device="cpu", upscaler_dir=upscaler_dir)) as client:
            yield client, engine


def _pixels(text: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")).astype(int)


def _post(client, **changes):
    r = client.post("/sdapi/v1/txt2img", json={**BODY, **changes})
    assert r.status_code == 200, r.text
    return r.json()


def _request(engine, **changes):
    """The first pass as the route builds it, through the Python API ("Euler": euler, its own schedule)."""
    params = dict(width=64, height=64, num_inference_steps=3, seed=21, sampler="euler", guidance_scale=7.0,
                  prompt_syntax="a1111")
    return engine.make_request("a red fox", **{**params, **changes})


@pytest.mark.parametrize("upscaler", ["Latent (bicubic antialiased)", "Lanczos", "None"])
def test_hires_answer_equals_its_passes_by_hand(served_engine, upscaler):
    """First pass alone; its latents (interpolate) or image (PIL) resized to 96x96; then image-to-image alone: 2
    steps of a 4-step schedule (AUTOMATIC1111's hires steps at denoising_strength 0.5)."""
    client, engine = served_engine
    answer = _post(client, hr_upscaler=upscaler)
    first = engine.run(_request(engine, return_latents=True))
    if upscaler.startswith("Latent"):
        start = EditInput(None, strength=0.5, latents=torch.nn.functional.interpolate(
            torch.from_numpy(first.latents), size=(12, 12), mode="bicubic", antialias=True)[0].numpy())
    else:  # Lanczos at 1.5x and "None" are one Lanczos resize to the size
        start = EditInput(np.asarray(first.images[0].resize((96, 96), Image.LANCZOS)), strength=0.5)
    second = engine.run(_request(engine, width=96, height=96, num_inference_steps=4, image=start))
    (image,) = answer["images"]
    reference = (second.arrays[0] * 255).round().astype(int)
    assert _pixels(image).shape == (96, 96, 3) and np.abs(_pixels(image) - reference).max() <= 1


@pytest.mark.skipif(not SPANDREL, reason="spandrel is not installed (diffgraph[upscale])")
def test_hires_with_a_model_upscaler_equals_its_passes_by_hand(served_engine, upscaler_dir):
    """hr_upscaler a model of --upscaler-dir: the first pass's image through the 2x model (spandrel, directly), then
    Lanczos from 128 to the 96x96 second pass (AUTOMATIC1111's resize_image with an upscaler), image-to-image."""
    from upscaler_util import spandrel_upscale
    client, engine = served_engine
    answer = _post(client, hr_upscaler="tiny_x2")
    first = engine.run(_request(engine))
    grown = Image.fromarray(spandrel_upscale(f"{upscaler_dir}/tiny_x2.safetensors", first.images[0]))
    start = EditInput(np.asarray(grown.resize((96, 96), Image.LANCZOS)), strength=0.5)
    second = engine.run(_request(engine, width=96, height=96, num_inference_steps=4, image=start))
    (image,) = answer["images"]
    reference = (second.arrays[0] * 255).round().astype(int)
    assert grown.size == (128, 128) and np.abs(_pixels(image) - reference).max() <= 1
    assert json.loads(answer["info"])["extra_generation_params"]["Hires upscaler"] == "tiny_x2"


def test_hr_prompts_sampler_and_scheduler_are_the_second_passs(served_engine):
    client, engine = served_engine
    answer = _post(client, hr_upscaler="Lanczos", hr_prompt="a blue fox", hr_negative_prompt="blurry",
                   hr_sampler_name="DPM++ 2M", hr_scheduler="Karras")
    first = engine.run(_request(engine))
    start = EditInput(np.asarray(first.images[0].resize((96, 96), Image.LANCZOS)), strength=0.5)
    second = engine.run(engine.make_request("a blue fox", negative_prompt="blurry", width=96, height=96,
                                            num_inference_steps=4, seed=21, sampler="dpmpp_2m", schedule="karras",
                                            guidance_scale=7.0, prompt_syntax="a1111", image=start))
    reference = (second.arrays[0] * 255).round().astype(int)
    assert np.abs(_pixels(answer["images"][0]) - reference).max() <= 1
    entries = json.loads(answer["info"])["extra_generation_params"]
    assert {k: entries[k] for k in ("Hires sampler", "Hires schedule type", "Hires prompt", "Hires negative prompt")} \
        == {"Hires sampler": "DPM++ 2M", "Hires schedule type": "Karras", "Hires prompt": "a blue fox",
            "Hires negative prompt": "blurry"}


def test_hires_rows_beside_other_work_equal_themselves_alone(served_engine):
    """Two hires bodies (a latent mode, an image upscaler), a txt2img of another size and an img2img, posted
    together: each answer as alone."""
    client, _ = served_engine
    init = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    calls = [("/sdapi/v1/txt2img", {**BODY, "hr_upscaler": "Latent"}),
             ("/sdapi/v1/txt2img", {**BODY, "hr_upscaler": "Nearest", "seed": 22, "batch_size": 2}),
             ("/sdapi/v1/txt2img", {"prompt": "a lighthouse", "seed": 5, "steps": 3, "width": 64, "height": 96}),
             ("/sdapi/v1/img2img", {"prompt": "a boat", "seed": 6, "steps": 4, "width": 64, "height": 64,
                                    "init_images": [b64png(init)], "denoising_strength": 0.5})]

    def post(call):
        r = client.post(call[0], json=call[1])
        assert r.status_code == 200, r.text
        return [_pixels(i) for i in r.json()["images"]]
    alone = [post(c) for c in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(post, calls))
    assert [a[0].shape for a in alone] == [(96, 96, 3), (96, 96, 3), (96, 64, 3), (64, 64, 3)]
    for got, ref in zip(together, alone):
        assert len(got) == len(ref) and all(np.abs(g - r).max() <= 1 for g, r in zip(got, ref))


def test_infotext_carries_the_hires_entries_and_reads_them_back(served_engine):
    client, _ = served_engine
    answer = _post(client, hr_upscaler="Latent (nearest)")
    info = json.loads(answer["info"])
    entries = {"Denoising strength": 0.5, "Hires upscale": 1.5, "Hires steps": 2, "Hires upscaler": "Latent (nearest)"}
    assert info["extra_generation_params"] == entries and (info["width"], info["height"]) == (64, 64)
    text = info["infotexts"][0]
    assert text.endswith("Size: 64x64, Model: \"random:tiny\", Denoising strength: 0.5, Hires upscale: 1.5, Hires "
                         "steps: 2, Hires upscaler: Latent (nearest)"), text
    (image,) = answer["images"]
    assert Image.open(io.BytesIO(base64.b64decode(image))).info["parameters"] == text
    parameters = client.post("/sdapi/v1/png-info", json={"image": image}).json()["parameters"]
    assert {k: parameters[k] for k in entries} == {k: str(v) for k, v in entries.items()}
    # the infotext as a body's `infotext`: the same hires fix, the same image
    again = client.post("/sdapi/v1/txt2img", json={"infotext": text})
    assert again.status_code == 200, again.text
    assert np.abs(_pixels(again.json()["images"][0]) - _pixels(image)).max() <= 1


def test_a_resize_is_written_as_hires_resize(served_engine):
    client, _ = served_engine
    answer = _post(client, hr_resize_x=128, hr_resize_y=96, hr_second_pass_steps=0, hr_upscaler=None)
    info = json.loads(answer["info"])
    assert _pixels(answer["images"][0]).shape == (96, 128, 3)  # covered at 128x128, its centre cut
    assert info["extra_generation_params"] == {"Denoising strength": 0.5, "Hires resize": "128x96"}


@pytest.mark.parametrize("changes, field", [
    ({"hr_scale": 1}, "hr_scale"), ({"hr_scale": 0.5}, "hr_scale"), ({"hr_scale": 64}, "hr_scale"),
    ({"hr_resize_x": 4096}, "hr_resize_x"), ({"hr_resize_y": -8}, "hr_resize_y"),
    ({"hr_upscaler": "R-ESRGAN 4x+"}, "hr_upscaler"), ({"hr_sampler_name": "DPM adaptive"}, "hr_sampler_name"),
    ({"hr_scheduler": "Linear Quadratic"}, "hr_scheduler"), ({"denoising_strength": 1.5}, "denoising_strength"),
    ({"denoising_strength": 0.001}, "denoising_strength"), ({"hr_second_pass_steps": -1}, "hr_second_pass_steps"),
    ({"hr_checkpoint_name": "other.safetensors"}, "hr_checkpoint_name"), ({"firstphase_width": 32}, "firstphase_width"),
])
def test_hires_fields_that_cannot_run_are_one_line_400s(served_engine, changes, field):
    client, _ = served_engine
    r = client.post("/sdapi/v1/txt2img", json={**BODY, **changes})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "\n" not in r.json()["error"]["message"]


def test_hires_on_a_model_without_a_start_image_names_enable_hr():
    """FLUX.2 klein reads init images as references: its second pass has no start; a 400 naming enable_hr."""
    from diffgraph.api.protocol import APIError
    from diffgraph.server.a1111_hires import hires_plan
    from diffgraph.server.a1111_protocol import Txt2ImgBody, plan_body
    body = Txt2ImgBody.model_validate({**BODY})
    info = ModelInfo(name="flux2-klein", family="flux2", native_size=1024, default_guidance=1.0, max_rows=4,
                     mode="eager", device="cpu", edit_images="references", size_multiple=16)
    with pytest.raises(APIError) as e:
        hires_plan(body, plan_body(body, None, None, None), info, None)
    assert e.value.param == "enable_hr" and "references" in e.value.message


def test_denoising_strength_0_is_read_as_the_hires_default_with_a_warning(served_engine):
    client, _ = served_engine
    answer = _post(client, denoising_strength=0)
    assert json.loads(answer["info"])["extra_generation_params"]["Denoising strength"] == 0.7
    assert any("denoising_strength 0" in w for w in answer["warnings"])


def test_newer_hires_fields_are_ignored_and_named(served_engine):
    """Forge's and newer AUTOMATIC1111's hr_cfg / hr_distilled_cfg: ignored, named in the ignored-fields header."""
    client, _ = served_engine
    r = client.post("/sdapi/v1/txt2img", json={**BODY, "hr_cfg": 5, "hr_distilled_cfg": 3.5})
    assert r.status_code == 200, r.text
    assert r.headers["X-Diffgraph-Ignored-Fields"] == "hr_cfg, hr_distilled_cfg"
