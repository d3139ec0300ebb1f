"""Generation requests (validated once), progress events, results, and the errors an engine answers with.

This is the one request object from validation to delivery: the HTTP edge, the CLI and the Python facade
build a `GenerationRequest` (`create(...)` draws a seed and applies the model's defaults; every construction,
`dataclasses.replace` included, is checked), the scheduler wraps it in its per-request state, and the result
carries it back. Every parameter error is a `ParamError(ValueError)` whose `param` names the parameter as
spelled here, so the HTTP layer maps it to its body field and the CLI to its flag without re-checking.
Everything here is plain picklable data (no tensors, no futures), so requests, events and results can cross
a process boundary unchanged. Sizes are (height, width) inside; "WxH" strings exist only at the edges.
"""

from __future__ import annotations

import math
import re
import secrets
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ParamError
from .sampling.names import CFGPP_SAMPLERS, DEFAULT_SAMPLER, DEFAULT_SCHEDULE, SAMPLERS, SCHEDULES, TIMESTEP_SPACINGS
from .sampling.aliases import canonical, closest
from .sampling.schedules import MAX_STEPS

Size = tuple[int, int]  # (height, width) in pixels: a request's image
# the group a request's rows run in (step buffers, steps, graphs), chosen by the model's family from the size: a pair
# of ints, the size itself for UNet families, (0, image tokens) for a transformer family's token bucket; a UNet's
# tiling rows (`GenerationRequest.tiling`) run in (height, width, TILING): their own group, graphs and decodes. The
# first two entries are the resolution the family reads and the graphs are addressed by (`key[:2]`)
GroupKey = tuple
TILING = "tiling"
MIN_SIZE = 64
MAX_SIZE = 2048
DEFAULT_STEPS = 20       # the steps of a request that names none, on a model without a checkpoint default
SIZE_MULTIPLE = 8        # every request's sizes (an SD VAE's latent grid); a family may ask for more (size_multiple)
MAX_IMAGES = 16
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
MAX_LORAS = 16           # adapters one request may stack on any engine (its own limit: --max-request-loras)
MAX_LORA_SCALE = 8.0
OUTPUT_FORMATS = ("png", "jpeg", "webp")
PROMPT_SYNTAXES = ("plain", "a1111")  # diffusers' plain text (truncated at 77 tokens); AUTOMATIC1111's syntax
EMPHASES = ("original", "no_norm")    # AUTOMATIC1111's emphasis modes: weights then mean restored, or weights only
PRIORITIES = ("interactive", "batch")     # scheduling classes: people first, job items in what they leave free
MAX_CLIP_SKIP = 11                    # CLIP ViT-L has 12 layers (the model's own count is checked at submit)
MAX_PROMPT_CHARS = 20_000
_HASH = re.compile(r"[0-9a-fA-F]{1,64}")  # a file hash as an infotext shows it
MAX_PROMPT_CHUNKS = 4                 # the buffers hold lcm(1..max) windows per row: 12 at 4, 60 at 5 or 6


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests; the caller should retry later (HTTP 429)."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished."""


class EngineStepError(RuntimeError):
    """A denoising step (or the decode) failed; every request of that batch gets this error."""


class EngineClosed(RuntimeError):
    """The engine is closed, or its loop stopped after an internal error: it takes no new requests."""


def _new_id() -> str:
    return f"req-{secrets.token_hex(8)}"


def _nearest_multiples(value: int, base: int = SIZE_MULTIPLE) -> str:
    """The valid sizes next to `value`: multiples of `base` inside MIN_SIZE..MAX_SIZE."""
    low = min(max((value // base) * base, MIN_SIZE), MAX_SIZE)
    high = min(low + base, MAX_SIZE)
    return f"{low} or {high}" if MIN_SIZE <= value <= MAX_SIZE and high != low else f"{low}"


def _show(value: Any) -> str:
    """A value for an error message: short, and safe for integers too long for str()."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and abs(int(value)).bit_length() > 80:
        digits = int(abs(int(value)).bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}(an integer of about {digits} digits)"
    text = str(value) if isinstance(value, (int, float, np.integer, np.floating)) else repr(value)
    return text if len(text) <= 24 else f"{text[:20]}..."


def _check_size(name: str, value: Any, base: int = SIZE_MULTIPLE) -> int:
    """A width or height: an integer in MIN_SIZE..MAX_SIZE, a multiple of `base` (a family's size multiple)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ParamError(name, f"{name} must be an integer number of pixels, got {_show(value)}")
    value = int(value)
    if not MIN_SIZE - base < value < MAX_SIZE + base:
        raise ParamError(name, f"{name} {_show(value)} is outside the supported range {MIN_SIZE}..{MAX_SIZE} "
                               f"(multiples of {base})")
    if value % base:
        raise ParamError(name, f"{name} {value} is not a multiple of {base}; use {_nearest_multiples(value, base)}")
    if not MIN_SIZE <= value <= MAX_SIZE:
        raise ParamError(name, f"{name} {value} is outside the supported range {MIN_SIZE}..{MAX_SIZE} "
                               f"(multiples of {base})")
    return value


def check_family_params(sampler: str, schedule: str, key: GroupKey, samplers: tuple[str, ...] = SAMPLERS,
                        schedules: tuple[str, ...] = SCHEDULES, size_multiple: int = SIZE_MULTIPLE,
                        family: str | None = None) -> None:
    """What a model family takes: one of its samplers and schedules, sizes in multiples of its size multiple.
    A ParamError names the parameter and lists what the family allows. The family adapter checks with its own
    lists (`FamilyAdapter.check`), a request built for a model with its `ModelInfo`'s, and one built without a model
    with the built-in families' (sampling/names.py)."""
    whose = f" (the {{}} of model family {family!r})" if family else ""
    if sampler not in samplers:
        raise ParamError("sampler", f"sampler {_show(sampler)} is unknown; allowed: {', '.join(samplers)}"
                                    + whose.format("samplers") + closest(sampler, samplers))
    if schedule not in schedules:
        raise ParamError("schedule", f"schedule {_show(schedule)} is unknown; allowed: {', '.join(schedules)}"
                                     + whose.format("schedules") + closest(schedule, schedules))
    for name, value in (("width", key[1]), ("height", key[0])):
        _check_size(name, value, size_multiple)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ParamError(name, f"{name} must be an integer in {low}..{high}, got {_show(value)}")
    if not low <= int(value) <= high:
        raise ParamError(name, f"{name} {_show(value)} is out of range; allowed: {low}..{high}")
    return int(value)


MAX_EDIT_PIXELS = 16 * 1024 * 1024  # an edit's input image, decoded (the server's --max-image-pixels default)
# how diffusers' image-to-image pipelines turn (steps, strength) into the steps run: "sd" (the SD pipelines:
# int(steps * strength)) or "flow" (the flow-matching ones, Flux's and Z-Image's: steps - int(steps - steps * strength))
EDIT_STEP_RULES = ("sd", "flow")


@dataclass(frozen=True, eq=False)
class EditInput:
    """The image of an image-to-image or inpainting request: RGB pixels [H, W, 3] uint8, and for inpainting a mask
    [H, W] uint8 of the same size (diffusers' convention: white, 255, = repaint; it is binarized at 0.5). Or, instead
    of the image, its `latents`: the model's image latents [C, h, w] float32 (a `GenerationResult.latents` row, resized:
    the hires fix's latent upscale), noised from the request's seed as an image's encoded latents are; the engine
    checks their shape against the request's size. Checked on construction; plain numpy, so it crosses process
    boundaries with the request."""

    image: np.ndarray | None
    mask: np.ndarray | None = None
    strength: float = 0.8
    steps_rule: str = "sd"  # EDIT_STEP_RULES: the model family's (GenerationRequest.create sets it)
    latents: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.latents is not None:
            self._check_latents()
        else:
            self._check_image()
        st = self.strength
        if isinstance(st, bool) or not isinstance(st, (int, float, np.floating, np.integer)) \
                or not 0 < float(st) <= 1:  # NaN fails this too
            raise ParamError("strength", f"strength {_show(st)} is out of range; allowed: a number in (0, 1]")
        object.__setattr__(self, "strength", float(st))

    def _check_latents(self) -> None:
        lat = self.latents
        if self.image is not None or self.mask is not None:
            raise ParamError("image", "an edit takes an image (and a mask) or latents, not both; give one")
        if not isinstance(lat, np.ndarray) or lat.dtype != np.float32 or lat.ndim != 3:
            raise ParamError("latents", "latents must be a float32 array of shape (channels, height / 8, width / 8) "
                                        "(a GenerationResult.latents row)")
        if lat.size > MAX_EDIT_PIXELS or not np.isfinite(lat).all():
            raise ParamError("latents", f"latents must be finite and hold at most {MAX_EDIT_PIXELS} values, got "
                                        f"shape {lat.shape}")

    def _check_image(self) -> None:
        img = self.image
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise ParamError("image", "image must be RGB pixels: a uint8 array of shape (height, width, 3) "
                                      "(PIL: np.asarray(image.convert('RGB')))")
        h, w = img.shape[:2]
        if min(h, w) < MIN_SIZE or h * w > MAX_EDIT_PIXELS:
            raise ParamError("image", f"image is {w}x{h}; each side must be at least {MIN_SIZE} pixels and the "
                                      f"image at most {MAX_EDIT_PIXELS // 2**20} megapixels")
        if self.mask is not None:
            m = self.mask
            if not isinstance(m, np.ndarray) or m.dtype != np.uint8 or m.ndim != 2:
                raise ParamError("mask", "mask must be a uint8 array of shape (height, width), white = repaint")
            if m.shape != (h, w):
                raise ParamError("mask", f"mask is {m.shape[1]}x{m.shape[0]} but the image is {w}x{h}; "
                                         "give a mask of the image's size")

    @property
    def inpaint(self) -> bool:
        return self.mask is not None

    def denoising_steps(self, steps: int) -> int:
        """The steps of a `steps`-step schedule this edit runs (its last ones), by its family's rule."""
        if self.steps_rule == "flow":
            return steps - int(max(steps - steps * self.strength, 0))
        return min(int(steps * self.strength), steps)


# -- ControlNet controls: which ControlNet, its control image, its scale and window ----------------
MAX_CONTROLS = 3
MAX_CONTROL_SCALE = 5.0
MAX_CONTROL_PIXELS = 16 * 1024 * 1024  # a control image, decoded (as an edit's image)
CONTROL_PREPROCESSORS = ("none", "canny", "invert")
CONTROL_FIELDS = ("model", "image", "scale", "start", "end", "preprocess", "canny_low", "canny_high", "resize_mode",
                  "control_mode")
# AUTOMATIC1111's ControlNet names (its API sends the labels or their indices) -> ours
RESIZE_MODES = {"just_resize": ("Just Resize", 0), "crop_and_resize": ("Crop and Resize", 1),
                "resize_and_fill": ("Resize and Fill", 2)}
CONTROL_MODES = {"balanced": ("Balanced", 0), "prompt": ("My prompt is more important", 1),
                 "control": ("ControlNet is more important", 2)}


def _control_mode(name: str, value: Any, modes: dict[str, tuple[str, int]]) -> str:
    for ours, (label, index) in modes.items():
        if value == ours or (isinstance(value, str) and value.strip().lower() == label.lower()) or (
                isinstance(value, int) and not isinstance(value, bool) and value == index):
            return ours
    raise ParamError("controls", f"control {name} {value!r} is unknown; allowed: {', '.join(modes)} (or "
                                 f"AUTOMATIC1111's {', '.join(repr(label) for label, _ in modes.values())})")


def _control_number(name: str, value: Any, lo: float, hi: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(value)) or not lo <= float(value) <= hi:
        raise ParamError("controls", f"{name} {value!r} is out of range; allowed: {what}")
    return float(value)


@dataclass(frozen=True, eq=False)
class ControlInput:
    """One control of a request, checked on construction (plain numpy: it crosses processes with the request):
    `model` (a name under `--controlnet-dir`), `image` (the control map itself, RGB [H, W, 3] uint8 or a PIL image:
    an edge map, a depth or pose map), `scale` (diffusers' `controlnet_conditioning_scale`), `start` and `end`
    (`control_guidance_start` / `control_guidance_end`: the fractions of the schedule where it runs), and
    `preprocess`: what makes the control map from `image` at submit ("none": it is the map; "canny": OpenCV's Canny
    edges with thresholds `canny_low` / `canny_high`, AUTOMATIC1111's defaults 100 / 200, a low above the high taken as
    OpenCV takes it, swapped, as AUTOMATIC1111's ControlNet extension passes it on; "invert": 255 - pixels,
    for black-on-white line art). `resize_mode`, AUTOMATIC1111's: "just_resize" (to the output size, as diffusers'
    pipelines), "crop_and_resize" (covering it, centre-cropped), "resize_and_fill" (inside it, centred on the median
    of the map's border). `control_mode`, AUTOMATIC1111's: "balanced" (diffusers' default), "prompt" ("My prompt is
    more important": residual i of R scaled by 10^((i + 1 - R) / (R - 1)), diffusers' guess-mode scales, in both
    guidance branches) and "control" ("ControlNet is more important": diffusers' `guess_mode=True`, those scales in
    the conditional branch only)."""

    model: str
    image: np.ndarray
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    preprocess: str = "none"
    canny_low: int = 100
    canny_high: int = 200
    resize_mode: str = "just_resize"
    control_mode: str = "balanced"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ParamError("controls", "a control needs its ControlNet's name (model); GET /v1/controlnets lists "
                                         "them")
        img = self.image
        if hasattr(img, "convert") and hasattr(img, "size"):  # a PIL image, as diffusers' processor converts it
            img = np.asarray(img.convert("RGB"))
            object.__setattr__(self, "image", img)
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            raise ParamError("controls", "a control image must be RGB pixels: a PIL image or a uint8 array of shape "
                                         "(height, width, 3)")
        h, w = img.shape[:2]
        if min(h, w) < 8 or h * w > MAX_CONTROL_PIXELS:
            raise ParamError("controls", f"control image is {w}x{h}; each side must be at least 8 pixels and the "
                                         f"image at most {MAX_CONTROL_PIXELS // 2**20} megapixels")
        object.__setattr__(self, "scale", _control_number("controls.scale", self.scale, 0.0, MAX_CONTROL_SCALE,
                                                  f"a number in [0, {MAX_CONTROL_SCALE:g}]"))
        start = _control_number("controls.start", self.start, 0.0, 1.0, "a fraction in [0, 1)")
        end = _control_number("controls.end", self.end, 0.0, 1.0, "a fraction in (0, 1]")
        if start >= end:
            raise ParamError("controls", f"control start {start:g} must be below its end {end:g} (fractions of the "
                                         "schedule)")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        if self.preprocess not in CONTROL_PREPROCESSORS:
            raise ParamError("controls", f"control preprocess {self.preprocess!r} is unknown; allowed: "
                                         f"{', '.join(CONTROL_PREPROCESSORS)} (depth and pose maps: send the map)")
        low, high = (_control_number(f"controls.canny_{k}", v, 0, 255, "an integer in [0, 255]")
                     for k, v in (("low", self.canny_low), ("high", self.canny_high)))
        object.__setattr__(self, "canny_low", int(low))
        object.__setattr__(self, "canny_high", int(high))
        object.__setattr__(self, "resize_mode", _control_mode("resize_mode", self.resize_mode, RESIZE_MODES))
        object.__setattr__(self, "control_mode", _control_mode("control_mode", self.control_mode, CONTROL_MODES))


MAX_PROMPT_IMAGES = 2
MAX_IMAGE_PROMPT_SCALE = 5.0


@dataclass(frozen=True, eq=False)
class ImagePromptInput:
    """A request's image prompts (IP-Adapter; the request's `image_prompts`), checked on construction:
    `images` (1 or 2 RGB images, PIL or uint8 [H, W, 3]: their tokens are one attention, as diffusers passes several
    images to one adapter), `scale` (diffusers' `set_ip_adapter_scale`; 0: the plain image) and `model` (an
    IP-Adapter's name under `--ip-adapter-dir`; None: the folder's only one)."""

    images: tuple[np.ndarray, ...]
    scale: float = 1.0
    model: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ParamError("image_prompts", "image_prompts.model must be an IP-Adapter's name (GET /v1/ip-adapters), "
                                              "or left out when the server has one")
        images = self.images
        if isinstance(images, np.ndarray) or hasattr(images, "convert"):
            images = (images,)
        if not isinstance(images, (list, tuple)) or not 1 <= len(images) <= MAX_PROMPT_IMAGES:
            raise ParamError("image_prompts", f"an image prompt takes 1 to {MAX_PROMPT_IMAGES} images")
        out = []
        for img in images:
            if hasattr(img, "convert") and hasattr(img, "size"):
                img = np.asarray(img.convert("RGB"))
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
                raise ParamError("image_prompts", "an image prompt's images must be RGB pixels: PIL images or uint8 "
                                                 "arrays of shape (height, width, 3)")
            if min(img.shape[:2]) < 8 or img.shape[0] * img.shape[1] > MAX_CONTROL_PIXELS:
                raise ParamError("image_prompts", f"an image prompt's image is {img.shape[1]}x{img.shape[0]}; each "
                                                 f"side at least 8 pixels, at most {MAX_CONTROL_PIXELS // 2**20} "
                                                 "megapixels")
            out.append(img)
        object.__setattr__(self, "images", tuple(out))
        scale = self.scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(scale)) or not 0 <= float(scale) <= MAX_IMAGE_PROMPT_SCALE:
            raise ParamError("image_prompts", f"image prompt scale {scale!r} is out of range; allowed: a number in "
                                             f"[0, {MAX_IMAGE_PROMPT_SCALE:g}]")
        object.__setattr__(self, "scale", float(scale))


def check_image_prompt(value: Any) -> ImagePromptInput | None:
    if value is None or isinstance(value, ImagePromptInput):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"model", "images", "image", "scale"}
        if unknown:
            raise ParamError("image_prompts", f"unknown image prompt fields {sorted(unknown)}; allowed: model, "
                                             "images (or image), scale")
        value = dict(value)
        if "image" in value:
            value["images"] = (value.pop("image"),) if "images" not in value else value["images"]
        if "images" not in value:
            raise ParamError("image_prompts", "image_prompts needs images (1 or 2), and model where the server has "
                                              "several IP-Adapters")
        return ImagePromptInput(**value)
    raise ParamError("image_prompts", f"image_prompts must be an ImagePromptInput or a dict, got {type(value).__name__}")


def check_controls(value: Any) -> tuple[ControlInput, ...]:
    """A request's controls as a tuple of ControlInput (dicts of its fields accepted); raises ParamError."""
    if value is None:
        return ()
    if isinstance(value, (ControlInput, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ParamError("controls", f"controls must be a list of controls, got {type(value).__name__}")
    if len(value) > MAX_CONTROLS:
        raise ParamError("controls", f"{len(value)} controls given; at most {MAX_CONTROLS} per request")
    out = []
    for c in value:
        if isinstance(c, dict):
            unknown = set(c) - set(CONTROL_FIELDS)
            if unknown:
                raise ParamError("controls", f"unknown control fields {sorted(unknown)}; allowed: "
                                             f"{', '.join(CONTROL_FIELDS)}")
            if "model" not in c or "image" not in c:
                raise ParamError("controls", "a control needs model (a ControlNet's name) and image")
            c = ControlInput(**c)
        elif not isinstance(c, ControlInput):
            raise ParamError("controls", f"a control must be a ControlInput or a dict, got {type(c).__name__}")
        out.append(c)
    return tuple(out)


PREVIEW_FORMATS = ("jpeg", "png", "webp")


@dataclass(frozen=True)
class PreviewSpec:
    """Live previews of a request (engine/previews.py): every `every` steps (denoiser evaluations, as progress
    counts them) a small image of the current denoised prediction in `format`; at most `limit` of them (0: no
    limit). `every` 0 spreads `limit` previews evenly over the evaluations the request runs (OpenAI's
    `partial_images`: an edit's share of the steps, a two-evaluation sampler's 2n - 1)."""

    every: int = 1
    format: str = "jpeg"
    limit: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "every", _check_int("preview.every", self.every, 0, MAX_STEPS))
            object.__setattr__(self, "limit", _check_int("preview.limit", self.limit, 0, MAX_STEPS))
        except ParamError as e:  # the request's field is `preview`; the message names its part
            raise ParamError("preview", str(e)) from None
        if self.every == 0 and self.limit == 0:
            raise ParamError("preview", "preview.every 0 (spread) needs a limit: the number of previews")
        if self.format not in PREVIEW_FORMATS:
            raise ParamError("preview", f"preview format {_show(self.format)} is unknown; allowed: "
                                        f"{', '.join(PREVIEW_FORMATS)}")

    @classmethod
    def partial_images(cls, count: Any, fmt: str = "jpeg") -> "PreviewSpec | None":
        """OpenAI's `partial_images` (0-3): that many previews spread over the request's evaluations."""
        count = _check_int("partial_images", count, 0, 3)
        return cls(every=0, format=fmt, limit=count) if count else None

    def due(self, step: int, total: int) -> bool:
        """Whether the evaluation `step` (1-based) of `total` brings a preview."""
        if self.every == 0:  # the k-th of `limit` previews at k / (limit + 1) of the way, rounded
            return any(step == max(1, math.floor(k * total / (self.limit + 1) + 0.5)) for k in range(1, self.limit + 1))
        return step % self.every == 0 and (self.limit == 0 or step // self.every <= self.limit)


def require_prompt(prompt: str, image: Any = None) -> None:
    """ParamError for an empty prompt without an input `image` (an EditInput, or its pixels), where the caller asks for one (OpenAI's generations
    route, the CLI). A request itself takes an empty prompt, as AUTOMATIC1111 and diffusers do: the image of the empty
    prompt's conditioning."""
    if not prompt.strip() and image is None:
        raise ParamError("prompt", "prompt is empty; describe the image to generate")


@dataclass(frozen=True)
class Variation:
    """AUTOMATIC1111's variation seed: a request's initial noise is slerped `strength` of the way from its seed's
    noise to `subseed`'s (0: the seed's alone, 1: the subseed's). `resize_from` (width, height): both noises are
    drawn at that image size's latent shape and pasted centred into the seed's noise at the request's size
    ("Seed resize from"); None: drawn at the request's size (engine/variation.py)."""

    subseed: int
    strength: float
    resize_from: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "subseed", _check_int("variation.subseed", self.subseed, 0, MAX_SEED))
        strength = self.strength
        if isinstance(strength, bool) or not isinstance(strength, (int, float, np.floating, np.integer)) \
                or not 0 <= float(strength) <= 1:  # NaN fails this too
            raise ParamError("variation.strength", f"variation strength {_show(strength)} is out of range; allowed: "
                                                   "a number in [0, 1] (0: the seed's noise alone)")
        object.__setattr__(self, "strength", float(strength))
        size = self.resize_from
        if size is not None:
            if not isinstance(size, (tuple, list)) or len(size) != 2:
                raise ParamError("variation.resize_from", f"variation resize_from must be (width, height) or None, "
                                                          f"got {_show(size)}")
            size = tuple(_check_int("variation.resize_from", v, 1, MAX_SIZE) for v in size)
        object.__setattr__(self, "resize_from", size)


def make_variation(value: Any) -> Variation | None:
    """A request's `variation` from a Variation, a dict of its fields ({"subseed": 7, "strength": 0.3}) or None."""
    if value is None or isinstance(value, Variation):
        return value
    if not isinstance(value, dict):
        raise ParamError("variation", f"variation must be an object such as {{\"subseed\": 7, \"strength\": 0.3}}, "
                                      f"got {_show(value)}")
    unknown = sorted(set(value) - {"subseed", "strength", "resize_from"})
    if unknown or not {"subseed", "strength"} <= set(value):
        raise ParamError("variation", f"variation needs subseed and strength (and optionally resize_from), got "
                                      f"fields {sorted(value)}")
    return Variation(**value)


def tiling_refusal(family: str) -> str:
    """Why a family without convolutions to pad refuses `tiling` (one line)."""
    return (f"tiling is not supported by model family {family!r}: its denoiser is a transformer over latent tokens, "
            "with no convolutions to pad circularly; send tiling false")


@dataclass(frozen=True)
class GenerationRequest:
    """One user request: `num_images` rows that share prompt, size, sampler and one seeded generator. Its prompt may
    be empty (`require_prompt` is for the callers that ask for one)."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    sampler: str
    schedule: str
    seed: int
    num_images: int
    output_format: str | None = None  # "png" | "jpeg" | "webp": also return encoded bytes
    request_id: str = field(default_factory=_new_id)
    edit: EditInput | None = None     # image-to-image / inpainting input; None: text-to-image
    loras: tuple[tuple[str, float], ...] = ()  # (adapter name, scale) pairs, at most MAX_LORAS
    # classifier-free guidance only for steps i of N with lo <= i / N < hi (Kynkaanniemi et al., 2024); None: all
    guidance_interval: tuple[float, float] | None = None
    guidance_rescale: float = 0.0  # diffusers' rescaled CFG (zero-SNR / v-prediction models), 0 = off
    # how the prompts are read: "plain" (diffusers: 77 tokens, no weights) or "a1111" (AUTOMATIC1111's emphasis,
    # 75-token chunks, BREAK, embeddings by name, <lora:name:scale> tags: text/)
    prompt_syntax: str = "plain"
    clip_skip: int | None = None   # diffusers' numbering: None = the last layer, 1 = the penultimate
    emphasis: str = "original"     # a1111 syntax: "original" restores the chunk's mean after weighting, "no_norm" not
    # the sampler's timestep spacing ("leading", "linspace", "trailing"); None: the model's scheduler config's
    timestep_spacing: str | None = None
    eta: float | None = None       # TCD's gamma or DDIM's eta (stochasticity, 0..1); None: 0.3 / 0, the defaults
    preview: PreviewSpec | None = None  # live previews in its progress events (None: none)
    # the scheduling class: "interactive" rows go first and may take batch rows' slots at a step boundary; "batch"
    # rows (a job's items) fill what interactive rows leave free, shared fairly by `share` (a job's API key), then by
    # `job` within a share
    priority: str = "interactive"
    job: str | None = None
    share: str | None = None
    controls: tuple[ControlInput, ...] = ()  # ControlNet controls (ControlInput), at most MAX_CONTROLS
    image_prompts: ImagePromptInput | None = None  # an IP-Adapter image prompt
    # JPEG / WebP compression, OpenAI's `output_compression`: 0..100 (100: the least), None: the encoder's 95 quality
    output_compression: int | None = None
    # the registered capabilities' parameters (features/capability.py), (name, value) pairs: the engine checks them
    extras: tuple[tuple[str, Any], ...] = ()
    # AUTOMATIC1111's short hashes of the files it uses, written into its images' infotext (`Model hash`, `Lora
    # hashes`): the server fills them where it resolves the files (models/file_hashes.py); None / (): not written
    model_hash: str | None = None
    lora_hashes: tuple[tuple[str, str], ...] = ()  # (an adapter's name as the prompt names it, its short hash)
    # its result also carries its final latents (`GenerationResult.latents`: the hires fix's latent upscale reads them)
    return_latents: bool = False
    # a hires fix's second pass: the first pass's steps, from which its a1111 prompt schedules count (AUTOMATIC1111's
    # rule: a step number counts from the first pass's start, a fraction from 1.0); None: not a second pass
    hires_of: int | None = None
    # AUTOMATIC1111's variation seed (Variation): changes only the initial noise; None: the seed's noise alone
    variation: Variation | None = None
    # AUTOMATIC1111's tiling: every convolution of the denoiser and the VAE pads circularly, so the image wraps
    # around its edges (a seamless texture); its rows run in a group of their own (`TILING` in the group key)
    tiling: bool = False
    # AUTOMATIC1111's eta_noise_seed_delta (ENSD): the noise a sampler draws after the initial noise comes from a
    # generator seeded with seed + this (0: the seed's own generator goes on)
    noise_seed_delta: int = 0
    # its image size, (height, width): derived, a plain attribute (read on every hop); the engine groups rows by the
    # family's key for it (`FamilyAdapter.group_key`)
    key: Size = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Every construction is checked (also `dataclasses.replace` and direct calls), and the numbers are
        stored as plain Python ints and floats."""
        self._check_prompts()
        self._check_sampler_options()
        self._check_handling()
        guidance = self._checked_guidance()
        self._check_names_and_output()
        self._store_checked_numbers(guidance)
        self._check_conditioning()
        self._check_edit()

    def _check_prompts(self) -> None:
        """The prompts (strings of valid text, not too long), how they are read, and the clip skip."""
        prompt, negative_prompt = self.prompt, self.negative_prompt
        if not isinstance(prompt, str):
            raise ParamError("prompt", f"prompt must be a string, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ParamError("negative_prompt",
                             f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt or "")):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ParamError(name, f"{name} is not valid text: it holds an unpaired surrogate at character "
                                       f"{e.start}; send UTF-8 text") from None
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt or "")):
            if len(text) > MAX_PROMPT_CHARS:
                raise ParamError(name, f"{name} has {len(text)} characters; at most {MAX_PROMPT_CHARS}")
        if self.prompt_syntax not in PROMPT_SYNTAXES:
            raise ParamError("prompt_syntax", f"prompt_syntax {_show(self.prompt_syntax)} is unknown; allowed: "
                                              f"{', '.join(PROMPT_SYNTAXES)}")
        if self.emphasis not in EMPHASES:
            raise ParamError("emphasis", f"emphasis {_show(self.emphasis)} is unknown; allowed: {', '.join(EMPHASES)}")
        if self.clip_skip is not None:
            object.__setattr__(self, "clip_skip", _check_int("clip_skip", self.clip_skip, 0, MAX_CLIP_SKIP))

    def _check_sampler_options(self) -> None:
        """The sampler's timestep spacing and noise amount (eta)."""
        if self.timestep_spacing is not None and self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ParamError("timestep_spacing", f"timestep_spacing {_show(self.timestep_spacing)} is unknown; allowed: "
                                                 f"{', '.join(TIMESTEP_SPACINGS)} (or leave it out: the model's own)")
        if self.eta is not None:
            eta = self.eta
            if isinstance(eta, bool) or not isinstance(eta, (int, float, np.floating, np.integer)) \
                    or not 0 <= float(eta) <= 1:  # NaN fails this too
                raise ParamError("eta", f"eta {_show(eta)} is out of range; allowed: a number in [0, 1] (TCD's gamma, "
                                        "DDIM's eta)")
            object.__setattr__(self, "eta", float(eta))

    def _check_handling(self) -> None:
        """How the request is handled: returned latents, priority, its job and share, previews."""
        if not isinstance(self.return_latents, bool):
            raise ParamError("return_latents", f"return_latents must be true or false, got {_show(self.return_latents)}")
        if not isinstance(self.tiling, bool):
            raise ParamError("tiling", f"tiling must be true or false, got {_show(self.tiling)}")
        object.__setattr__(self, "noise_seed_delta", _check_int("noise_seed_delta", self.noise_seed_delta, 0,
                                                                MAX_SEED))
        if self.hires_of is not None and (isinstance(self.hires_of, bool) or not isinstance(self.hires_of, int)
                                          or not 1 <= self.hires_of <= 10_000):
            raise ParamError("hires_of", f"hires_of {_show(self.hires_of)} must be the first pass's steps (1 or more)")
        if self.priority not in PRIORITIES:
            raise ParamError("priority", f"priority {_show(self.priority)} is unknown; allowed: {', '.join(PRIORITIES)}")
        if self.job is not None and (not isinstance(self.job, str) or not self.job):
            raise ParamError("job", f"job must be a non-empty string (a job id) or None, got {_show(self.job)}")
        if self.share is not None and (not isinstance(self.share, str) or not self.share):
            raise ParamError("share", f"share must be a non-empty string (who the job is for) or None, got "
                                      f"{_show(self.share)}")
        if self.preview is not None and not isinstance(self.preview, PreviewSpec):
            raise ParamError("preview", f"preview must be a PreviewSpec, got {type(self.preview).__name__}")

    def _checked_guidance(self) -> float:
        """The guidance scale as a float, refused unless a number in 0..MAX_GUIDANCE."""
        guidance_scale = self.guidance_scale
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float, np.floating, np.integer)):
            raise ParamError("guidance_scale", f"guidance_scale must be a number >= 0, got {_show(guidance_scale)}")
        try:
            guidance = float(guidance_scale)
        except OverflowError:  # an int too large for a float
            guidance = math.inf
        if not (0 <= guidance <= MAX_GUIDANCE):  # NaN fails this too
            raise ParamError("guidance_scale",
                             f"guidance_scale {_show(guidance_scale)} is out of range; allowed: 0..{MAX_GUIDANCE:g}")
        return guidance

    def _check_names_and_output(self) -> None:
        """The sampler and schedule names, the output format and compression, the request id."""
        for name in ("sampler", "schedule"):  # which names exist is the model family's to say (create, the planner)
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ParamError(name, f"{name} must be a {name} name, got {_show(getattr(self, name))}")
        if self.output_compression is not None:
            object.__setattr__(self, "output_compression", _check_int("output_compression", self.output_compression,
                                                                      0, 100))
        if self.output_format is not None and self.output_format not in OUTPUT_FORMATS:
            raise ParamError("output_format", f"output_format {_show(self.output_format)} is unknown; allowed: "
                                              f"{', '.join(OUTPUT_FORMATS)}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ParamError("request_id", f"request_id must be a non-empty string, got {self.request_id!r}")

    def _store_checked_numbers(self, guidance: float) -> None:
        """The size, steps, guidance, seed and image count stored as checked plain numbers, and the size key."""
        checked = {"width": _check_size("width", self.width), "height": _check_size("height", self.height),
                   "num_inference_steps": _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_STEPS),
                   "guidance_scale": guidance, "seed": _check_int("seed", self.seed, 0, MAX_SEED),
                   "num_images": _check_int("num_images", self.num_images, 1, MAX_IMAGES)}
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "key", (self.height, self.width))

    def _check_conditioning(self) -> None:
        """The adapters, controls, image prompts, guidance interval, file hashes and guidance rescale."""
        object.__setattr__(self, "loras", check_loras(self.loras))
        object.__setattr__(self, "controls", check_controls(self.controls))
        object.__setattr__(self, "image_prompts", check_image_prompt(self.image_prompts))
        object.__setattr__(self, "guidance_interval", check_interval(self.guidance_interval))
        _check_hashes(self.model_hash, self.lora_hashes)
        if self.variation is not None and not isinstance(self.variation, Variation):
            raise ParamError("variation", f"variation must be a Variation, got {type(self.variation).__name__}")
        rescale = self.guidance_rescale
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float, np.floating, np.integer)) \
                or not 0 <= float(rescale) <= 1:  # NaN fails this too
            raise ParamError("guidance_rescale", f"guidance_rescale {_show(rescale)} is out of range; allowed: a "
                                                 "number in [0, 1] (0.7 is diffusers' suggestion for zero-SNR models)")
        object.__setattr__(self, "guidance_rescale", float(rescale))

    def _check_edit(self) -> None:
        """An edit's input, and that its strength leaves at least one denoising step."""
        if self.edit is not None:
            if not isinstance(self.edit, EditInput):
                raise ParamError("image", f"edit must be an EditInput, got {type(self.edit).__name__}")
            steps, strength = self.num_inference_steps, self.edit.strength
            if self.edit.denoising_steps(steps) < 1:  # diffusers' rule: the steps the strength leaves
                raise ParamError("strength", f"strength {strength:g} with num_inference_steps {steps} leaves no "
                                             f"denoising step (int({steps} * {strength:g}) = 0); raise strength or "
                                             "num_inference_steps")

    @property
    def denoising_steps(self) -> int:
        """The steps this request runs: all of them, or an edit's share (diffusers' strength rule)."""
        if self.edit is None:
            return self.num_inference_steps
        return self.edit.denoising_steps(self.num_inference_steps)

    @classmethod
    def create(cls, prompt: Any, *, negative_prompt: Any = None, width: Any = None, height: Any = None,
               num_inference_steps: Any = None, guidance_scale: Any = None, sampler: Any = None,
               schedule: Any = None, seed: Any = None, num_images: Any = 1, output_format: Any = None,
               request_id: str | None = None, model: "ModelInfo | None" = None, image: Any = None,
               mask_image: Any = None, strength: Any = None, loras: Any = (), guidance_interval: Any = None,
               guidance_rescale: Any = 0.0, prompt_syntax: Any = "plain", clip_skip: Any = None,
               emphasis: Any = "original", timestep_spacing: Any = None, eta: Any = None,
               preview: Any = None, controls: Any = (), image_prompts: Any = None,
               output_compression: Any = None, extras: Any = None,
               return_latents: Any = False, variation: Any = None, tiling: Any = False,
               noise_seed_delta: Any = 0) -> "GenerationRequest":
        """A request from user parameters: a random seed when none is given, the model's native size, guidance,
        sampler and schedule where those are not given, every value checked (the sampler, schedule and size against
        the model's family, `num_images` against the engine's rows; without a model, against the built-in
        families'). With `image` (PIL image or uint8 RGB array) it is an image-to-image request, with `mask_image`
        too an inpainting one; without width/height the output takes the image's size rounded down to the family's
        size multiple (diffusers' rule), and strength defaults to the model's (diffusers' pipelines: 0.8 / 0.3 for
        SDXL image-to-image, 1.0 / 0.9999 for SDXL inpainting). With `prompt_syntax="a1111"`, the prompts'
        `<lora:name:scale>` tags join `loras` (after the listed ones). `preview`: a PreviewSpec, a dict of its
        fields ({"every": 2, "format": "jpeg"}) or None. `extras`: the registered capabilities' parameters by
        name (a dict; the engine checks and prepares them at submit). `return_latents`: the result carries the final
        latents too (`GenerationResult.latents`); an `EditInput` with `latents` (and width, height) starts from
        such latents (the hires fix: hires.py). `variation`: a Variation or a dict of its fields. `tiling`: circular
        padding in the denoiser's and the VAE's convolutions (a UNet family's; AUTOMATIC1111's tiling).
        `noise_seed_delta`: AUTOMATIC1111's eta_noise_seed_delta (the sampler's later noise from seed + it)."""
        multiple = model.size_multiple if model is not None else SIZE_MULTIPLE
        edit, width, height = _edit_of(image, mask_image, strength, model, width, height, multiple)
        if model is None and (width is None or height is None or guidance_scale is None):
            raise ParamError(None, "width, height and guidance_scale are needed when no model gives defaults")
        if seed is None:
            seed = secrets.randbelow(2**31)
        kwargs = {} if request_id is None else {"request_id": str(request_id)}
        width = model.native_size if width is None else width
        height = model.native_size if height is None else height
        for name, value in (("width", width), ("height", height)):  # the family's words first (its multiple)
            _check_size(name, value, multiple)
        # the names people type (AUTOMATIC1111's labels, ComfyUI's): the family's own names, a label's schedule
        names = (model.samplers, model.schedules) if model is not None else (SAMPLERS, SCHEDULES)
        if (sampler is not None and sampler not in names[0]) or (schedule is not None and schedule not in names[1]):
            sampler, schedule = canonical(sampler, schedule, *names)
        if sampler is None:
            sampler = model.default_sampler if model is not None else DEFAULT_SAMPLER
        if schedule is None:
            schedule = model.default_schedule if model is not None else DEFAULT_SCHEDULE
        if num_inference_steps is None:
            num_inference_steps = model.default_steps if model is not None and model.default_steps else DEFAULT_STEPS
        request = cls(prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
                      num_inference_steps=num_inference_steps,
                      guidance_scale=model.default_guidance if guidance_scale is None else guidance_scale,
                      sampler=sampler, schedule=schedule, seed=seed, num_images=num_images,
                      output_format=output_format, edit=edit, loras=loras, guidance_interval=guidance_interval,
                      guidance_rescale=guidance_rescale, prompt_syntax=prompt_syntax, clip_skip=clip_skip,
                      emphasis=emphasis, timestep_spacing=timestep_spacing, eta=eta,
                      preview=make_preview(preview), controls=controls, image_prompts=image_prompts,
                      output_compression=output_compression, extras=_extras(extras, model),
                      return_latents=return_latents, variation=make_variation(variation), tiling=tiling,
                      noise_seed_delta=noise_seed_delta, **kwargs)
        if request.prompt_syntax == "a1111":
            tagged = prompt_loras(request)
            if tagged:
                try:
                    request = dataclasses.replace(request, loras=request.loras + tagged)
                except ParamError as e:  # the tags' adapters, checked with the listed ones: name what was written
                    if e.param != "loras":
                        raise
                    raise ParamError("prompt", f"the prompt's <lora:...> tags: {e}") from None
        if model is None:
            check_family_params(request.sampler, request.schedule, request.key)
        else:
            model.check(request.sampler, request.schedule, request.key)
            model.check_request(request)
            if request.num_images > model.max_rows:
                raise ParamError("num_images", f"num_images {request.num_images} exceeds this engine's largest "
                                               f"batch bucket {model.max_rows}")
        return request


def _edit_of(image: Any, mask_image: Any, strength: Any, model: "ModelInfo | None", width: Any, height: Any,
             multiple: int) -> tuple[EditInput | None, Any, Any]:
    """(the EditInput of `create`'s image arguments or None, width, height): without width/height, the image's size
    rounded down to `multiple`; an edit from latents must give them."""
    edit = None
    if isinstance(image, EditInput):  # already checked (the HTTP edge builds it from the form)
        edit = image
    elif image is not None:
        edit = make_edit(image, mask_image, strength, model)
    if edit is None:
        if mask_image is not None or strength is not None:
            raise ParamError("image", "mask_image and strength need an image: give image= (image-to-image) or "
                                      "image= and mask_image= (inpainting)")
        return None, width, height
    if model is not None and edit.steps_rule != model.edit_steps_rule:
        edit = dataclasses.replace(edit, steps_rule=model.edit_steps_rule)
    if edit.latents is not None and (width is None or height is None):
        raise ParamError("width", "an edit from latents needs width and height: the size they decode to")
    h, w = edit.image.shape[:2] if edit.latents is None else (height, width)
    return edit, w - w % multiple if width is None else width, h - h % multiple if height is None else height


def _check_hashes(model_hash: Any, lora_hashes: Any) -> None:
    if model_hash is not None and not (isinstance(model_hash, str) and _HASH.fullmatch(model_hash)):
        raise ParamError("model_hash", f"model_hash must be hex digits or None, got {_show(model_hash)}")
    if not isinstance(lora_hashes, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], str)
            and _HASH.fullmatch(p[1]) for p in lora_hashes):
        raise ParamError("lora_hashes", "lora_hashes must be a tuple of (adapter name, hex digits) pairs")


def make_preview(value: Any) -> PreviewSpec | None:
    """A request's `preview` from a PreviewSpec, a dict of its fields, or None."""
    if value is None or isinstance(value, PreviewSpec):
        return value
    if not isinstance(value, dict):
        raise ParamError("preview", f"preview must be an object such as {{\"every\": 2, \"format\": \"jpeg\"}}, got "
                                    f"{_show(value)}")
    unknown = sorted(set(value) - {"every", "format", "limit"})
    if unknown:
        raise ParamError("preview", f"preview has unknown fields {unknown}; allowed: every, format, limit")
    return PreviewSpec(**value)


def prompt_loras(request: GenerationRequest) -> tuple[tuple[str, float], ...]:
    """The `<lora:name:scale>` tags of an a1111-syntax request's prompt and negative prompt (ParamError naming the
    prompt whose syntax is wrong, in any text of its schedule: prompt editing, alternation)."""
    from .prompt_syntax import schedule_a1111  # pure Python, and only a1111-syntax requests need it

    steps = request.num_inference_steps
    tags = schedule_a1111(request.prompt, "prompt", steps)[0][2].loras
    if request.negative_prompt is not None:
        tags += schedule_a1111(request.negative_prompt, "negative_prompt", steps)[0][2].loras
    return tags


def check_interval(value: Any) -> tuple[float, float] | None:
    """A guidance interval: None, or [lo, hi] with 0 <= lo < hi <= 1 (fractions of the request's steps)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) for v in value):
        raise ParamError("guidance_interval", f"guidance_interval must be [lo, hi], two numbers in [0, 1], got "
                                              f"{_show(value)}")
    lo, hi = float(value[0]), float(value[1])
    if not (0 <= lo < hi <= 1):  # NaN fails this too
        raise ParamError("guidance_interval", f"guidance_interval [{lo:g}, {hi:g}] must have 0 <= lo < hi <= 1 "
                                              "(fractions of the schedule: [0.2, 0.8] guides the middle 60%)")
    return (lo, hi)


def check_loras(value: Any) -> tuple[tuple[str, float], ...]:
    """LoRA adapters of a request: a list of (name, scale) pairs, {"name": ..., "scale": ...} dicts or bare names
    (scale 1); at most MAX_LORAS (an engine's own limit, `LoraConfig.max_per_request`, is checked where it
    resolves them), each named once, scales finite in [-MAX_LORA_SCALE, MAX_LORA_SCALE]. Whether
    the names exist is the engine's to check (its adapter folder)."""
    if value is None:
        return ()
    if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
        raise ParamError("loras", f"loras must be a list of adapters, e.g. [{{\"name\": \"styles/ink\", \"scale\": "
                                  f"0.8}}], got {_show(value)}")
    if len(value) > MAX_LORAS:
        raise ParamError("loras", f"{len(value)} adapters in one request; at most {MAX_LORAS} on any server "
                                  "(--max-request-loras sets a server's own limit)")
    out: list[tuple[str, float]] = []
    for item in value:
        if isinstance(item, str):
            name, scale = item, 1.0
        elif isinstance(item, dict):
            if set(item) - {"name", "scale"} or "name" not in item:
                raise ParamError("loras", f"an adapter is {{\"name\": ..., \"scale\": ...}}, got {_show(item)}")
            name, scale = item["name"], item.get("scale", 1.0)
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            name, scale = item
        else:
            raise ParamError("loras", f"an adapter is a (name, scale) pair, got {_show(item)}")
        if not isinstance(name, str) or not name:
            raise ParamError("loras", f"an adapter name must be a non-empty string, got {_show(name)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise ParamError("loras", f"the scale of adapter {name!r} must be a number, got {_show(scale)}")
        try:
            scale = float(scale)
        except OverflowError:
            scale = math.inf
        if not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:  # NaN fails this too
            raise ParamError("loras", f"the scale of adapter {name!r} is {_show(scale)}; allowed: "
                                      f"{-MAX_LORA_SCALE:g}..{MAX_LORA_SCALE:g}")
        if any(n == name for n, _ in out):
            raise ParamError("loras", f"adapter {name!r} is listed twice; list it once with the scale you want")
        out.append((name, scale))
    return tuple(out)


def _pixels(value: Any, name: str, mode: str) -> np.ndarray:
    """A PIL image or a uint8 array as a uint8 array in `mode` (RGB: [H, W, 3], L: [H, W])."""
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8:
            raise ParamError(name, f"{name} must hold uint8 pixels (0..255), got an array of {value.dtype}")
        if mode == "L" and value.ndim == 3 and value.shape[2] in (1, 3):
            value = value[..., 0] if value.shape[2] == 1 else np.asarray(_pil(value).convert("L"))
        return np.ascontiguousarray(value)
    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image: converted as diffusers' processor does
        return np.asarray(value.convert(mode))
    raise ParamError(name, f"{name} must be a PIL image or a uint8 numpy array, got {type(value).__name__}")


def _pil(array: np.ndarray) -> Any:
    from PIL import Image
    return Image.fromarray(array)


def make_edit(image: Any, mask_image: Any = None, strength: Any = None, model: "ModelInfo | None" = None) -> EditInput:
    """The EditInput of user arguments; strength defaults to the model's for the task."""
    if strength is None:
        defaults = model.edit_strength if model is not None else (0.8, 1.0)
        strength = defaults[1] if mask_image is not None else defaults[0]
    mask = None if mask_image is None else _pixels(mask_image, "mask", "L")
    return EditInput(image=_pixels(image, "image", "RGB"), mask=mask, strength=strength)


@dataclass(frozen=True)
class ModelInfo:
    """What an engine client tells about the model it serves (the defaults requests are built with)."""

    name: str
    family: str
    native_size: int
    default_guidance: float
    max_rows: int        # the largest batch bucket: the most images one request may ask for
    mode: str            # "graph" | "eager"
    device: str
    ready_s: float = 0.0  # load to ready (prewarm graphs captured), seconds
    edit_strength: tuple[float, float] = (0.8, 1.0)  # default strength: (image-to-image, inpainting)
    edits: bool = True   # takes image-to-image and inpainting requests
    # the family's names and sizes (FamilyAdapter: samplers, schedules, defaults, size multiple)
    samplers: tuple[str, ...] = SAMPLERS
    schedules: tuple[str, ...] = SCHEDULES
    default_sampler: str = DEFAULT_SAMPLER
    default_schedule: str = DEFAULT_SCHEDULE
    size_multiple: int = SIZE_MULTIPLE
    # how the model guides: "cfg" (a second denoiser branch for the negative prompt), "embedded" (the value goes
    # into the denoiser: guidance-distilled models) or "none"
    guidance: str = "cfg"
    prompt_syntaxes: tuple[str, ...] = PROMPT_SYNTAXES  # the prompt syntaxes its text side reads
    # the registered capabilities (features/capability.py) this model has, and every registered capability's
    # parameter names (the server passes them on; the engine refuses those of capabilities the model lacks)
    extensions: tuple[str, ...] = ()
    extension_params: tuple[str, ...] = ()
    extension_images: tuple[str, ...] = ()  # those of its capabilities that take a list of images (`Param.images`)
    # the values its capabilities give a request that names none (a server default such as `--step-cache auto`)
    extension_defaults: tuple[tuple[str, Any], ...] = ()
    edit_images: str | None = None  # the one the edits route's image parts fill (None: the first is the edit's start)
    # the steps a request that names none runs (its checkpoint's model card); None: each route's own default
    default_steps: int | None = None
    edit_steps_rule: str = "sd"  # EDIT_STEP_RULES: how an edit's strength picks its steps (its family's pipelines)
    tiling: bool = True  # takes tiling requests (circular padding: a UNet family's convolutions)

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What requests may ask of this model beyond a prompt, as `GET /v1/models` lists it."""
        guidance = {"cfg": ("classifier_free_guidance",), "embedded": ("embedded_guidance",)}.get(self.guidance, ())
        return guidance + (("edits",) if self.edits else ()) + self.extensions

    def check(self, sampler: str, schedule: str, key: GroupKey) -> None:
        """ParamError unless the model's family takes this sampler, schedule and size."""
        check_family_params(sampler, schedule, key, self.samplers, self.schedules, self.size_multiple, self.family)

    def check_request(self, request: "GenerationRequest") -> None:
        """ParamError naming the first parameter this model cannot honour (beyond its sampler and size: `check`)."""
        self.check_guidance(request)
        if request.sampler in CFGPP_SAMPLERS and self.guidance != "cfg":
            raise ParamError("sampler", f"sampler {request.sampler!r} steps along classifier-free guidance's "
                                        f"unconditional branch, which model {self.name!r} does not run "
                                        f"({self.guidance} guidance); use 'ddim'")
        if request.tiling and not self.tiling:
            raise ParamError("tiling", tiling_refusal(self.family))
        if request.prompt_syntax not in self.prompt_syntaxes:
            raise ParamError("prompt_syntax", f"prompt_syntax {request.prompt_syntax!r} is not read by model "
                                              f"{self.name!r}; allowed: {', '.join(self.prompt_syntaxes)}")

    def check_guidance(self, request: "GenerationRequest") -> None:
        """ParamError naming the first parameter this model's guidance does not read (`unread_guidance`)."""
        for name in self.unread_guidance(request):
            if name == "guidance_scale":
                raise ParamError(name, f"guidance_scale {request.guidance_scale:g} is not read: model {self.name!r} "
                                       "is step-distilled and runs no guidance; leave guidance_scale out (or 1)")
            raise ParamError(name, f"{name} needs classifier-free guidance, which model {self.name!r} does not run "
                                   f"({self.guidance} guidance); leave {name} out")

    def unread_guidance(self, params: "GenerationRequest | dict[str, Any]") -> tuple[str, ...]:
        """The parameters (of a request, or `create` keywords) off their neutral values (`GUIDANCE_NEUTRAL`) that this
        model's guidance does not read: classifier-free guidance's on a model without it (an empty negative prompt,
        no interval and rescale 0 are neutral), and a guidance_scale other than 1 on one that runs none."""
        unread = () if self.guidance == "cfg" else cfg_params_used(params)
        scale = params.get("guidance_scale") if isinstance(params, dict) else params.guidance_scale
        if self.guidance == "none" and scale is not None and scale != GUIDANCE_NEUTRAL["guidance_scale"]:
            unread += ("guidance_scale",)
        return unread


def _extras(extras: Any, model: "ModelInfo | None") -> tuple[tuple[str, Any], ...]:
    """A request's capability parameters as (name, value) pairs, the model's defaults (`extension_defaults`) for
    those it names none of (None names none); a name no registered capability has is a ParamError naming it (the
    values are the engine's to check)."""
    defaults = dict(model.extension_defaults) if model is not None else {}
    if not extras:
        return tuple(sorted(defaults.items()))
    if not isinstance(extras, dict) or not all(isinstance(k, str) for k in extras):
        raise ParamError("extras", "extras must be a dict of capability parameters by name")
    known = model.extension_params if model is not None else ()
    for name in extras:
        if model is not None and name not in known:
            raise ParamError(name, f"{name} is not a parameter of model {model.name!r}; leave it out")
    return tuple(sorted({**defaults, **{k: v for k, v in extras.items() if v is not None}}.items()))


# the parameters only classifier-free guidance reads, with their neutral values (accepted on any model)
CFG_NEUTRAL: dict[str, Any] = {"negative_prompt": None, "guidance_interval": None, "guidance_rescale": 0.0}
# and guidance_scale's, the only one a model that runs no guidance accepts
GUIDANCE_NEUTRAL: dict[str, Any] = {**CFG_NEUTRAL, "guidance_scale": 1.0}


def cfg_params_used(params: "GenerationRequest | dict[str, Any]") -> tuple[str, ...]:
    """The parameters (of a request, or `create` keywords) off their neutral values that only classifier-free
    guidance reads (a blank negative prompt is neutral)."""
    def value(name: str) -> Any:
        got = params.get(name, CFG_NEUTRAL[name]) if isinstance(params, dict) else getattr(params, name)
        return None if name == "negative_prompt" and not (got or "").strip() else got
    return tuple(name for name, neutral in CFG_NEUTRAL.items() if value(name) != neutral)


@dataclass(frozen=True)
class ProgressEvent:
    """One denoising step of a request done: `step` of `total`. A request with a `preview` gets a second event for
    the steps that bring one: `previews` holds one encoded image per image of the request, in `preview_format`."""

    request_id: str
    step: int
    total: int
    previews: tuple[bytes, ...] = ()
    preview_format: str | None = None


@dataclass
class GenerationResult:
    """What a request gets back: float pixels in [0, 1] (n, H, W, 3), the images encoded in the request's
    output_format (when it has one), the seed and timings (ms). Reads as the list of its PIL images
    (`images[0].save(...)`), which are made from the pixels on first use, as diffusers' numpy_to_pil rounds."""

    request_id: str
    arrays: np.ndarray | None  # None when only the encoded images crossed a process boundary (replicas)
    seed: int
    timings: dict[str, float]
    request: GenerationRequest
    encoded: list[bytes] | None = None
    # the final image latents [n, C, h, w] float32 (the model's latent space, unpacked), when the request asked
    # (`return_latents`); else None
    latents: np.ndarray | None = None
    _images: list[Any] | None = field(default=None, repr=False, compare=False)

    @property
    def images(self) -> list[Any]:
        if self._images is None:
            import io

            from PIL import Image
            if self.arrays is None:
                self._images = [Image.open(io.BytesIO(b)) for b in self.encoded or ()]
            else:
                self._images = [Image.fromarray(a) for a in (self.arrays * 255).round().astype("uint8")]
        return self._images

    def __len__(self) -> int:
        return len(self.arrays) if self.arrays is not None else len(self.encoded or ())

    def __iter__(self):
        return iter(self.images)

    def __getitem__(self, index: int):
        return self.images[index]
