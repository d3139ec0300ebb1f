"""A request's capability inputs, each checked on construction and plain picklable data (numpy, no tensors), so it
crosses a process boundary with its request: an edit's image (`EditInput`), ControlNet controls (`ControlInput`), an
IP-Adapter image prompt (`ImagePromptInput`), LoRA adapters and the guidance interval (`check_loras`,
`check_interval`), live previews (`PreviewSpec`) and AUTOMATIC1111's variation seed (`Variation`). With the limits they
share with the request and the value checks both use (`shown`, `check_int`). request.py builds the request from
them (and re-exports them); every error is a `ParamError` naming the request's parameter.
"""


from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .errors import ParamError
from .sampling.schedules import MAX_STEPS

MIN_SIZE = 64
MAX_SIZE = 2048
MAX_SEED = 2**63 - 1
MAX_LORAS = 16           # adapters one request may stack on any engine (its own limit: --max-request-loras)
MAX_LORA_SCALE = 8.0


def shown(value: Any) -> str:
    """A value for an error message: short, and safe for integers too long for str()."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and abs(int(value)).bit_length() > 80:
        digits = int(abs(int(value)).bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}(an integer of about {digits} digits)"
    text = str(value) if isinstance(value, (int, float, np.integer, np.floating)) else repr(value)
    return text if len(text) <= 24 else f"{text[:20]}..."


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """An integer parameter in low..high (bools refused), as a plain int; ParamError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ParamError(name, f"{name} must be an integer in {low}..{high}, got {shown(value)}")
    if not low <= int(value) <= high:
        raise ParamError(name, f"{name} {shown(value)} is out of range; allowed: {low}..{high}")
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
            raise ParamError("strength", f"strength {shown(st)} is out of range; allowed: a number in (0, 1]")
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


def check_loras(value: Any) -> tuple[tuple[str, float], ...]:
    """LoRA adapters of a request: a list of (name, scale) pairs, {"name": ..., "scale": ...} dicts or bare names
    (scale 1); at most MAX_LORAS (an engine's own limit, `LoraConfig.max_per_request`, is checked where it
    resolves them), each named once, scales finite in [-MAX_LORA_SCALE, MAX_LORA_SCALE]. Whether
    the names exist is the engine's to check (its adapter folder)."""
    if value is None:
        return ()
    if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
        raise ParamError("loras", f"loras must be a list of adapters, e.g. [{{\"name\": \"styles/ink\", \"scale\": "
                                  f"0.8}}], got {shown(value)}")
    if len(value) > MAX_LORAS:
        raise ParamError("loras", f"{len(value)} adapters in one request; at most {MAX_LORAS} on any server "
                                  "(--max-request-loras sets a server's own limit)")
    out: list[tuple[str, float]] = []
    for item in value:
        if isinstance(item, str):
            name, scale = item, 1.0
        elif isinstance(item, dict):
            if set(item) - {"name", "scale"} or "name" not in item:
                raise ParamError("loras", f"an adapter is {{\"name\": ..., \"scale\": ...}}, got {shown(item)}")
            name, scale = item["name"], item.get("scale", 1.0)
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            name, scale = item
        else:
            raise ParamError("loras", f"an adapter is a (name, scale) pair, got {shown(item)}")
        if not isinstance(name, str) or not name:
            raise ParamError("loras", f"an adapter name must be a non-empty string, got {shown(name)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise ParamError("loras", f"the scale of adapter {name!r} must be a number, got {shown(scale)}")
        try:
            scale = float(scale)
        except OverflowError:
            scale = math.inf
        if not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:  # NaN fails this too
            raise ParamError("loras", f"the scale of adapter {name!r} is {shown(scale)}; allowed: "
                                      f"{-MAX_LORA_SCALE:g}..{MAX_LORA_SCALE:g}")
        if any(n == name for n, _ in out):
            raise ParamError("loras", f"adapter {name!r} is listed twice; list it once with the scale you want")
        out.append((name, scale))
    return tuple(out)


def check_interval(value: Any) -> tuple[float, float] | None:
    """A guidance interval: None, or [lo, hi] with 0 <= lo < hi <= 1 (fractions of the request's steps)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) for v in value):
        raise ParamError("guidance_interval", f"guidance_interval must be [lo, hi], two numbers in [0, 1], got "
                                              f"{shown(value)}")
    lo, hi = float(value[0]), float(value[1])
    if not (0 <= lo < hi <= 1):  # NaN fails this too
        raise ParamError("guidance_interval", f"guidance_interval [{lo:g}, {hi:g}] must have 0 <= lo < hi <= 1 "
                                              "(fractions of the schedule: [0.2, 0.8] guides the middle 60%)")
    return (lo, hi)


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
            object.__setattr__(self, "every", check_int("preview.every", self.every, 0, MAX_STEPS))
            object.__setattr__(self, "limit", check_int("preview.limit", self.limit, 0, MAX_STEPS))
        except ParamError as e:  # the request's field is `preview`; the message names its part
            raise ParamError("preview", str(e)) from None
        if self.every == 0 and self.limit == 0:
            raise ParamError("preview", "preview.every 0 (spread) needs a limit: the number of previews")
        if self.format not in PREVIEW_FORMATS:
            raise ParamError("preview", f"preview format {shown(self.format)} is unknown; allowed: "
                                        f"{', '.join(PREVIEW_FORMATS)}")

    @classmethod
    def partial_images(cls, count: Any, fmt: str = "jpeg") -> "PreviewSpec | None":
        """OpenAI's `partial_images` (0-3): that many previews spread over the request's evaluations."""
        count = check_int("partial_images", count, 0, 3)
        return cls(every=0, format=fmt, limit=count) if count else None

    def due(self, step: int, total: int) -> bool:
        """Whether the evaluation `step` (1-based) of `total` brings a preview."""
        if self.every == 0:  # the k-th of `limit` previews at k / (limit + 1) of the way, rounded
            return any(step == max(1, math.floor(k * total / (self.limit + 1) + 0.5)) for k in range(1, self.limit + 1))
        return step % self.every == 0 and (self.limit == 0 or step // self.every <= self.limit)


def make_preview(value: Any) -> PreviewSpec | None:
    """A request's `preview` from a PreviewSpec, a dict of its fields, or None."""
    return _spec(PreviewSpec, "preview", value, '{"every": 2, "format": "jpeg"}')


def _spec(cls: type, param: str, value: Any, example: str, required: tuple[str, ...] = ()) -> Any:
    """A request's object field `param` from a `cls` (a dataclass), a dict of its fields (those of `required` given),
    or None. Raises ParamError naming `param`."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ParamError(param, f"{param} must be an object such as {example}, got {shown(value)}")
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ParamError(param, f"{param} has unknown fields {unknown}; allowed: {', '.join(allowed)}")
    missing = [f for f in required if f not in value]
    if missing:
        optional = [f for f in allowed if f not in required]
        more = f" (and optionally {', '.join(optional)})" if optional else ""
        raise ParamError(param, f"{param} needs {' and '.join(required)}{more}, got fields {sorted(value)}")
    return cls(**value)


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
        object.__setattr__(self, "subseed", check_int("variation.subseed", self.subseed, 0, MAX_SEED))
        strength = self.strength
        if isinstance(strength, bool) or not isinstance(strength, (int, float, np.floating, np.integer)) \
                or not 0 <= float(strength) <= 1:  # NaN fails this too
            raise ParamError("variation.strength", f"variation strength {shown(strength)} is out of range; allowed: "
                                                   "a number in [0, 1] (0: the seed's noise alone)")
        object.__setattr__(self, "strength", float(strength))
        size = self.resize_from
        if size is not None:
            if not isinstance(size, (tuple, list)) or len(size) != 2:
                raise ParamError("variation.resize_from", f"variation resize_from must be (width, height) or None, "
                                                          f"got {shown(size)}")
            size = tuple(check_int("variation.resize_from", v, 1, MAX_SIZE) for v in size)
        object.__setattr__(self, "resize_from", size)


def make_variation(value: Any) -> Variation | None:
    """A request's `variation` from a Variation, a dict of its fields ({"subseed": 7, "strength": 0.3}) or None."""
    return _spec(Variation, "variation", value, '{"subseed": 7, "strength": 0.3}', required=("subseed", "strength"))
