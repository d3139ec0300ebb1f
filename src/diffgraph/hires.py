"""AUTOMATIC1111's hires fix below the server: a text-to-image request's images taken to a larger size by a second
request to the same engine (so it batches with whatever else runs), as its StableDiffusionProcessingTxt2Img does.

The first pass runs at the request's size; its final latents (`return_latents`) are resized by
torch.nn.functional.interpolate in one of the `LATENT_MODES`, or its image by an upscaler (`upscalers.UPSCALERS`, or
a model of `upscalers.ModelUpscalers`),
to the target size (`hires_size`: the request's size times a scale, or a size, centre-cropped where its aspect
differs); the second pass is image-to-image from those latents (`EditInput.latents`) or that image, with the same
seed, running `steps` steps of a schedule of steps / strength (AUTOMATIC1111's setup_img2img_steps when the steps
are given: `second_pass_steps`). Its prompts, sampler and schedule are a template request's (`second_pass`: by
default the first pass's). `generate_hires` runs both on an `Engine`; the AUTOMATIC1111 routes submit each image's
second pass as its first finishes (server/a1111_hires.py).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .errors import ParamError
from .request import MAX_SIZE, MIN_SIZE, EditInput, GenerationRequest, GenerationResult
from .sampling.schedules import MAX_STEPS
from .upscalers import UPSCALERS, ModelUpscalers, UpscalerError, resize_to

# AUTOMATIC1111's latent upscale modes (shared.latent_upscale_modes): interpolate's mode and antialias
LATENT_MODES = {"Latent": ("bilinear", False), "Latent (antialiased)": ("bilinear", True),
                "Latent (bicubic)": ("bicubic", False), "Latent (bicubic antialiased)": ("bicubic", True),
                "Latent (nearest)": ("nearest", False), "Latent (nearest-exact)": ("nearest-exact", False)}
HIRES_UPSCALERS = (*LATENT_MODES, *UPSCALERS)
DEFAULT_UPSCALER = "Latent"  # AUTOMATIC1111's latent_upscale_default_mode, for an hr_upscaler left out
DEFAULT_STRENGTH = 0.7       # its web UI's hires denoising strength
LATENT_GRID = 8              # pixels per latent cell (every family's VAE here)


@dataclass(frozen=True)
class HiresFix:
    """The second pass's size and start: `width` x `height` (a multiple of the family's size multiple), reached by
    resizing to `cover` (width, height) and cutting its centre (the same size where the aspect is kept), with the
    upscaler `upscaler` (a LATENT_MODES or UPSCALERS name, or a model upscaler's, checked where it runs); `strength`
    and `steps` (0: the first pass's) as
    AUTOMATIC1111's denoising_strength and hr_second_pass_steps."""

    width: int
    height: int
    upscaler: str = DEFAULT_UPSCALER
    strength: float = DEFAULT_STRENGTH
    steps: int = 0
    cover: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.upscaler, str) or not self.upscaler.strip():
            raise ParamError("hr_upscaler", f"hr_upscaler {self.upscaler!r} is not an upscaler's name; send one of "
                                            f"{', '.join(HIRES_UPSCALERS)} or a model upscaler's")
        if self.cover is None:
            object.__setattr__(self, "cover", (self.width, self.height))

    @property
    def latent(self) -> bool:
        """Whether it resizes the first pass's latents (else its decoded image)."""
        return self.upscaler in LATENT_MODES


def hires_size(width: int, height: int, scale: float, resize_x: int, resize_y: int,
               multiple: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the second pass's size, the size resized to before its centre is cut), as AUTOMATIC1111's
    calculate_target_resolution: `scale` times the first pass's size where no resize is given; one side given: the
    other keeps the aspect; both: the image resized to cover them, then cut to them (its latent truncation). Each
    rounded down to `multiple` (the family's size multiple)."""
    if not resize_x and not resize_y:
        cover = target = (int(width * scale), int(height * scale))
    elif not resize_y:
        cover = target = (resize_x, resize_x * height // width)
    elif not resize_x:
        cover = target = (resize_y * width // height, resize_y)
    else:
        target = (resize_x, resize_y)
        cover = ((resize_x, resize_x * height // width) if width / height < resize_x / resize_y
                 else (resize_y * width // height, resize_y))
    down = [c // multiple * multiple for c in cover]
    # AUTOMATIC1111 cuts whole latent cells: (cover - target) // 8 of them, the odd one off the far side
    kept = [min(d, (c - (c - t) // LATENT_GRID * LATENT_GRID) // multiple * multiple)
            for c, t, d in zip(cover, target, down)]
    return (kept[0], kept[1]), (down[0], down[1])


def builtin_upscaler(name: str | None) -> str | None:
    """The latent mode or built-in upscaler `name` names, in any case (None: the default, "Latent"); None where it
    names neither (a model upscaler's name, looked up in its folder by the caller)."""
    wanted = (name or DEFAULT_UPSCALER).strip().lower()
    return next((known for known in HIRES_UPSCALERS if known.lower() == wanted), None)


def plan_fix(width: int, height: int, multiple: int, scale: float | None = None,
             resize: tuple[int, int] | None = None, upscaler: str | None = None, strength: float | None = None,
             steps: int | None = None, first_steps: int = 0, rule: str = "sd") -> tuple[HiresFix, dict[str, Any]]:
    """(the hires fix of a `width` x `height` first pass of `first_steps` steps, its infotext entries) from
    AUTOMATIC1111's hires settings: `scale` (2 where neither it nor `resize` is given) or `resize` (width, height; 0
    keeps the aspect), a built-in `upscaler` (default Latent), `strength` (default DEFAULT_STRENGTH) and `steps` (0 or
    None: the first pass's). ParamError naming hires_scale, hr_upscaler, denoising_strength or hires_steps."""
    name = builtin_upscaler(upscaler)
    if name is None:
        raise ParamError("hr_upscaler", f"hr_upscaler {upscaler!r} is not a built-in upscaler; use one of "
                                        f"{', '.join(HIRES_UPSCALERS)}")
    strength = DEFAULT_STRENGTH if strength is None else float(strength)
    if not 0 < strength <= 1:
        raise ParamError("denoising_strength", f"denoising_strength {strength:g} is out of range; the hires pass "
                                               "takes a number in (0, 1]")
    if not 0 <= (steps or 0) <= MAX_STEPS:
        raise ParamError("hires_steps", f"hires_steps {steps} is out of range; allowed: 0 (the first pass's) .. "
                                        f"{MAX_STEPS}")
    second_pass_steps(steps or first_steps or 1, strength, rule)
    rx, ry = resize or (0, 0)
    scale = 2.0 if scale is None and not resize else scale
    if not resize and not scale > 1:
        raise ParamError("hires_scale", f"hires_scale {scale:g} does not enlarge the image; give a scale above 1")
    size, cover = hires_size(width, height, scale or 0, rx, ry, multiple)
    if min(size) < MIN_SIZE or max(*size, *cover) > MAX_SIZE:
        raise ParamError("hires_scale", f"hires_scale makes a {size[0]}x{size[1]} second pass (resized from "
                                        f"{cover[0]}x{cover[1]}); sides must be {MIN_SIZE}..{MAX_SIZE} pixels")
    fix = HiresFix(size[0], size[1], name, strength, steps or 0, cover)
    return fix, hires_params(fix, scale, resize, steps, upscaler)


def second_pass_steps(steps: int, strength: float, rule: str = "sd") -> tuple[int, float]:
    """(the schedule's steps, the strength that runs its last `steps` by the family's edit rule `rule`): AUTOMATIC1111
    runs the hires pass's steps of a schedule of int(steps / min(strength, 0.999)) (setup_img2img_steps with the
    steps given). ParamError naming denoising_strength where that schedule is longer than MAX_STEPS."""
    total = max(int(steps / min(strength, 0.999)), steps)
    if total > MAX_STEPS:
        raise ParamError("denoising_strength", f"denoising_strength {strength:g} with {steps} hires steps makes a "
                                               f"{total}-step schedule; at most {MAX_STEPS}: raise denoising_strength "
                                               "or lower hr_second_pass_steps")
    for candidate in (steps / total, (steps + 0.5) / total, (steps - 0.5) / total):
        candidate = min(candidate, 1.0)
        if EditInput.denoising_steps(SimpleNamespace(strength=candidate, steps_rule=rule), total) == steps:
            return total, candidate
    return total, min(steps / total, 1.0)


def first_pass(request: GenerationRequest, fix: HiresFix) -> GenerationRequest:
    """The first pass of `request`: itself, returning its latents where the fix resizes them."""
    return dataclasses.replace(request, return_latents=fix.latent) if fix.latent else request


def upscale_latents(latents: np.ndarray, fix: HiresFix) -> np.ndarray:
    """One image's latents [C, h, w] resized to the fix's cover size by its latent mode, then centre-cut to its size."""
    import torch

    mode, antialias = LATENT_MODES[fix.upscaler]
    (cw, ch), f = fix.cover, LATENT_GRID
    grown = torch.nn.functional.interpolate(torch.from_numpy(latents)[None], size=(ch // f, cw // f), mode=mode,
                                            antialias=antialias)[0]
    top, left = _cut(ch // f, fix.height // f), _cut(cw // f, fix.width // f)
    return np.ascontiguousarray(grown[:, top:top + fix.height // f, left:left + fix.width // f].numpy(), np.float32)


def upscale_image(pixels: np.ndarray, fix: HiresFix, models: ModelUpscalers | None = None) -> np.ndarray:
    """One image's uint8 RGB pixels [H, W, 3] resized to the fix's cover size by its upscaler (a built-in, or one of
    `models`), then centre-cut to its size (whole latent cells, as the latents are). ParamError naming hr_upscaler
    where its model cannot be used."""
    from PIL import Image

    try:
        grown = resize_to(Image.fromarray(pixels), fix.upscaler, *fix.cover, models)
    except UpscalerError as e:
        raise ParamError("hr_upscaler", f"hr_upscaler: {e}") from None
    f = LATENT_GRID
    top, left = _cut(fix.cover[1] // f, fix.height // f) * f, _cut(fix.cover[0] // f, fix.width // f) * f
    return np.ascontiguousarray(np.asarray(grown.convert("RGB"))[top:top + fix.height, left:left + fix.width])


def _cut(cells: int, kept: int) -> int:
    """The cells cut off the near side when `kept` of `cells` are kept (AUTOMATIC1111: half, the odd one far)."""
    return (cells - kept) // 2


def second_pass(template: GenerationRequest, result: GenerationResult, fix: HiresFix, row: int = 0,
                rule: str = "sd", models: ModelUpscalers | None = None) -> GenerationRequest:
    """The second pass of row `row` of the first pass's `result`: `template` (its prompts, sampler, schedule and
    guidance, and its steps where the fix names none; the first pass's request for the same) at the fix's size from
    the resized latents or image, with the first pass's seed (and variation seed, not resized); `rule` the family's edit steps rule
    (`ModelInfo.edit_steps_rule`); `models` the model upscalers the fix may name."""
    first = result.request
    total, strength = second_pass_steps(fix.steps or template.num_inference_steps, fix.strength, rule)
    if fix.latent:
        if result.latents is None:
            raise ParamError("hr_upscaler", "a latent upscale needs the first pass's latents: submit it with "
                                            "return_latents (hires.first_pass)")
        edit = EditInput(None, strength=strength, steps_rule=rule, latents=upscale_latents(result.latents[row], fix))
    else:
        pixels = np.asarray(result.images[row].convert("RGB")) if result.arrays is None else \
            (result.arrays[row] * 255).round().astype(np.uint8)
        edit = EditInput(upscale_image(pixels, fix, models), strength=strength, steps_rule=rule)
    variation = first.variation  # AUTOMATIC1111's second pass: the image's variation seed, its noise not resized
    if variation is not None:
        variation = dataclasses.replace(variation, resize_from=None) if variation.strength else None
    return dataclasses.replace(template, width=fix.width, height=fix.height, num_inference_steps=total,
                               seed=first.seed, num_images=1, edit=edit, return_latents=False, variation=variation,
                               hires_of=first.num_inference_steps,
                               request_id=f"{first.request_id}-hr-{secrets.token_hex(4)}")


def hires_params(fix: HiresFix, scale: float | None, resize: tuple[int, int] | None,
                 steps: int | None, upscaler: str | None) -> dict[str, Any]:
    """The infotext entries AUTOMATIC1111 writes for a hires fix: "Denoising strength", then "Hires upscale" (or
    "Hires resize" where a size was given), "Hires steps" (where given) and "Hires upscaler" (where named)."""
    out: dict[str, Any] = {"Denoising strength": fix.strength}
    out.update({"Hires resize": f"{resize[0]}x{resize[1]}"} if resize else {"Hires upscale": scale})
    out.update({"Hires steps": steps} if steps else {})
    out.update({"Hires upscaler": upscaler} if upscaler is not None else {})
    return out


def generate_hires(engine: Any, request: GenerationRequest, fix: HiresFix, template: GenerationRequest | None = None,
                   models: ModelUpscalers | None = None) -> list[GenerationResult]:
    """Both passes of `request` on `engine` (an `Engine`): the first pass, then each of its images' second pass (its
    prompts, sampler and steps `template`'s, by default the first pass's), submitted together. One result per
    image; each second pass draws from the request's seed (AUTOMATIC1111's images are one request each, seed + i:
    send them as such for their own noise)."""
    first = engine.run(first_pass(request, fix))
    rule = engine.info.edit_steps_rule
    handles = [engine.submit(second_pass(template or request, first, fix, row, rule, models))
               for row in range(len(first))]
    return [handle.result() for handle in handles]
