"""Calls every public method of webuiapi 0.9.17's `WebUIApi` (and the ControlNet helpers that hit the API) against a
running `diffgraph serve` and prints one markdown row per call: works / wrong answer / refused (4xx) / missing route
(404) / error. Usage (issue 67's measurement; BENCHMARKS.md session 42):

    diffgraph serve --model random:tiny --device cpu --port 7861 &
    python tools/survey_webuiapi.py http://127.0.0.1:7861
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

import numpy as np
import webuiapi
from PIL import Image

SMALL = {"width": 64, "height": 64, "steps": 2, "seed": 1}
# AUTOMATIC1111 1.10 answers these with a 404 too: routes it removed (artists), an extension's routes where the
# extension is absent (promptgen), the ControlNet extension's removed /controlnet/txt2img and /controlnet/img2img
AS_A1111_404 = {"get_artist_categories", "get_artists", "list_prompt_gen_models", "prompt_gen",
                "ControlNetInterface.txt2img", "ModelKeywordInterface.get_keywords", "InstructPix2PixInterface.img2img",
                "RemBGInterface.rembg", "SegmentAnythingInterface.heartbeat", "TaggerInterface.tagger_interrogators"}
# extensions' alwayson scripts: a 400 naming the script (AUTOMATIC1111 without the extension: a 422 naming it)
REFUSED_AS_A1111 = {"txt2img (adetailer)", "txt2img (animatediff)", "txt2img (roop)", "txt2img (reactor)",
                    "txt2img (sag)"}
AS_A1111 = "404, as AUTOMATIC1111 1.10 answers (route removed or extension absent)"
NOT_SERVED = {"interrogate"}  # needs captioning weights: a one-line 404 names it


def picture() -> Image.Image:
    y, x = np.mgrid[0:64, 0:64]
    return Image.fromarray(np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8), "RGB")


def sizes(result) -> list[tuple[int, int]]:
    return [im.size for im in result.images]


def calls(api: webuiapi.WebUIApi) -> list[tuple[str, Callable[[], Any], Callable[[Any], bool]]]:
    """(method, the call, the check its answer must pass)"""
    pic = picture()
    model = api.get_options()["sd_model_checkpoint"]
    served = api.controlnet_model_list()  # random:tiny serves none: its unit is refused, naming the model
    unit = webuiapi.ControlNetUnit(image=pic, module="canny", model=served[0] if served else "None", processor_res=64)
    listing = lambda key=None: (lambda r: isinstance(r, list) and (key is None or all(key in x for x in r)))
    return [
        ("txt2img", lambda: api.txt2img(prompt="a cat", **SMALL), lambda r: sizes(r) == [(64, 64)] and r.info["seed"] == 1),
        ("txt2img (batch_size 2, n_iter 1)", lambda: api.txt2img(prompt="a cat", batch_size=2, **SMALL),
         lambda r: sizes(r) == [(64, 64)] * 2),
        ("txt2img (enable_hr, Latent, hr_scale 2)", lambda: api.txt2img(prompt="a cat", enable_hr=True, hr_scale=2,
                                                                       denoising_strength=0.5, **SMALL),
         lambda r: sizes(r) == [(128, 128)]),
        ("txt2img (controlnet_units)", lambda: api.txt2img(prompt="a cat", controlnet_units=[unit],
                                                                alwayson_scripts={}, **SMALL),
         lambda r: len(r.images) >= 1 and r.images[0].size == (64, 64)),
        ("txt2img (use_async)", lambda: asyncio.run(_awaited(lambda: api.txt2img(prompt="a cat", use_async=True, **SMALL))),
         lambda r: sizes(r) == [(64, 64)]),
        ("img2img", lambda: api.img2img(images=[pic], prompt="a cat", **SMALL), lambda r: sizes(r) == [(64, 64)]),
        ("img2img (mask_image)", lambda: api.img2img(images=[pic], mask_image=pic.convert("L"), prompt="a cat",
                                                     **SMALL), lambda r: sizes(r) == [(64, 64)]),
        ("extra_single_image", lambda: api.extra_single_image(pic, upscaler_1="Lanczos", upscaling_resize=2),
         lambda r: sizes(r) == [(128, 128)]),
        ("extra_batch_images", lambda: api.extra_batch_images([pic, pic], upscaler_1="Nearest", upscaling_resize=2),
         lambda r: sizes(r) == [(128, 128)] * 2),
        ("png_info", lambda: api.png_info(api.txt2img(prompt="a cat", **SMALL).image),
         lambda r: isinstance(r.info, str) and "Seed: 1" in r.info),
        ("interrogate", lambda: api.interrogate(pic), lambda r: isinstance(r.info, str)),
        ("interrupt", lambda: api.interrupt(), lambda r: r is None or isinstance(r, dict)),
        ("skip", lambda: api.skip(), lambda r: r is None or isinstance(r, dict)),
        ("get_options", lambda: api.get_options(), lambda r: "sd_model_checkpoint" in r),
        ("set_options", lambda: api.set_options({"send_seed": True}), lambda r: r is None or isinstance(r, dict)),
        ("get_cmd_flags", lambda: api.get_cmd_flags(), lambda r: isinstance(r, dict) and "ckpt_dir" in r),
        ("get_progress", lambda: api.get_progress(), lambda r: "progress" in r and "state" in r),
        ("get_samplers", lambda: api.get_samplers(), listing("name")),
        ("get_schedulers", lambda: api.get_schedulers(), listing("name")),
        ("get_sd_vae", lambda: api.get_sd_vae(), listing("model_name")),
        ("get_upscalers", lambda: api.get_upscalers(), listing("name")),
        ("get_latent_upscale_modes", lambda: api.get_latent_upscale_modes(), listing("name")),
        ("get_loras", lambda: api.get_loras(), listing("name")),
        ("get_sd_models", lambda: api.get_sd_models(), listing("title")),
        ("get_hypernetworks", lambda: api.get_hypernetworks(), listing()),
        ("get_face_restorers", lambda: api.get_face_restorers(), listing()),
        ("get_realesrgan_models", lambda: api.get_realesrgan_models(), listing()),
        ("get_prompt_styles", lambda: api.get_prompt_styles(), listing()),
        ("get_artist_categories", lambda: api.get_artist_categories(), lambda r: False),
        ("get_artists", lambda: api.get_artists(), lambda r: False),
        ("refresh_checkpoints", lambda: api.refresh_checkpoints(), lambda r: r is None),
        ("get_scripts", lambda: api.get_scripts(), lambda r: set(r) == {"txt2img", "img2img"}),
        ("get_embeddings", lambda: api.get_embeddings(), lambda r: set(r) == {"loaded", "skipped"}),
        ("get_memory", lambda: api.get_memory(), lambda r: "ram" in r and "cuda" in r),
        ("get_endpoint", lambda: api.get_endpoint("samplers", False), lambda r: "/sdapi/" not in r and r.endswith("/samplers")),
        ("custom_get", lambda: api.custom_get("sdapi/v1/samplers"), listing("name")),
        ("custom_post", lambda: api.custom_post("sdapi/v1/txt2img", {"prompt": "x", **SMALL}),
         lambda r: sizes(r) == [(64, 64)]),
        ("check_extensions", lambda: (api.check_extensions(), api.has_controlnet)[1], lambda r: r is False),
        ("controlnet_version", lambda: api.controlnet_version(), lambda r: isinstance(r, int)),
        ("controlnet_model_list", lambda: api.controlnet_model_list(), lambda r: isinstance(r, list)),
        ("controlnet_module_list", lambda: api.controlnet_module_list(), lambda r: "canny" in r),
        ("controlnet_detect", lambda: api.controlnet_detect([pic], module="canny", processor_res=64),
         lambda r: sizes(r) == [(64, 64)] and r.info == "Success"),
        ("list_prompt_gen_models", lambda: api.list_prompt_gen_models(), lambda r: isinstance(r, list)),
        ("prompt_gen", lambda: api.prompt_gen(text="a cat"), lambda r: isinstance(r, list)),
        ("util_get_model_names", lambda: api.util_get_model_names(), lambda r: r == [model]),
        ("util_get_sampler_names", lambda: api.util_get_sampler_names(), lambda r: "Euler a" in r),
        ("util_get_scheduler_names", lambda: api.util_get_scheduler_names(), lambda r: "karras" in r),
        ("util_get_current_model", lambda: api.util_get_current_model(), lambda r: r == model),
        ("util_set_model", lambda: api.util_set_model(model), lambda r: r is None),
        ("util_wait_for_ready", lambda: api.util_wait_for_ready(check_interval=0.1), lambda r: r is None),
        ("set_auth", lambda: api.set_auth("u", "p"), lambda r: r is None),
        ("ControlNetInterface.txt2img", lambda: webuiapi.ControlNetInterface(api).txt2img(
            prompt="a cat", controlnet_image=[pic], controlnet_module="canny", controlnet_model="None",
            **SMALL), lambda r: len(r.images) >= 1),
        ("ControlNetInterface.model_list", lambda: webuiapi.ControlNetInterface(api).model_list(),
         lambda r: isinstance(r, list)),
        # other extensions' helpers: their alwayson scripts refused naming them (AUTOMATIC1111 without the extension:
        # a 422 "always on script ... not found"), their own routes AUTOMATIC1111's 404 without the extension
        *[(f"txt2img ({kind})", (lambda kw: lambda: api.txt2img(prompt="a cat", alwayson_scripts={}, **kw, **SMALL))(
            {kind: value}), lambda r: False) for kind, value in (
            ("adetailer", [webuiapi.ADetailer(ad_model="face_yolov8n.pt")]), ("animatediff", webuiapi.AnimateDiff()),
            ("roop", webuiapi.Roop(pic)), ("reactor", webuiapi.ReActor(pic)), ("sag", webuiapi.Sag()))],
        ("ModelKeywordInterface.get_keywords", lambda: webuiapi.ModelKeywordInterface(api).get_keywords(),
         lambda r: False),
        ("InstructPix2PixInterface.img2img", lambda: webuiapi.InstructPix2PixInterface(api).img2img(
            images=[pic], prompt="x"), lambda r: False),
        ("RemBGInterface.rembg", lambda: webuiapi.RemBGInterface(api).rembg(input_image=pic), lambda r: False),
        ("SegmentAnythingInterface.heartbeat", lambda: webuiapi.SegmentAnythingInterface(api).heartbeat(),
         lambda r: False),
        ("TaggerInterface.tagger_interrogators", lambda: webuiapi.TaggerInterface(api).tagger_interrogators(),
         lambda r: False),
    ]


async def _awaited(make):
    return await make()  # webuiapi's use_async makes its future on the running loop


def run(url: str) -> list[tuple[str, str, str]]:
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=2)
    last: list = []
    api.session.hooks["response"].append(lambda r, *a, **k: last.append(r))
    rows = []
    for name, call, check in calls(api):
        last.clear()
        try:
            answer = call()
        except Exception as e:  # noqa: BLE001 - a survey: every failure is a row
            status = last[-1].status_code if last else None
            text = (last[-1].text if last else repr(e))[:140].replace("|", "/").replace("\n", " ")
            if status == 404 and name in NOT_SERVED:
                rows.append((name, "not served (one-line 404)", text))
                continue
            if status in (400, 422) and name in REFUSED_AS_A1111:
                rows.append((name, f"refused ({status}) naming it, as AUTOMATIC1111 without the extension", text))
                continue
            if status == 404 and name in AS_A1111_404:
                rows.append((name, AS_A1111, ""))
                continue
            kind = "missing route (404)" if status == 404 else f"refused ({status})" if status and status < 500 \
                else f"error ({status})" if status else "error"
            rows.append((name, kind, text))
            continue
        status = last[-1].status_code if last else 200
        ok = False
        try:
            ok = bool(check(answer))
        except Exception:  # noqa: BLE001
            pass
        if ok or status == 404 and name in AS_A1111_404:
            rows.append((name, "works" if status != 404 else AS_A1111, ""))
        elif status == 404:
            rows.append((name, "missing route (404)", last[-1].text[:140]))
        elif status >= 400:
            rows.append((name, f"refused ({status})", last[-1].text[:140].replace("\n", " ")))
        else:
            rows.append((name, "wrong answer", repr(answer)[:140].replace("|", "/").replace("\n", " ")))
    return rows


def main() -> None:
    rows = run(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:7861")
    print("| method | result | detail |\n|---|---|---|")
    for name, kind, detail in rows:
        print(f"| `{name}` | {kind} | {detail} |")
    works = sum(kind == "works" for _, kind, _ in rows)
    absent = sum("without the extension" in kind or kind == AS_A1111 for _, kind, _ in rows)
    print(f"\n{works} of {len(rows)} calls work; {absent} answer as AUTOMATIC1111 1.10 does without the route or "
          f"extension (its 404, or a refusal naming the script); {len(rows) - works - absent} other")


if __name__ == "__main__":
    main()
