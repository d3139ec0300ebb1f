"""`diffgraph generate`'s variation seed and hires fix: their flags, filled by --from-image from an image's
settings, run here (the hires fix through hires.generate_hires) or sent with --url.

The OpenAI images route carries neither a variation seed nor a second pass (nor an image's ENSD,
eta_noise_seed_delta), so with --url a request that has one is posted to the server's AUTOMATIC1111 route, POST /sdapi/v1/txt2img (its `subseed`, `subseed_strength`,
`seed_resize_from_*`, `enable_hr` and `hr_*` fields), which answers PNG; the flags that route cannot carry (image
inputs, ControlNet, image prompts, step caching) are refused in one line, and the prompt is read in
AUTOMATIC1111's syntax (that route's). Errors are ValueError: the CLI prints them.
"""

from __future__ import annotations

import argparse
import json
import secrets
from typing import Any

from .capability_settings import builtin

TXT2IMG = "/sdapi/v1/txt2img"


def add_variation_hires_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--subseed", type=int, default=None,
                   help="AUTOMATIC1111's variation seed: with --subseed-strength, the noise is slerped that far "
                        "towards this seed's (default: a random one, written into the image)")
    g.add_argument("--subseed-strength", type=float, default=None,
                   help="how far the noise moves towards --subseed's, 0-1 (0: the seed's alone)")
    g.add_argument("--seed-resize-from", default=None, metavar="WxH",
                   help="draw the seed's noise at this image size and paste it centred (AUTOMATIC1111's "
                        "`Seed resize from`)")
    g.add_argument("--hires-scale", type=float, default=None,
                   help="the hires fix: a second image-to-image pass at this many times the size (e.g. 2)")
    g.add_argument("--hires-resize", default=None, metavar="WxH",
                   help="the hires fix to this size instead of a scale (0 for one side keeps the aspect)")
    g.add_argument("--hires-upscaler", default=None,
                   help="what enlarges the first pass for the hires fix: Latent (default), its other latent modes, "
                        "Lanczos or Nearest")
    g.add_argument("--hires-steps", type=int, default=None,
                   help="the hires pass's steps (default: --steps)")
    g.add_argument("--denoising-strength", type=float, default=None,
                   help="the hires pass's denoising strength, in (0, 1] (default 0.7)")


def _size(text: Any, flag: str) -> tuple[int, int] | None:
    if text is None or isinstance(text, (tuple, list)):
        return None if text is None else (int(text[0]), int(text[1]))
    width, sep, height = str(text).lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise ValueError(f"{flag} {text!r} must look like WIDTHxHEIGHT (e.g. 512x768)")
    return int(width), int(height)


def variation_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The request's `variation` from --subseed, --subseed-strength, --seed-resize-from; None: none given.
    A strength without --subseed draws a random subseed (as AUTOMATIC1111's -1), which the image records."""
    strength, resize = args.subseed_strength, _size(args.seed_resize_from, "--seed-resize-from")
    if strength is None and resize is None:
        if args.subseed is not None:
            raise ValueError("--subseed needs --subseed-strength (how far the noise moves towards its seed)")
        return None
    subseed = args.subseed if args.subseed not in (None, -1) else secrets.randbelow(2 ** 32)
    return {"subseed": subseed, "strength": strength or 0.0, "resize_from": resize}


def hires_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The hires fix of the flags (hires.plan_fix's arguments); None: neither --hires-scale nor --hires-resize."""
    resize = _size(args.hires_resize, "--hires-resize")
    if args.hires_scale is None and resize is None:
        extra = [f for f, v in (("--hires-upscaler", args.hires_upscaler), ("--hires-steps", args.hires_steps),
                                ("--denoising-strength", args.denoising_strength)) if v is not None]
        if extra:
            raise ValueError(f"{' and '.join(extra)} need --hires-scale or --hires-resize (the hires fix's size)")
        return None
    return {"scale": None if resize else args.hires_scale, "resize": resize, "upscaler": args.hires_upscaler,
            "strength": args.denoising_strength, "steps": args.hires_steps}


# the flags --from-image fills from the file's `variation` and `hires` (their dests -> the saved keys)
SAVED_VARIATION = {"subseed": "subseed", "subseed_strength": "strength", "seed_resize_from": "resize_from"}
SAVED_HIRES = {"hires_scale": "scale", "hires_resize": "resize", "hires_upscaler": "upscaler",
               "hires_steps": "steps", "denoising_strength": "strength"}


def fill_from_saved(args: argparse.Namespace, saved: dict[str, Any], given: set[str]) -> None:
    """Sets the variation and hires flags not given on the command line from a saved request (read_request's)."""
    if given & {"hires_scale", "hires_resize"}:  # a size given here replaces the file's scale or size
        given = given | {"hires_scale", "hires_resize"}
    for key, names in (("variation", SAVED_VARIATION), ("hires", SAVED_HIRES)):
        values = saved.get(key) or {}
        for dest, name in names.items():
            if dest not in given and values.get(name) is not None:
                setattr(args, dest, values[name])


def run_hires(engine: Any, request: Any, spec: dict[str, Any], fmt: str, metadata: bool) -> list[bytes]:
    """Both passes of `request` on `engine` (hires.generate_hires), each image encoded as `fmt` with the first
    pass's settings and the hires fix's infotext entries (as the AUTOMATIC1111 route writes them)."""
    from .hires import generate_hires, plan_fix
    from .image_metadata import encode_image

    fix, params = plan_fix(request.width, request.height, engine.info.size_multiple,
                           first_steps=request.num_inference_steps, rule=engine.info.edit_steps_rule, **spec)
    results = generate_hires(engine, request, fix)
    return [encode_image(r.arrays[0], fmt, request, engine.info.name, metadata, params) for r in results]


def txt2img_body(args: argparse.Namespace, loras: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    """The AUTOMATIC1111 txt2img body of the flags (a request with a variation seed or a hires fix); ValueError for
    a flag that route cannot carry."""
    refused = [flag for flag, value in (("--image", args.image), ("--control", args.control),
                                        ("--image-prompt", args.image_prompt),
                                        *((f.name, getattr(args, f.dest, None)) for d in builtin() for f in d.flags),
                                        ("--timestep-spacing", args.timestep_spacing)) if value]
    extra = getattr(args, "extra", {})
    refused += [name for name, neutral in (("guidance_interval", None), ("guidance_rescale", 0.0),
                                           ("emphasis", "original")) if extra.get(name, neutral) != neutral]
    if refused:
        raise ValueError(f"{', '.join(refused)} cannot be sent with a variation seed or a hires fix over --url: "
                         f"those go to the server's {TXT2IMG}, which takes neither; drop them, or run without --url")
    if not args.output.lower().endswith(".png"):
        raise ValueError(f"with a variation seed or a hires fix, --url posts to {TXT2IMG}, which answers PNG: "
                         "give -o FILE.png")
    from .image_metadata import A1111_SAMPLERS, A1111_SCHEDULES

    variation, hires = variation_from_args(args), hires_from_args(args)
    prompt = args.prompt + "".join(f" <lora:{name}:{scale:g}>" for name, scale in loras)
    overrides = {k: v for k, v in (("sd_model_checkpoint", args.model),
                                   ("CLIP_stop_at_last_layers", args.clip_skip and args.clip_skip + 1),
                                   ("eta_noise_seed_delta", extra.get("noise_seed_delta"))) if v}
    body = {"prompt": prompt, "negative_prompt": args.negative_prompt, "steps": args.steps,
            "cfg_scale": args.guidance, "sampler_name": A1111_SAMPLERS.get(args.sampler, args.sampler),
            "scheduler": A1111_SCHEDULES.get(args.schedule, args.schedule),
            "seed": args.seed, "batch_size": args.num_images, "width": args.width, "height": args.height,
            "eta": args.eta, "tiling": args.tiling or None, "override_settings": overrides or None}
    if variation is not None:
        resize = variation["resize_from"] or (None, None)
        body.update(subseed=variation["subseed"], subseed_strength=variation["strength"],
                    seed_resize_from_w=resize[0], seed_resize_from_h=resize[1])
    if hires is not None:
        body.update(enable_hr=True, hr_scale=hires["scale"], hr_upscaler=hires["upscaler"],
                    hr_second_pass_steps=hires["steps"], denoising_strength=hires["strength"],
                    hr_resize_x=(hires["resize"] or (None, None))[0], hr_resize_y=(hires["resize"] or (None, None))[1])
    return {k: v for k, v in body.items() if v is not None}


def txt2img_images(url: str, status: int, answer: Any) -> tuple[list[bytes], Any]:
    """(the PNG images, the seed) of an AUTOMATIC1111 txt2img answer; ValueError with the server's message."""
    import base64

    if status != 200:
        detail = answer.get("error") or answer.get("detail") if isinstance(answer, dict) else None
        message = detail.get("message") if isinstance(detail, dict) else detail
        raise ValueError(f"the server at {url} answered {status} to {TXT2IMG}: {message or 'no message'}")
    try:
        images = [base64.b64decode(image) for image in answer["images"]]
        seed = json.loads(answer["info"])["seed"] if isinstance(answer.get("info"), str) else None
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"the server at {url} answered {TXT2IMG} without images; is it a diffgraph server?") from None
    return images, seed
