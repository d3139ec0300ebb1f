"""Command line: wiring only (argparse -> engine, or -> a running server).

    diffgraph generate "PROMPT" -o out.png [--model --width --height --steps --guidance --sampler --schedule --seed -n]
    diffgraph generate "PROMPT" -o out.png --url http://127.0.0.1:8000 [--api-key KEY]   (a running `diffgraph serve`)
    diffgraph models
    diffgraph compare --quantize fp8 --model M [--seeds 20]   (cli_compare.py: the fp8 tier's cost to M, measured)
    diffgraph compare --step-cache auto --model M [-o PNG]     (cli_compare.py: a step cache against uncached)
    diffgraph batch FILE.jsonl --out DIR [--model ... | --url URL] [--grid]   (jobs/cli_batch.py)
    diffgraph convert SOURCE OUT [--key K] [--dtype fp16] [--layout sdxl]   (models/convert.py)

Bad input exits with code 2 and a one-line message that says what to do instead, checked before the model loads
where it can be (cli_checks.py: the output folder, the device, adapter names given as paths). Everything heavy is
imported inside the function that needs it: `--help` and `models` import neither torch, diffusers nor
transformers, `generate --url` no torch, and the serve flags are built only for `diffgraph serve` (its module
imports the server's configuration). `diffgraph serve` configures logging itself, at its --log-level.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Callable

from .capability_settings import RequestFlag, add_request_flags, builtin, request_values
from .cli_compare import add_compare_arguments, run_compare
from .cli_flags import (add_checkpoint_arguments, add_compile_mode_argument, add_quantize_arguments, checkpoint_options,
                        compile_from_args, quantize_error, quantize_from_args)
from .cli_hires import (TXT2IMG, add_variation_hires_arguments, fill_from_saved, hires_from_args, run_hires,
                        txt2img_body, txt2img_images, variation_from_args)
from .cli_progress import post_once, post_streaming, progress_for
from .cli_checks import can_create_in, check_devices, did_you_mean, is_file_path, lora_path_error
from .jobs.cli_batch import add_batch_arguments, run_batch
from .models.presets import DEFAULT_MODEL, available_presets
from .sampling.names import BUILTIN_FAMILIES, DEFAULT_SAMPLER, DEFAULT_SCHEDULE, SAMPLERS, SCHEDULES, TIMESTEP_SPACINGS


def default_model() -> str:
    return DEFAULT_MODEL


def _add_generate_arguments(g: argparse.ArgumentParser) -> None:
    """`generate`'s flags, in the order --help lists them."""
    _add_request_arguments(g)
    _add_edit_arguments(g)
    _add_capability_arguments(g)
    add_variation_hires_arguments(g)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--dtype", default=None, help="fp32, fp16 or bf16 (default: fp16 on cuda, fp32 on cpu)")
    g.add_argument("--compile", action="store_true", help="the compile tier (a slow first start; see serve --help)")
    add_compile_mode_argument(g)
    add_quantize_arguments(g)
    g.add_argument("--url", default=None,
                   help="send the request to a running `diffgraph serve` at this URL (e.g. http://127.0.0.1:8000) "
                        "instead of loading the model here")
    g.add_argument("--api-key", default=None,
                   help="with --url: the server's API key, sent as `Authorization: Bearer KEY` "
                        "(default: $DIFFGRAPH_API_KEY)")
    g.add_argument("--from-image", default=None, metavar="FILE",
                   help="re-run the request saved in an image's settings (a diffgraph image, or AUTOMATIC1111's "
                        "`parameters` text); flags given here override the file's values")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line on a terminal (loading, steps, decoding); pipes and logs never get one")
    g.add_argument("--no-metadata", dest="metadata", action="store_false",
                   help="write images without their settings (by default a PNG carries AUTOMATIC1111's "
                        "`parameters` text and the request as JSON; JPEG/WebP the same in EXIF)")


def _add_request_arguments(g: argparse.ArgumentParser) -> None:
    """`generate`'s prompt, output file, model and the request's sampling flags."""
    g.add_argument("prompt", nargs="?", default=None,
                   help="the text prompt (with --from-image: the file's, unless given)")
    g.add_argument("-o", "--output", default="out.png",
                   help="output file (.png/.jpg/.webp); with -n > 1 files are numbered: out-0.png, out-1.png, ...")
    g.add_argument("--model", default=None,
                   help=f"preset, local diffusers folder or checkpoint file (.safetensors: SD1.x, SD2.x, SDXL) "
                        f"(default: {default_model()})")
    add_checkpoint_arguments(g)
    g.add_argument("--negative-prompt", default=None, help="negative prompt")
    g.add_argument("--width", type=int, default=None, help="image width, multiple of 8 (default: the model's native size)")
    g.add_argument("--height", type=int, default=None, help="image height, multiple of 8 (default: native size)")
    g.add_argument("--steps", type=int, default=None,
                   help="denoising steps, 1-200 (default: the model's, 20 for SD; a LoRA's sidecar's where it has one)")
    g.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale >= 0 (default: 7.5 SD, 5.0 SDXL)")
    g.add_argument("--sampler", default=None,
                   help=f"one of {', '.join(SAMPLERS)} (the built-in families'), or a label that names its schedule "
                        f"(\"DPM++ 2M Karras\"); default: the model's ({DEFAULT_SAMPLER} for SD)")
    g.add_argument("--schedule", default=None,
                   help=f"one of {', '.join(SCHEDULES)} (the built-in families'); default: the one the sampler's "
                        f"label names, else the model's ({DEFAULT_SCHEDULE!r} for SD)")
    g.add_argument("--timestep-spacing", default=None, choices=TIMESTEP_SPACINGS,
                   help="the sampler's timestep spacing (default: the model's scheduler config's; trailing for "
                        "few-step models)")
    g.add_argument("--eta", type=float, default=None, help="the noise amount of samplers tcd (its gamma, default 0.3), "
                   "ddim, ddim_cfgpp (their eta, default 0) and euler_a, dpmpp_2s_a, dpm_fast (their eta, default 1), "
                   "0-1")
    g.add_argument("--schedule-shift", type=float, default=None,
                   help="a flow-matching model's time shift at every size, in place of its schedule's (3: the "
                        "Qwen-Image-Lightning LoRAs'); default: the schedule's, or the LoRA sidecar's")
    g.add_argument("--seed", type=int, default=None,
                   help="seed, 0 or more; left out, or -1 (as in AUTOMATIC1111 and ComfyUI): a random seed, printed")
    g.add_argument("-n", "--num-images", type=int, default=1, help="images for this prompt, 1-16")
    g.add_argument("--tiling", action="store_true",
                   help="a seamless texture: every convolution of the UNet and the VAE pads circularly, so the image "
                        "wraps around its edges (AUTOMATIC1111's tiling; SD1.x, SD2.x and SDXL models)")


def _add_edit_arguments(g: argparse.ArgumentParser) -> None:
    """`generate`'s image-to-image and inpainting flags."""
    g.add_argument("--image", default=None, metavar="PATH",
                   help="image-to-image from this image (transparent pixels: inpainted there); output size: the "
                        "image's, rounded down to multiples of 8, unless --width/--height")
    g.add_argument("--mask", default=None, metavar="PATH",
                   help="with --image: inpaint where the mask is white (or transparent, for a mask with alpha)")
    g.add_argument("--strength", type=float, default=None,
                   help="with --image: the share of the steps to run, in (0, 1] (default: 0.8, or 1.0 inpainting; "
                        "SDXL 0.3 / 0.9999)")


def _add_capability_arguments(g: argparse.ArgumentParser) -> None:
    """`generate`'s adapter, ControlNet, IP-Adapter, reference-image and prompt-reading flags, and their local
    folders."""
    add_request_flags(g, _request_flags())  # the built-in capabilities' (--step-cache, --reference-image)
    g.add_argument("--lora", action="append", default=None, metavar="NAME[:SCALE]",
                   help="apply a LoRA adapter (repeatable, up to 8): a name in --lora-dir (or on the server with "
                        "--url), or a built-in adapter of the model; scale 1 when left out")
    g.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="a folder of .safetensors adapters that --lora names (not with --url: the server has its own)")
    g.add_argument("--control", action="append", default=None, metavar="NAME:IMAGE[:SCALE[:START:END]]",
                   help="a ControlNet control (repeatable, up to 3): a ControlNet in --controlnet-dir (or the "
                        "server's, with --url), its control image, scale (1) and window (0:1, fractions of the steps)")
    g.add_argument("--preprocess", default="none", choices=("none", "canny", "invert"),
                   help="what makes the control maps from the --control images: none (they are the maps), canny "
                        "(OpenCV's edges, thresholds 100 / 200), invert (black-on-white line art)")
    g.add_argument("--resize-mode", default="just_resize", choices=("just_resize", "crop_and_resize", "resize_and_fill"),
                   help="how the control maps meet the output size (AUTOMATIC1111's): stretched to it, covering it "
                        "centre-cropped, or inside it on the map's border colour")
    g.add_argument("--control-mode", default="balanced", choices=("balanced", "prompt", "control"),
                   help="AUTOMATIC1111's control mode: balanced, prompt (my prompt is more important) or control "
                        "(ControlNet is more important: diffusers' guess mode)")
    g.add_argument("--controlnet-dir", default=None, metavar="DIR",
                   help="a folder of ControlNets (diffusers folders, or AUTOMATIC1111 / ComfyUI single .safetensors files) that --control names (not with --url)")
    g.add_argument("--image-prompt", action="append", default=None, metavar="IMAGE[:SCALE]",
                   help="an IP-Adapter image prompt (repeat for a second image; one scale for both, default 1)")
    g.add_argument("--ip-adapter", default=None, metavar="NAME",
                   help="the IP-Adapter of --image-prompt, by its name under --ip-adapter-dir (or the server's, with "
                        "--url); default: the folder's only one")
    g.add_argument("--ip-adapter-dir", default=None, metavar="DIR",
                   help="a folder of IP-Adapters (h94's layout, with their image_encoder folder) that --ip-adapter "
                        "names (not with --url)")
    g.add_argument("--lora-conv", action="store_true",
                   help="side paths on convolutions too, for adapters that touch them (LoCon, LCM-LoRA, TCD)")
    g.add_argument("--prompt-syntax", default=None, choices=("plain", "a1111"),
                   help="plain: diffusers' reading (77 tokens; the default here, the server's own with --url); "
                        "a1111: AUTOMATIC1111's (word:1.2) emphasis, long prompts in 75-token chunks, BREAK, "
                        "embeddings by name, <lora:name:0.8> tags")
    g.add_argument("--clip-skip", type=int, default=None, metavar="N",
                   help="skip the text encoder's last N layers (diffusers' numbering: 1 = AUTOMATIC1111's CLIP skip 2)")
    g.add_argument("--embeddings-dir", default=None, metavar="DIR",
                   help="a folder of .safetensors textual-inversion embeddings that a1111-syntax prompts name (not "
                        "with --url: the server has its own)")


def _parser(serve: bool = True) -> argparse.ArgumentParser:
    """The parser; `serve=False` leaves the serve sub-parser without its flags (they are only read by
    `diffgraph serve`, and building them imports the server's configuration)."""
    p = argparse.ArgumentParser(prog="diffgraph", description="Generate images with SD-family models on CUDA graphs.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images from a prompt")
    _add_generate_arguments(g)

    m = sub.add_parser("models", help="list the presets (or, with --dir, the models of a folder)")
    m.add_argument("--dir", default=None, metavar="DIR",
                   help="list every checkpoint file and diffusers folder under DIR as `diffgraph serve --model-dir "
                        "DIR` serves them: name, kind, family, size, and why one cannot be served (no torch import)")
    m.add_argument("--hashes", action="store_true",
                   help="with --dir: AUTOMATIC1111's short hash of each file (sha256; reads every file once, cached)")

    i = sub.add_parser("info", help="load a model, capture its graphs and print the graph table")
    i.add_argument("--model", default=None, help=f"preset or local diffusers folder (default: {default_model()})")
    i.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    i.add_argument("--batch-buckets", default="1,2,4,8,16,32", help="graph batch buckets, in denoiser rows (default: %(default)s)")
    i.add_argument("--resolutions", default="", help="WxH list to capture (default: the model's native size)")
    i.add_argument("--verify", action="store_true", help="compare each replay with an eager run at capture")
    i.add_argument("--compile", action="store_true", help="the compile tier: capture compiled code (slow first start)")
    add_compile_mode_argument(i)
    add_quantize_arguments(i)

    c = sub.add_parser("compile", help="fill a compile-tier cache ahead of time (for a fleet of the same GPU)")
    c.add_argument("--model", default=None, help=f"preset or local diffusers folder (default: {default_model()})")
    c.add_argument("--batch-buckets", default="1,2,4,8,16,32", help="graph batch buckets, in denoiser rows (default: %(default)s)")
    c.add_argument("--resolutions", default="", help="WxH list (default: the model's native size)")
    c.add_argument("--out", required=True, metavar="DIR",
                   help="the cache folder (serve and generate read it with --compile-cache DIR)")
    c.add_argument("--compile", action="store_true", default=True, help=argparse.SUPPRESS)  # what it fills
    add_compile_mode_argument(c)  # each mode's code is its own (its options are in the precompiled files' keys)
    add_quantize_arguments(c)  # the fp8 tier's compiled code is its own (the cache key names its fp8 layers)
    add_compare_arguments(sub.add_parser("compare", help="measure what --quantize fp8 or --step-cache costs a model: "
                                                         "fp8 against 16 bits, or cached against uncached images, "
                                                         "side by side"))

    v = sub.add_parser("convert", help="a pickle checkpoint (.ckpt .pt .pth .bin) to .safetensors, never running its "
                                       "code; a diffusers folder to one original-layout file, or back")
    v.add_argument("source", help="a .ckpt/.pt/.pth/.bin file, an original-layout .safetensors checkpoint, or a "
                                  "diffusers SD1.x/SD2.x/SDXL folder")
    v.add_argument("out", help="a .safetensors file (from a pickle or a folder) or a folder (from a .safetensors file)")
    v.add_argument("--key", default=None, help="a pickle's part to keep, dotted for nested ones (params_ema, "
                                               "model.ema; default: state_dict when present, else everything)")
    v.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                   help="cast floating tensors (default: as stored)")
    v.add_argument("--layout", default=None, choices=["sd1", "sd2", "sdxl"],
                   help="a folder's original layout (default: from its text encoders)")
    v.add_argument("--model-config", default=None, metavar="FOLDER",
                   help="the diffusers config folder to read a .safetensors checkpoint with (default: detected)")
    v.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    b = sub.add_parser("bench", help="benchmarks: latency | throughput | serve (each has --help)")
    b.add_argument("which", choices=["latency", "throughput", "serve"])
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    add_batch_arguments(sub.add_parser("batch", help="make the images of a job file (JSONL: a request a line) here or "
                                                     "on a server (--url); re-running resumes"))

    add_serve_arguments = None
    if serve:
        try:
            from .server.cli import add_serve_arguments
        except ImportError:  # the server's extra dependencies are not installed
            pass
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (images API, SSE progress, /metrics)")
    if add_serve_arguments is not None:
        add_serve_arguments(sv)
    return p


class _ArgError(Exception):
    pass


# -o's extension -> the image format (the server's output_format)
OUTPUT_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def _output_paths(output: str, n: int) -> list[str]:
    root, ext = os.path.splitext(output)
    if ext.lower() not in OUTPUT_FORMATS:
        raise _ArgError(f"output {output!r} must end in .png, .jpg, .jpeg or .webp")
    # fail before the model loads, not after the images are made: the folder, or the nearest existing folder
    # above it (where the missing ones will be made), must be a writable folder
    folder = os.path.dirname(os.path.abspath(output))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not can_create_in(existing):
        raise _ArgError(f"output folder {folder!r} cannot be created or written ({existing!r} is not a writable "
                        "folder); choose another -o")
    paths = [output] if n == 1 else [f"{root}-{i}{ext}" for i in range(n)]
    for path in paths:
        if os.path.isdir(path):
            raise _ArgError(f"output {path!r} is a folder; choose another -o (a file name, e.g. out.png)")
    return paths


# GenerationRequest parameter -> the flag that sets it: errors name what the user typed
FLAGS = {"prompt": "the prompt", "negative_prompt": "--negative-prompt", "width": "--width", "height": "--height",
         "num_inference_steps": "--steps", "guidance_scale": "--guidance", "sampler": "--sampler",
         "schedule": "--schedule", "seed": "--seed", "num_images": "-n/--num-images", "device": "--device",
         "mode": "--mode", "image": "--image", "mask": "--mask", "strength": "--strength", "loras": "--lora",
         "prompt_syntax": "--prompt-syntax", "clip_skip": "--clip-skip", "emphasis": "--prompt-syntax",
         "timestep_spacing": "--timestep-spacing", "eta": "--eta", "controls": "--control",
         "schedule_shift": "--schedule-shift",
         "image_prompts": "--image-prompt", "tiling": "--tiling", "hires_scale": "--hires-scale",
         "hires_steps": "--hires-steps", "hr_upscaler": "--hires-upscaler",
         "denoising_strength": "--denoising-strength", "variation": "--subseed-strength",
         **{f.param: f.name for d in builtin() for f in d.flags}}  # the capabilities' (--reference-image ...)


# the HTTP body fields of POST /v1/images/generations -> the flag that sets them (most are named as above)
HTTP_FLAGS = {**FLAGS, "n": FLAGS["num_images"], "size": "--width/--height", "model": "--model"}


def _in_flag_words(message: str, param: str | None, flags: dict[str, str]) -> str:
    """`message` with its leading parameter name ("num_images 17 is out of range") replaced by the flag."""
    if param in flags and message.split(" ", 1)[0].rstrip(":,;") == param:
        message = flags[param] + message[len(param):]
    return message


def _flag_error(e: ValueError, args: argparse.Namespace) -> _ArgError:
    """A ParamError in the words of the command line: the parameter's name becomes its flag, and an unknown sampler
    or schedule gets the nearest names."""
    param = getattr(e, "param", None)
    message = _in_flag_words(str(e), param, FLAGS)
    if param in ("sampler", "schedule"):
        message += did_you_mean(getattr(args, param), SAMPLERS if param == "sampler" else SCHEDULES)
    return _ArgError(message)


def _server_error(url: str, status: int, error: Any) -> _ArgError:
    """An OpenAI-shaped error body from the server, in the words of the command line."""
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return _ArgError(f"the server at {url} answered {status} without an error message")
    message, param = error["message"], error.get("param")
    first = message.split(" ", 1)[0]
    if param == "size" and first in ("width", "height"):  # the server checks one side of the size
        param = first
    message = _in_flag_words(message, param, HTTP_FLAGS)
    if param in HTTP_FLAGS and HTTP_FLAGS[param] not in message:
        message = f"{message} ({HTTP_FLAGS[param]})"
    if status == 401:
        return _ArgError(f"{message}; give --api-key KEY or set DIFFGRAPH_API_KEY")
    if status != 400:
        message = f"the server at {url} answered {status}: {message}"
    return _ArgError(message)


def _save_all(items: list[Any], paths: list[str], save: Callable[[Any, str], None]) -> None:
    """Saves each item to its path (making missing folders) and prints the path."""
    for item, path in zip(items, paths):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save(item, path)
        except OSError as e:
            raise _ArgError(f"could not write {path!r}: {e.strerror or e}; choose another -o") from None
        print(path)


def _write_bytes(data: bytes, path: str) -> None:
    with open(path, "wb") as f:
        f.write(data)


# generate's flag (its dest) -> the GenerationRequest.create argument that --from-image reads from the file
FROM_IMAGE = {"prompt": "prompt", "negative_prompt": "negative_prompt", "width": "width", "height": "height",
              "steps": "num_inference_steps", "guidance": "guidance_scale", "sampler": "sampler",
              "schedule": "schedule", "seed": "seed", "num_images": "num_images", "prompt_syntax": "prompt_syntax",
              "clip_skip": "clip_skip", "model": "model", "strength": "strength",
              "timestep_spacing": "timestep_spacing", "eta": "eta", "tiling": "tiling",
              "schedule_shift": "schedule_shift"}
NO_FLAG = ("emphasis", "guidance_interval", "guidance_rescale", "noise_seed_delta")  # fields only --from-image sets


def _explicit_flags(argv: list[str]) -> set[str]:
    """The generate options (their dests) given on the command line: those override --from-image's file."""
    q = argparse.ArgumentParser(add_help=False)
    _add_generate_arguments(q)
    dests = vars(q.parse_known_args(argv)[0])
    unset = object()
    q.set_defaults(**{dest: unset for dest in dests})
    return {k for k, v in vars(q.parse_known_args(argv)[0]).items() if v is not unset}


def _apply_from_image(args: argparse.Namespace, argv: list[str]) -> None:
    """Fills the flags not given on the command line from the request saved in --from-image's file."""
    from .image_metadata import MetadataError, read_request

    try:
        saved = read_request(args.from_image)
    except FileNotFoundError:
        raise _ArgError(f"--from-image {args.from_image!r} does not exist") from None
    except (MetadataError, OSError) as e:
        raise _ArgError(f"--from-image {args.from_image!r} {e}") from None
    given = _explicit_flags(argv)
    for dest, name in FROM_IMAGE.items():
        if dest not in given and saved.get(name) is not None:
            setattr(args, dest, saved[name])
    if "lora" not in given and saved.get("loras"):
        args.lora = [f"{name}:{float(scale)!r}" for name, scale in saved["loras"]]
    if args.strength is not None and args.image is None:
        raise _ArgError(f"--from-image {args.from_image!r} is an image-to-image request (strength "
                        f"{args.strength:g}); give its input image with --image (images do not embed their input)")
    args.extra = {name: saved[name] for name in NO_FLAG if name in saved}
    fill_from_saved(args, saved, given)
    for f in _request_flags():  # the capabilities' value flags the file's request set
        if not f.images and f.dest not in given and (saved.get("extras") or {}).get(f.param) is not None:
            setattr(args, f.dest, saved["extras"][f.param])


def _request_flags() -> tuple[RequestFlag, ...]:
    """The request flags the built-in capabilities declare (capabilities/)."""
    return tuple(f for d in builtin() for f in d.flags)


def _capability_extras(args: argparse.Namespace) -> dict[str, Any]:
    """The request's capability parameters from their flags (capability_settings.RequestFlag): values (a JSON object
    read; a file's value kept) and image files (each read as an RGB image here: a bad file fails before the model
    loads; a model without the capability refuses it by name)."""
    images = {f.param: [_read_image(p, f.name).convert("RGB") for p in getattr(args, f.dest)]
              for f in _request_flags() if f.images and getattr(args, f.dest, None)}
    return {**_flag_values(args), **images}


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The request parameters of the capabilities' value flags (a JSON object read). Raises _ArgError."""
    try:
        return request_values(args, _request_flags())
    except ValueError as e:
        raise _ArgError(str(e)) from None


def _flag_images_b64(args: argparse.Namespace) -> dict[str, Any]:
    """The capabilities' image flags as the HTTP body's base64 lists."""
    return {f.param: [_file_b64(p, f.name) for p in getattr(args, f.dest)]
            for f in _request_flags() if f.images and getattr(args, f.dest, None)}


def _serve_ray(config: Any, data_parallel: int | None, address: str | None) -> int:
    """`diffgraph serve --ray` (ray.py's launcher; it needs Ray Serve)."""
    try:
        from .ray import serve_flags
        import ray.serve  # noqa: F401
    except ImportError as e:
        print(f"diffgraph: error: --ray needs Ray Serve ({e}); pip install 'diffgraph[ray]'", file=sys.stderr)
        return 2
    return serve_flags(config, data_parallel, address)


def _generate(args: argparse.Namespace, argv: list[str] = ()) -> int:
    if args.from_image is not None:
        _apply_from_image(args, list(argv))
    if args.prompt is None:
        raise _ArgError("give a prompt (or --from-image FILE, to re-run the settings saved in an image)")
    if args.seed == -1:  # "random" in AUTOMATIC1111 and ComfyUI: the same as leaving --seed out
        args.seed = None
    paths = _output_paths(args.output, args.num_images if args.num_images > 0 else 1)
    if args.url is not None:
        return _generate_remote(args, paths)
    from .request import GenerationRequest, ParamError, require_prompt

    params = dict(negative_prompt=args.negative_prompt, num_inference_steps=args.steps, sampler=args.sampler,
                  schedule=args.schedule, seed=args.seed, num_images=args.num_images, **_edit_params(args),
                  loras=_lora_flags(args), controls=_control_flags(args), image_prompts=_image_prompt_flags(args),
                  prompt_syntax=args.prompt_syntax or "plain",
                  clip_skip=args.clip_skip,
                  timestep_spacing=args.timestep_spacing, eta=args.eta, tiling=args.tiling,
                  schedule_shift=args.schedule_shift,
                  extras=_capability_extras(args) or None, variation=variation_from_args(args),
                  **getattr(args, "extra", {}))
    hires = hires_from_args(args)
    try:
        # the one validation, before torch is imported and the model loads: bad input fails fast
        sized = args.width is not None or "image" not in params
        require_prompt(args.prompt, params.get("image"))  # as OpenAI's route: text-to-image needs a prompt
        GenerationRequest.create(args.prompt, width=args.width or 512 if sized else None,
                                 height=args.height or 512 if sized else None,
                                 guidance_scale=7.5 if args.guidance is None else args.guidance, **params)
        if hires is not None:  # its settings checked at the flags' size (the model's own is checked again)
            from .hires import plan_fix
            plan_fix(args.width or 512, args.height or 512, 8, first_steps=args.steps or 0, **hires)
        check_devices(args)
    except ParamError as e:
        raise _flag_error(e, args) from None
    quantize, compile = quantize_from_args(args), compile_from_args(args)
    model = args.model or default_model()
    with progress_for(args) as progress:
        t0 = time.monotonic()
        progress.phase(f"loading {os.path.basename(model.rstrip(os.sep)) or model}")
        try:
            import torch

            from .config import DEFAULT_LORA_SLOTS, default_cpu_threads
            from .engine.engine import Engine, default_device

            if (args.device or default_device()).startswith("cpu"):
                torch.set_num_threads(default_cpu_threads())  # as the server does (see default_cpu_threads)
            slots = DEFAULT_LORA_SLOTS if params["loras"] and not args.lora_dir else None  # --lora FILE: slots
            engine = Engine(model=model, device=args.device, dtype=args.dtype, lora_dir=args.lora_dir, max_loras=slots,
                            lora_conv=args.lora_conv, controlnet_dir=args.controlnet_dir,
                            ip_adapter_dir=args.ip_adapter_dir,
                            compile=compile, quantize=quantize, embeddings_dir=args.embeddings_dir,
                            metadata=args.metadata,
                            load=checkpoint_options(args))
            progress.line(f"loaded {engine.info.name} in {time.monotonic() - t0:.1f} s")
            request = engine.make_request(args.prompt, width=args.width, height=args.height,
                                          guidance_scale=args.guidance,
                                          output_format=OUTPUT_FORMATS[os.path.splitext(args.output)[1].lower()],
                                          **params)
        except ParamError as e:
            raise _flag_error(e, args) from None
        progress.phase("encoding the prompt")
        if hires is not None:
            try:
                encoded = run_hires(engine, request, hires, request.output_format, args.metadata)
            except ParamError as e:
                raise _flag_error(e, args) from None
            _save_all(encoded, paths, _write_bytes)
            print(f"seed {request.seed}, {(time.monotonic() - t0) * 1000:.0f} ms", file=sys.stderr)
            return 0
        result = engine.submit(request, on_progress=progress.step if progress.active else None).result()
    _save_all(result.encoded, paths, _write_bytes)  # encoded by the engine, with the settings inside
    print(f"seed {result.seed}, {result.timings['total_ms']:.0f} ms", file=sys.stderr)
    return 0


def _control_specs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, float]]]:
    """--control NAME:IMAGE[:SCALE[:START:END]] as (name, image path, numbers)."""
    out = []
    for text in args.control or ():
        parts = text.split(":")
        numbers = parts[2:] if len(parts) in (3, 5) else None
        if len(parts) < 2 or numbers is None and len(parts) != 2 or not parts[0] or not parts[1]:
            raise _ArgError(f"--control {text!r} must look like NAME:IMAGE, NAME:IMAGE:SCALE or "
                            "NAME:IMAGE:SCALE:START:END (e.g. canny:edges.png:0.8:0:0.6)")
        try:
            values = dict(zip(("scale", "start", "end"), map(float, numbers or ())))
        except ValueError:
            raise _ArgError(f"--control {text!r}: scale, start and end must be numbers") from None
        out.append((parts[0], parts[1], values))
    return out


def _control_flags(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The --control flags as a request's controls (images read here: a bad file fails before the model loads)."""
    if args.control and args.controlnet_dir is None:
        raise _ArgError("--control needs --controlnet-dir DIR, the folder of ControlNets it names (or --url, a "
                        "server's)")
    return [dict(model=name, image=_read_image(path, "--control").convert("RGB"), **_control_options(args),
                 **values) for name, path, values in _control_specs(args)]


def _control_options(args: argparse.Namespace) -> dict[str, str]:
    """The flags that apply to every --control."""
    return {"preprocess": args.preprocess, "resize_mode": args.resize_mode, "control_mode": args.control_mode}


def _image_prompt_specs(args: argparse.Namespace) -> tuple[str | None, list[str], float] | None:
    """--image-prompt IMAGE[:SCALE] (repeated: several images) and --ip-adapter as (name, image paths, scale)."""
    specs = []
    for text in args.image_prompt or ():
        path, _, scale = text.rpartition(":") if ":" in text else (text, "", "")
        try:
            specs.append((path, float(scale) if scale else None))
        except ValueError:  # a colon in the path itself, not a scale
            specs.append((text, None))
        if not specs[-1][0]:
            raise _ArgError(f"--image-prompt {text!r} must look like IMAGE or IMAGE:SCALE (e.g. face.png:0.6)")
    if not specs:
        if args.ip_adapter is not None:
            raise _ArgError("--ip-adapter needs --image-prompt IMAGE (the image that steers it)")
        return None
    scales = {s for _, s in specs if s is not None}
    if len(scales) > 1:
        raise _ArgError("--image-prompt: one scale per request; give it once, or the same on both images")
    return args.ip_adapter, [p for p, _ in specs], next(iter(scales), 1.0)


def _image_prompt_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    spec = _image_prompt_specs(args)
    if spec is None:
        return None
    if args.ip_adapter_dir is None:
        raise _ArgError("--image-prompt needs --ip-adapter-dir DIR, the folder of IP-Adapters (or --url, a "
                        "server's)")
    name, paths, scale = spec
    return {"model": name, "images": [_read_image(p, "--image-prompt").convert("RGB") for p in paths],
            "scale": scale}


def _file_b64(path: str, flag: str) -> str:
    import base64
    try:
        with open(path, "rb") as f:
            return base64.b64encode(f.read()).decode()
    except OSError as e:
        raise _ArgError(f"{flag} {path!r} cannot be read: {e.strerror or e}") from None


def _read_image(path: str, flag: str) -> Any:
    from PIL import Image
    try:
        image = Image.open(path)
        image.load()
    except (OSError, ValueError) as e:
        raise _ArgError(f"{flag} {path!r} cannot be read as an image: {e}") from None
    return image


def _edit_params(args: argparse.Namespace) -> dict[str, Any]:
    """image / mask_image / strength for an edit from --image, --mask, --strength (mask conventions: server/edits)."""
    if args.image is None:
        if args.mask is not None or args.strength is not None:
            raise _ArgError("--mask and --strength need --image (the image to edit)")
        return {}
    from .server.edits import edit_arrays

    rgb, mask = edit_arrays(_read_image(args.image, "--image"),
                            None if args.mask is None else _read_image(args.mask, "--mask"))
    out: dict[str, Any] = {"image": rgb, "strength": args.strength}
    if mask is not None:
        out["mask_image"] = mask
    return out


def _lora_flags(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    from .config import parse_name_scales

    try:
        pairs = parse_name_scales(args.lora or [], "--lora")
    except ValueError as e:
        raise _ArgError(str(e)) from None
    for name, _ in pairs:
        if is_file_path(name):
            raise _ArgError(lora_path_error(name, args.url is not None, args.lora_dir))
    return pairs


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    # the server reads DIFFGRAPH_API_KEY as comma-separated keys: a client sends the first
    keys = [k.strip() for k in os.environ.get("DIFFGRAPH_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


def _generate_remote(args: argparse.Namespace, paths: list[str]) -> int:
    """POST /v1/images/generations on a running server; the images come back encoded and are written as they
    are. Nothing is validated here: the server checks the request once, and its errors name our flags."""
    url = _remote_url(args)
    _refuse_local_only_flags(args)
    if variation_from_args(args) is not None or hires_from_args(args) is not None or \
            getattr(args, "extra", {}).get("noise_seed_delta"):
        return _generate_txt2img(args, paths, url)
    prompt_spec = _image_prompt_specs(args)
    body = _remote_body(args, prompt_spec)
    key = _api_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    progress = progress_for(args)
    if progress.active:  # the bar follows the server's SSE progress events; elsewhere the request is as before
        body["stream"] = True
    post: dict[str, Any] = {"json": body}
    if args.image is not None or args.mask is not None or args.strength is not None:  # /v1/images/edits
        if _flag_images_b64(args):
            names = ", ".join(f.name for f in _request_flags() if f.images)
            raise _ArgError(f"{names} cannot be sent with --image over --url (the edits form takes its images as "
                            f"image[] parts); give every image as {names}")
        post = _edit_form(args, body, prompt_spec)
    status, reason, answer = _post_images(url, post, headers, progress)
    images, seed, total_ms = _images_of_answer(url, status, reason, answer)
    _save_all(images, paths, _write_bytes)
    print(f"seed {seed}, {total_ms:.0f} ms", file=sys.stderr)
    return 0


def _generate_txt2img(args: argparse.Namespace, paths: list[str], url: str) -> int:
    """A request with a variation seed or a hires fix: POST /sdapi/v1/txt2img (cli_hires.py says why)."""
    import httpx

    body = txt2img_body(args, _lora_flags(args))
    key = _api_key(args)
    try:
        with progress_for(args) as progress:
            progress.phase(f"waiting for {url}")
            status, _, answer = post_once(f"{url}{TXT2IMG}", json=body, timeout=httpx.Timeout(None, connect=10),
                                          headers={"Authorization": f"Bearer {key}"} if key else {})
    except httpx.HTTPError as e:
        raise _ArgError(f"the server at {url} could not be reached ({e}); start it with `diffgraph serve` "
                        "or check --url") from None
    images, seed = txt2img_images(url, status, answer)
    _save_all(images, paths, _write_bytes)
    print(f"seed {seed}", file=sys.stderr)
    return 0


def _remote_url(args: argparse.Namespace) -> str:
    """--url without its trailing slash, refused unless it is an http(s) URL."""
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise _ArgError(f"--url {args.url!r} must look like http://HOST:PORT")
    return url


def _refuse_local_only_flags(args: argparse.Namespace) -> None:
    """Refuses the flags that only mean something when the model runs here (the server chose them at start)."""
    local = [flag for flag, value in (("--device", args.device), ("--dtype", args.dtype)) if value is not None]
    local += ["--compile"] if args.compile else []
    local += ["--compile-mode"] if getattr(args, "compile_mode", None) is not None else []
    local += [flag for flag, value in (("--quantize", args.quantize),
                                       ("--quantize-min-features", args.quantize_min_features)) if value is not None]
    if local:
        raise _ArgError(f"{' and '.join(local)} cannot be used with --url: the server chose its device, dtype, "
                        "compile and quantize tiers when it started")
    if (args.width is None) != (args.height is None):
        raise _ArgError("with --url give both --width and --height (or neither, for the model's native size)")
    if not args.metadata:
        raise _ArgError("--no-metadata cannot be used with --url: the server's own --no-metadata decides")
    if args.lora_dir is not None:
        raise _ArgError("--lora-dir cannot be used with --url: the server serves the adapters of its own --lora-dir "
                        "(GET /v1/loras lists them)")
    if args.embeddings_dir is not None:
        raise _ArgError("--embeddings-dir cannot be used with --url: the server reads its own --embeddings-dir "
                        "(GET /v1/embeddings lists them)")
    if args.controlnet_dir is not None or args.ip_adapter_dir is not None:
        raise _ArgError("--controlnet-dir and --ip-adapter-dir cannot be used with --url: the server serves its own "
                        "(GET /v1/controlnets, GET /v1/ip-adapters list them)")


def _remote_body(args: argparse.Namespace, prompt_spec) -> dict[str, Any]:
    """The generations request's JSON body from the flags (the fields left unset are left out)."""
    body = {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "model": args.model,
            "size": None if args.width is None else f"{args.width}x{args.height}",
            "num_inference_steps": args.steps, "guidance_scale": args.guidance, "sampler": args.sampler,
            "schedule": args.schedule, "seed": args.seed, "n": args.num_images,
            "output_format": OUTPUT_FORMATS[os.path.splitext(args.output)[1].lower()],
            "response_format": "b64_json",
            "loras": [{"name": n, "scale": s} for n, s in _lora_flags(args)] or None,
            "controls": [{"model": n, "image": _file_b64(p, "--control"), **_control_options(args), **v}
                         for n, p, v in _control_specs(args)] or None,
            "image_prompts": None if prompt_spec is None else {
                "scale": prompt_spec[2], "images": [_file_b64(p, "--image-prompt") for p in prompt_spec[1]],
                **({"model": prompt_spec[0]} if prompt_spec[0] else {})},
            "prompt_syntax": args.prompt_syntax, "clip_skip": args.clip_skip,
            "timestep_spacing": args.timestep_spacing, "eta": args.eta, "tiling": args.tiling or None,
            "schedule_shift": args.schedule_shift, **_flag_values(args), **_flag_images_b64(args),
            **getattr(args, "extra", {})}  # --from-image's fields without a flag
    return {k: v for k, v in body.items() if v is not None}


def _edit_form(args: argparse.Namespace, body: dict[str, Any], prompt_spec) -> dict[str, Any]:
    """The edits request's multipart form: the body's fields as form fields, the image, mask, control maps and
    image prompts as file parts."""
    if args.image is None:
        raise _ArgError("--mask and --strength need --image (the image to edit)")
    files = {}
    specs = _control_specs(args)  # the form's controls: each map as its own file part, control_image_<i>
    if specs:
        body["controls"] = [{"model": n, **_control_options(args), **v} for n, _, v in specs]
    if prompt_spec is not None:  # its images as the file parts image_prompt_<i>
        body["image_prompts"] = {"scale": prompt_spec[2], **({"model": prompt_spec[0]} if prompt_spec[0] else {})}
    for name, path in (("image", args.image), ("mask", args.mask),
                       *((f"control_image_{i}", p) for i, (_, p, _) in enumerate(specs)),
                       *((f"image_prompt_{i}", p) for i, p in enumerate(prompt_spec[1] if prompt_spec else ()))):
        if path is not None:
            try:
                with open(path, "rb") as f:
                    files[name] = (os.path.basename(path), f.read())
            except OSError as e:
                flag = name if name in ("image", "mask") else "control" if name.startswith("control") \
                    else "image-prompt"
                raise _ArgError(f"--{flag} {path!r} cannot be read: {e.strerror or e}") from None
    if args.strength is not None:
        body["strength"] = args.strength
    return {"data": {k: json.dumps(v) if k in ("loras", "controls", "image_prompts") else str(v).lower() if isinstance(v, bool) else str(v)
                     for k, v in body.items()},
            "files": files}


def _post_images(url: str, post: dict[str, Any], headers: dict[str, str], progress) -> tuple[int, str, Any]:
    """Sends the request (to /v1/images/edits when it has files), following its progress where the bar is shown;
    returns the status, its reason and the decoded answer."""
    import httpx

    try:
        # no read timeout: the server bounds a request's time itself (--request-timeout, then 504)
        endpoint = "edits" if "files" in post else "generations"
        send = dict(headers=headers, timeout=httpx.Timeout(None, connect=10), **post)
        with progress:
            progress.phase(f"waiting for {url}")
            return (post_streaming(f"{url}/v1/images/{endpoint}", progress, **send)
                    if progress.active else post_once(f"{url}/v1/images/{endpoint}", **send))
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise _ArgError(f"the server at {url} could not be reached ({e}); start it with `diffgraph serve` "
                        "or check --url") from None
    except (httpx.TransportError, httpx.InvalidURL) as e:
        raise _ArgError(f"the request to the server at {url} failed: {e}") from None


def _images_of_answer(url: str, status: int, reason: str, answer: Any) -> tuple[list[bytes], Any, float]:
    """The encoded images, the seed and the total ms of the server's answer, or the error it answered."""
    import base64

    if status != 200:
        if not isinstance(answer, dict) or "error" not in answer:
            raise _ArgError(f"the server at {url} answered {status} {reason}")
        raise _server_error(url, status, answer["error"])
    try:
        images = [base64.b64decode(item["b64_json"]) for item in answer["data"]]
        seed, total_ms = answer["seed"], float(answer["timings"]["total_ms"])
    except (TypeError, KeyError, ValueError):
        raise _ArgError(f"the server at {url} answered 200 without images; is it a diffgraph server?") from None
    return images, seed, total_ms


def _bench(which: str, argv: list[str]) -> int:
    import importlib  # bench/latency.py, throughput.py or serve.py (`which` is one of the parser's choices)
    return importlib.import_module(f".bench.{which}", __package__).main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(serve=argv[:1] == ["serve"]).parse_args(argv)
    if args.command != "serve":  # serve configures logging itself, at its --log-level
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            return _bench(args.which, args.args)
        if args.command == "batch":
            return run_batch(args)
        if args.command == "serve":
            if not hasattr(args, "port"):  # the server's parser could not be imported
                raise _ArgError("serving needs the serve extras: pip install 'diffgraph[serve]'")
            check_devices(args)
            from .server.cli import run_serve
            return run_serve(args, ray_server=_serve_ray)
        if args.command == "compare":
            return run_compare(args)
        if args.command == "convert":
            from .models.convert import convert
            print(convert(args.source, args.out, args.key, args.dtype, args.layout, args.model_config, args.overwrite))
            return 0
        if args.command in ("info", "compile"):
            from .graph_commands import compile_cache, info
            return (info if args.command == "info" else compile_cache)(args)
        if args.command == "models" and args.dir is not None:
            from .models.catalog import print_model_dir
            return print_model_dir(args.dir, sys.stdout, hashes=args.hashes)
        if args.command == "models":
            for name, desc in available_presets().items():
                print(f"{name:16s} {desc}")
            print("or a local diffusers folder (StableDiffusionPipeline / StableDiffusionXLPipeline), or a checkpoint "
                  "file (.safetensors: SD1.x, SD2.x, SDXL; `diffgraph models --dir DIR` lists a folder of them)")
            print(f"families {', '.join(BUILTIN_FAMILIES)}: samplers {', '.join(SAMPLERS)} (default "
                  f"{DEFAULT_SAMPLER!r}), schedules {', '.join(SCHEDULES)} (default {DEFAULT_SCHEDULE!r}), "
                  "sizes in multiples of 8")
            return 0
        return _generate(args, argv[1:])
    except (_ArgError, ValueError) as e:
        print(f"diffgraph: error: {quantize_error(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
