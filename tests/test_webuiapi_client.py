"""webuiapi 0.9.17's public methods, unchanged, against the server (issue 67): each method called as its users call
it, with the answer's values checked (sizes, seeds, fields), and the methods whose routes are out of scope answered
as AUTOMATIC1111 1.10 answers without them (404) or with a one-line refusal naming what is not served.
tools/survey_webuiapi.py prints the same list as a table (BENCHMARKS.md session 42).

One server for the clients' tests (conftest's `clients_url`: random:tiny on the CPU), 64x64 images in 2 steps.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from PIL import Image

webuiapi = pytest.importorskip("webuiapi")

SMALL = {"width": 64, "height": 64, "steps": 2, "seed": 11}


@pytest.fixture(scope="module")
def api(clients_url):
    host, port = clients_url.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=2)


def picture(size: int = 64) -> Image.Image:
    """Colour ramps with a bright square: edges for canny."""
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1)
    rgb[16:48, 16:48] = 250
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def test_txt2img_img2img_and_custom_post_answer_the_asked_images(api):
    out = api.txt2img(prompt="a cat", batch_size=2, **SMALL)
    assert [im.size for im in out.images] == [(64, 64)] * 2
    assert out.info["seed"] == 11 and out.info["all_seeds"] == [11, 12] and len(out.info["infotexts"]) == 2
    again = api.custom_post("sdapi/v1/txt2img", {"prompt": "a cat", "batch_size": 2, "sampler_name": "Euler a",
                                                 "eta": 1.0, **SMALL})
    assert np.array_equal(np.asarray(again.images[1]), np.asarray(out.images[1]))  # the same request, the same image
    edited = api.img2img(images=[picture()], mask_image=picture().convert("L"), prompt="a cat",
                         denoising_strength=0.5, **SMALL)
    assert [im.size for im in edited.images] == [(64, 64)] and edited.info["seed"] == 11


def test_txt2img_with_the_hires_fix_as_webuiapi_sends_it(api):
    """webuiapi's hires arguments (its HiResUpscaler enum, denoising_strength 0.7, every hr_* field): the second
    pass's images at hr_scale x the size, its entries in the infotext."""
    out = api.txt2img(prompt="a cat", enable_hr=True, hr_scale=1.5, hr_upscaler=webuiapi.HiResUpscaler.Lanczos,
                      hr_second_pass_steps=2, **SMALL)
    assert [im.size for im in out.images] == [(96, 96)]
    assert out.info["extra_generation_params"] == {"Denoising strength": 0.7, "Hires upscale": 1.5, "Hires steps": 2,
                                                   "Hires upscaler": "Lanczos"}
    with pytest.raises(RuntimeError, match="hr_upscaler"):  # a model upscaler: not served here
        api.txt2img(prompt="a cat", enable_hr=True, hr_upscaler=webuiapi.HiResUpscaler.ESRGAN_4x, **SMALL)


def test_use_async_answers_as_the_plain_call(api):
    async def call():
        return await api.txt2img(prompt="a cat", use_async=True, **SMALL)

    out = asyncio.run(call())
    assert [im.size for im in out.images] == [(64, 64)] and out.info["seed"] == 11


def test_extras_upscale_and_png_info_reads_the_parameters_back(api):
    assert api.extra_single_image(picture(), upscaler_1="Lanczos", upscaling_resize=2).image.size == (128, 128)
    batch = api.extra_batch_images([picture(), picture(32)], upscaler_1="Nearest", upscaling_resize=2)
    assert [im.size for im in batch.images] == [(128, 128), (64, 64)]
    made = api.txt2img(prompt="a red cat", **SMALL).image
    info = api.png_info(made).info
    assert info.startswith("a red cat\n") and "Steps: 2" in info and "Seed: 11" in info and "Size: 64x64" in info


def test_the_listings_have_the_fields_their_users_read(api):
    keyed = {api.get_samplers: "name", api.get_schedulers: "label", api.get_sd_vae: "model_name",
             api.get_upscalers: "name", api.get_latent_upscale_modes: "name", api.get_sd_models: "title",
             api.get_loras: "name", api.get_prompt_styles: "name"}
    for method, key in keyed.items():
        rows = method()
        assert isinstance(rows, list) and all(key in row for row in rows), (method.__name__, rows)
    assert api.get_hypernetworks() == [] and api.get_face_restorers() == [] and isinstance(
        api.get_realesrgan_models(), list)
    assert "Euler a" in api.util_get_sampler_names() and "karras" in api.util_get_scheduler_names()
    assert api.util_get_model_names() == ["random:tiny"]
    assert set(api.get_scripts()) == {"txt2img", "img2img"} and set(api.get_embeddings()) == {"loaded", "skipped"}
    assert {"ram", "cuda"} <= set(api.get_memory()) and isinstance(api.get_cmd_flags(), dict)
    assert api.refresh_checkpoints() is None
    api.check_extensions()
    assert api.has_controlnet is False  # its "controlnet m2m" script is not served: no empty ControlNet args sent


def test_options_progress_interrupt_and_skip(api):
    assert api.util_get_current_model() == "random:tiny"
    assert isinstance(api.set_options({"send_seed": True, "samples_format": "png"}), (dict, type(None)))
    assert api.get_options()["send_seed"] is True
    api.util_set_model("random:tiny")  # the closest name: the served model, set through the options
    progress = api.get_progress()
    assert progress["state"]["job_count"] == 0 and progress["progress"] == 0
    api.util_wait_for_ready(check_interval=0.1)  # idle: returns at once
    assert isinstance(api.interrupt(), (dict, type(None))) and isinstance(api.skip(), (dict, type(None)))


def test_controlnet_detect_is_opencv_canny_at_the_processor_resolution(api):
    import cv2

    assert api.controlnet_version() >= 1 and "canny" in api.controlnet_module_list()
    assert api.controlnet_model_list() == []  # random:tiny has no ControlNet
    out = api.controlnet_detect([picture()], module="canny", processor_res=64, threshold_a=64, threshold_b=64)
    assert out.info == "Success" and len(out.images) == 1
    expected = cv2.Canny(np.asarray(picture()), 64, 64)
    assert np.array_equal(np.asarray(out.images[0].convert("L")), expected)
    assert api.controlnet_detect([picture()], module="canny", processor_res=32).images[0].size == (32, 32)
    with pytest.raises(RuntimeError) as info:  # webuiapi raises with the answer's status and text
        api.controlnet_detect([picture()], module="openpose")
    assert info.value.args[0] == 422 and "controlnet_module" in info.value.args[1]


def test_what_is_not_served_is_refused_in_one_line_or_answered_as_automatic1111_without_it(api):
    with pytest.raises(RuntimeError) as info:
        api.interrogate(picture())
    assert info.value.args[0] == 404 and "no captioning model" in info.value.args[1]
    for route in ("sdapi/v1/artists", "sdapi/v1/artist-categories", "promptgen/list_models"):
        assert api.session.get(api.get_endpoint(route, False)).status_code == 404  # removed in 1.10 / no extension
    unit = webuiapi.ControlNetUnit(image=picture(), module="canny", model="None")
    with pytest.raises(RuntimeError) as info:
        api.txt2img(prompt="a cat", controlnet_units=[unit], alwayson_scripts={}, **SMALL)
    assert info.value.args[0] == 400 and "model" in info.value.args[1]


def test_other_extensions_helpers_are_refused_naming_their_script_or_get_the_404_of_their_absent_routes(api):
    for kind, value, script in (("adetailer", [webuiapi.ADetailer(ad_model="face_yolov8n.pt")], "ADetailer"),
                                ("sag", webuiapi.Sag(), "Self Attention Guidance")):
        with pytest.raises(RuntimeError) as info:
            api.txt2img(prompt="a cat", alwayson_scripts={}, **{kind: value}, **SMALL)
        assert info.value.args[0] == 400 and f"alwayson_scripts.{script}" in info.value.args[1]
    for call in (lambda: webuiapi.RemBGInterface(api).rembg(input_image=picture()),
                 lambda: webuiapi.InstructPix2PixInterface(api).img2img(images=[picture()], prompt="x")):
        with pytest.raises(RuntimeError) as info:
            call()
        assert info.value.args[0] == 404
