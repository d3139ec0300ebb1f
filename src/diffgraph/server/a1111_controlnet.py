"""AUTOMATIC1111's ControlNet extension on /sdapi/v1 (issue 32): its units in `alwayson_scripts.controlnet.args`
become the request's `controls`, and its listing routes answer (`GET /controlnet/model_list`, `/controlnet/
module_list`, `/controlnet/version`), so its clients work unchanged against the server's ControlNets.

A unit (the extension's API fields): `input_image` (or `image`; base64, or {"image": ...}), `model` (its name as the
extension lists it, "name [hash]": the name is matched against the served ControlNets' names, then against their
last path component when that is unique), `module` ("none", "canny", "invert (from white bg & black line)"; other
preprocessors need their estimator's weights: send their map with module "none"), `weight` (the scale),
`guidance_start` / `guidance_end`, `resize_mode` and `control_mode` (labels or indices; the extension's defaults
"Crop and Resize" and "Balanced"), `threshold_a` / `threshold_b` (canny's thresholds; -1: 100 / 200), `enabled`,
and `mask` (refused when set). Accepted and without effect here: `processor_res` and `pixel_perfect` (the
preprocessor runs at the image's own resolution), `lowvram` / `low_vram`, `save_detected_map`, `hr_option` (no hires
pass), `input_mode`, `batch_images`.
`guessmode: true` (the extension's old field) is control mode "ControlNet is more important". Anything else is a
400 naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from .protocol import APIError
from .uploads import decode_b64, eight_bit

MODULES = {"none": "none", "canny": "canny", "invert": "invert", "invert (from white bg & black line)": "invert"}
IGNORED = ("processor_res", "pixel_perfect", "lowvram", "low_vram", "save_detected_map", "hr_option", "input_mode",
           "batch_images", "enabled", "is_ui", "loopback")
TAKEN = ("input_image", "image", "mask", "model", "module", "weight", "guidance_start", "guidance_end", "resize_mode",
         "control_mode", "threshold_a", "threshold_b", "guessmode")
_HASH = re.compile(r"\s*\[[0-9a-fA-F]+\]\s*$")


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


def units_to_controls(units: list[dict[str, Any]], served: Callable[[], list[str]], max_bytes: int,
                      max_pixels: int) -> list[dict[str, Any]]:
    """The units as GenerationRequest controls (their images decoded; the ranges are `create`'s to check)."""
    out = []
    names = served() if units else []
    for i, unit in enumerate(units):
        field = f"alwayson_scripts.controlnet.args[{i}]"
        unknown = sorted(set(unit) - set(TAKEN) - set(IGNORED))
        if unknown:
            raise APIError(400, f"{field}.{unknown[0]}: not supported here; the unit fields taken: "
                                f"{', '.join(TAKEN)}", param=f"{field}.{unknown[0]}")
        image = unit.get("input_image", unit.get("image"))
        if unit.get("mask") or isinstance(image, dict) and image.get("mask"):
            raise APIError(400, f"{field}.mask: masked control images are not supported; send the image alone",
                           param=f"{field}.mask")
        if isinstance(image, dict):
            image = image.get("image")
        if not isinstance(image, str) or not image:
            raise APIError(400, f"{field}.input_image: a unit needs its control image (base64)",
                           param=f"{field}.input_image")
        module = unit.get("module", "none")
        if not isinstance(module, str) or module not in MODULES:  # a list or object: a 400, not a TypeError
            raise APIError(400, f"{field}.module: preprocessor {module!r} is not available here (its estimator's "
                                "weights cannot be fetched); send its map with module \"none\", or use "
                                f"{', '.join(repr(m) for m in MODULES)}", param=f"{field}.module")
        low, high = unit.get("threshold_a", -1), unit.get("threshold_b", -1)
        control = {"model": model_name(unit.get("model"), names, f"{field}.model"),
                   "image": eight_bit(decode_b64(f"{field}.input_image", image, max_bytes, max_pixels)).convert("RGB"),
                   "scale": unit.get("weight", 1.0), "start": unit.get("guidance_start", 0.0),
                   "end": unit.get("guidance_end", 1.0), "preprocess": MODULES[module],
                   "resize_mode": unit.get("resize_mode", "Crop and Resize"),
                   "control_mode": "control" if unit.get("guessmode") is True else
                   unit.get("control_mode", "Balanced")}
        if MODULES[module] == "canny":
            control.update(canny_low=100 if low in (-1, None) else low, canny_high=200 if high in (-1, None) else high)
        out.append(control)
    return out
