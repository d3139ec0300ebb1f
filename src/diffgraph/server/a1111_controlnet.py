"""AUTOMATIC1111's ControlNet extension on /sdapi/v1: its units in `alwayson_scripts.controlnet.args`
become the request's `controls`, and its listing routes answer (`GET /controlnet/model_list`, `/controlnet/
module_list` with its `module_detail` and `alias_names`, `/controlnet/version`), so its clients work unchanged
against the server's ControlNets.

A unit (the extension's API fields): `input_image` (or `image`; base64, or {"image": ...}), `model` (its name as the
extension lists it, "name [hash]": the name is matched against the served ControlNets' names, then against their
last path component when that is unique), `module` ("none", "canny", "invert (from white bg & black line)"; other
preprocessors need their estimator's weights: send their map with module "none"), `weight` (the scale),
`guidance_start` / `guidance_end`, `resize_mode` and `control_mode` (labels or indices; the extension's defaults
"Crop and Resize" and "Balanced"), `threshold_a` / `threshold_b` (canny's low and high thresholds; as the extension
reads them, a value outside its slider's range, 1..255, such as its -1, takes the slider's default, 100 / 200, logged
in its words for a value other than -1, and a low above the high goes to OpenCV as it is: its Canny swaps them), `enabled`, and `mask` (refused when set). A unit
of an img2img request without its own image takes the first init image, as the extension does. Accepted and without
effect here: `processor_res` and `pixel_perfect` (the preprocessor runs at the image's own resolution), `lowvram` /
`low_vram`, `hr_option` (the hires fix's second pass takes the units too), `input_mode`, `batch_images`.
`save_detected_map` (default true) puts the unit's detected map after the request's images, as the extension
appends it: the map its ControlNet saw, fitted to the image size by the unit's resize mode (`detected_maps`; with
the hires fix the second pass's map first, then the first pass's; none for the SD upscale script).
`guessmode: true` (the extension's old field) is control mode "ControlNet is more important". Other keys are
ignored, as AUTOMATIC1111 ignores unknown keys (`ignored_keys` names them for the answer's
X-Diffgraph-Ignored-Fields header).
"""

from __future__ import annotations

import base64
import io
import logging
import re
from typing import Any, Callable, Sequence

from ..api.protocol import APIError
from ..api.protocol import decode_b64, eight_bit
from ..request import ControlInput

MODULES = {"none": "none", "canny": "canny", "invert": "invert", "invert (from white bg & black line)": "invert"}
IGNORED = ("processor_res", "pixel_perfect", "lowvram", "low_vram", "hr_option", "input_mode", "batch_images", "enabled",
           "is_ui", "loopback")
TAKEN = ("input_image", "image", "mask", "model", "module", "weight", "guidance_start", "guidance_end", "resize_mode",
         "control_mode", "threshold_a", "threshold_b", "guessmode", "save_detected_map")
logger = logging.getLogger(__name__)
_HASH = re.compile(r"\s*\[[0-9a-fA-F]+\]\s*$")
CANNY_SLIDERS = ((100, 1, 255), (200, 1, 255))  # the extension's canny sliders: (default, min, max), low then high
_FALSE = (False, 0, "false", "f", "no", "n", "off", "0")  # a bool field's false values as pydantic reads them


_RESOLUTION = {"name": "Resolution", "value": 512, "min": 64, "max": 2048, "step": 8}
# the served preprocessors as the extension lists them: (name, label, its sliders' api_json), its order
PREPROCESSORS = (("none", "none", (_RESOLUTION,)),
                 ("canny", "canny", (_RESOLUTION, *({"name": name, "value": value, "min": lo, "max": hi, "step": 1}
                                                   for name, (value, lo, hi) in zip(
                                                       ("Low Threshold", "High Threshold"), CANNY_SLIDERS)))),
                 ("invert", "invert (from white bg & black line)", ()))


def module_list(alias_names: bool = False) -> dict[str, Any]:
    """GET /controlnet/module_list as the extension answers it: the preprocessors' names (or their labels, with
    `alias_names`) and `module_detail`, each one's `model_free` and slider settings."""
    names = [label if alias_names else name for name, label, _ in PREPROCESSORS]
    return {"module_list": names, "module_detail": {
        n: {"model_free": False, "sliders": [dict(s) for s in sliders]}
        for n, (_, _, sliders) in zip(names, PREPROCESSORS)}}


def controlnet_units(scripts: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The enabled units of `alwayson_scripts.controlnet` (any capitalisation of the name)."""
    for name, script in (scripts or {}).items():
        if name.lower() == "controlnet":
            args = script.get("args") if isinstance(script, dict) else script
            if not isinstance(args, list):
                raise APIError(400, "alwayson_scripts.controlnet.args must be a list of ControlNet units",
                               param="alwayson_scripts.controlnet.args")
            return [u for u in args if isinstance(u, dict) and u.get("enabled", True) is not False]
    return []


def model_name(name: Any, served: list[str], field: str) -> str:
    """The served ControlNet an extension model name means."""
    if not isinstance(name, str) or not name.strip() or name.strip().lower() == "none":
        raise APIError(400, f"{field}: a unit needs its ControlNet model (GET /controlnet/model_list)", param=field)
    bare = _HASH.sub("", name).strip()
    if bare in served:
        return bare
    by_last = [s for s in served if s.rsplit("/", 1)[-1] == bare]
    if len(by_last) == 1:
        return by_last[0]
    known = ", ".join(served[:10]) or "none"
    raise APIError(400, f"{field}: ControlNet {name!r} is not served here" + (
        f" ({len(by_last)} match its name: give the path)" if by_last else "") + f"; served: {known}", param=field)


def thresholds(module: str, a: Any, b: Any) -> tuple[Any, Any]:
    """canny's (low, high) as the extension reads `threshold_a` / `threshold_b`: a number outside its slider's range
    (-1 among others) takes the slider's default, logged in the extension's words unless it is -1 (the "unset" its
    clients send); a value that is not a number is left for the request's check (a 400). `module`: as sent."""
    out = []
    for param, value, (default, lo, hi) in zip(("threshold_a", "threshold_b"), (a, b), CANNY_SLIDERS):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is None or number and not lo <= value <= hi:
            if number and value != -1:
                logger.info("[%s.%s] Invalid value(%s), using default value %s.", module, param, float(value),
                            default)
            value = default
        out.append(value)
    return out[0], out[1]


def ignored_keys(units: list[dict[str, Any]]) -> list[str]:
    """The keys of the units that are neither taken nor known (`alwayson_scripts.controlnet.args[i].KEY`)."""
    return [f"alwayson_scripts.controlnet.args[{i}].{key}" for i, unit in enumerate(units) for key in unit
            if key not in TAKEN and key not in IGNORED]


def units_to_controls(units: list[dict[str, Any]], served: Callable[[], list[str]], max_bytes: int,
                      max_pixels: int, init_image: str | None = None) -> list[dict[str, Any]]:
    """The units as GenerationRequest controls (their images decoded; the ranges are `create`'s to check).
    `init_image`: an img2img request's first init image (base64), the image of a unit that has none."""
    out = []
    names = served() if units else []
    for i, unit in enumerate(units):
        field = f"alwayson_scripts.controlnet.args[{i}]"
        image = unit.get("input_image", unit.get("image"))
        if unit.get("mask") or isinstance(image, dict) and image.get("mask"):
            raise APIError(400, f"{field}.mask: masked control images are not supported; send the image alone",
                           param=f"{field}.mask")
        if isinstance(image, dict):
            image = image.get("image")
        image_field = f"{field}.input_image"
        if not image and init_image:
            image, image_field = init_image, "init_images[0]"
        if not isinstance(image, str) or not image:
            raise APIError(400, f"{field}.input_image: a unit needs its control image (base64; on img2img the init "
                                "image is taken)", param=f"{field}.input_image")
        module = unit.get("module", "none")
        if not isinstance(module, str) or module not in MODULES:  # a list or object: a 400, not a TypeError
            raise APIError(400, f"{field}.module: preprocessor {module!r} is not available here (its estimator's "
                                "weights cannot be fetched); send its map with module \"none\", or use "
                                f"{', '.join(repr(m) for m in MODULES)}", param=f"{field}.module")
        control = {"model": model_name(unit.get("model"), names, f"{field}.model"),
                   "image": eight_bit(decode_b64(image_field, image, max_bytes, max_pixels)).convert("RGB"),
                   "scale": unit.get("weight", 1.0), "start": unit.get("guidance_start", 0.0),
                   "end": unit.get("guidance_end", 1.0), "preprocess": MODULES[module],
                   "resize_mode": unit.get("resize_mode", "Crop and Resize"),
                   "control_mode": "control" if unit.get("guessmode") is True else
                   unit.get("control_mode", "Balanced")}
        if MODULES[module] == "canny":
            low, high = thresholds(module, unit.get("threshold_a"), unit.get("threshold_b"))
            control.update(canny_low=low, canny_high=high)
        out.append(control)
    return out


def saves_map(unit: dict[str, Any]) -> bool:
    """Whether the unit's detected map joins the answer's images (`save_detected_map`, the extension's default
    true; a false value as pydantic reads one: false, 0, "false", "no", "off" ...)."""
    value = unit.get("save_detected_map", True)
    return not (value.strip().lower() if isinstance(value, str) else value) in _FALSE


def detected_maps(controls: Sequence[ControlInput], saved: Sequence[bool],
                  sizes: Sequence[tuple[int, int]]) -> list[str]:
    """The detected maps (base64 PNGs) of the controls whose unit saves its map: each through its preprocessor and
    fitted to each of `sizes` (width, height) by its resize mode, unit by unit, as the extension appends them."""
    from PIL import Image

    from ..control_maps import control_map, fit_map
    out = []
    for control, save in zip(controls, saved):
        if not save:
            continue
        pixels = control_map(control)
        for width, height in sizes:
            buffer = io.BytesIO()
            Image.fromarray(fit_map(pixels, width, height, control.resize_mode)).save(buffer, format="PNG")
            out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out
