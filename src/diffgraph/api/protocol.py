"""The HTTP wire format, shared by the server's routes and batch jobs: pydantic models for the OpenAI-shaped images
API and its errors, the images that come with a request, and a body made a `GenerationRequest`.

Only the HTTP edge uses pydantic. Types are checked here (strictly: "2" is not a number); ranges and
allowed values are checked once, by `GenerationRequest.create`, whose ParamErrors `error_from_param_error`
turns into OpenAI-shaped errors with the parameter named as the client spelled it.

Images that come with a request are checked before their pixels are decoded (the edits form's uploads, base64 in a
JSON body: the generations route's control maps and image prompts, AUTOMATIC1111's init images, batch jobs' items):
at most --max-image-bytes bytes, and at most --max-image-pixels pixels read from the header (a decompression bomb is
refused before it expands). 16-bit and float grayscale images (PIL modes I;16, I, F) are scaled to 8 bits, not
clipped (`eight_bit`). A refusal is an APIError naming the field.

`generation_request` checks the HTTP-only fields of a body, applies the server's defaults (prompt syntax, clip skip),
decodes its uploads and builds the request (the one validation).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import secrets
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from pydantic import (BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      model_validator)

from ..errors import ParamError
from ..request import MAX_CONTROLS, MAX_PROMPT_IMAGES, EditInput, GenerationRequest, ModelInfo, PreviewSpec, \
    require_prompt

if TYPE_CHECKING:
    from .config import ServerConfig

# ASCII digits only: `\d` alone also takes Arabic-Indic and full-width digits, which int() reads as numbers
_SIZE = re.compile(r"^\s*([0-9]{1,6})\s*[xX×]\s*([0-9]{1,6})\s*$", re.ASCII)

# GenerationRequest parameter -> the body field that carries it
_ENGINE_TO_API = {"num_images": "n", "width": "size", "height": "size"}


class LoraRef(BaseModel):
    """One LoRA adapter of a request: its name as GET /v1/loras lists it, and its scale."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    scale: StrictFloat = 1.0  # ints are accepted as numbers


class ControlRef(BaseModel):
    """One ControlNet control of a request: the ControlNet's name as GET /v1/controlnets lists it, the control map
    (a base64 PNG, JPEG or WebP; a data: URL prefix allowed), its scale and its window (fractions of the steps)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    image: StrictStr
    scale: StrictFloat = 1.0
    start: StrictFloat = 0.0
    end: StrictFloat = 1.0
    preprocess: StrictStr = "none"  # "canny" (edges of the image, OpenCV), "invert"; "none": image is the map
    canny_low: StrictInt = 100
    canny_high: StrictInt = 200
    resize_mode: StrictStr | StrictInt = "just_resize"  # or crop_and_resize, resize_and_fill (A1111's labels too)
    control_mode: StrictStr | StrictInt = "balanced"    # or prompt, control (A1111's labels or 0-2 too)


class ImagePromptRef(BaseModel):
    """An IP-Adapter image prompt: the adapter's name (GET /v1/ip-adapters), 1 or 2 images (base64 PNG, JPEG or
    WebP; data: URL prefixes allowed) and its scale."""

    model_config = ConfigDict(extra="forbid")

    images: list[StrictStr]
    scale: StrictFloat = 1.0
    model: StrictStr | None = None  # None: the server's only IP-Adapter


class PreviewBody(BaseModel):
    """A request's live previews in its stream: every `every` steps, in `format` (jpeg, png, webp), at most `limit`
    of them (0: no limit; `every` 0 spreads `limit` previews over the steps)."""

    model_config = ConfigDict(extra="forbid")

    every: StrictInt = 1
    format: StrictStr = "jpeg"
    limit: StrictInt = 0


# OpenAI's `quality` -> the share of the default steps it runs (when the body gives no num_inference_steps)
QUALITY_STEPS = {"low": 0.5, "medium": 1.0, "standard": 1.0, "auto": 1.0, "high": 1.5, "hd": 1.5, "xhigh": 2.0,
                 "max": 2.0}
BACKGROUNDS = ("auto", "opaque")   # "transparent" cannot be honoured: the models make opaque images
STYLES = ("vivid", "natural")      # DALL-E 3's; accepted, with no effect here
MODERATIONS = ("auto", "low")      # accepted; this server runs no moderation
COMPLEXITIES = ("low", "medium", "high")  # OpenAI's planning effort: accepted, no effect (a diffusion model plans nothing)
# OpenAI's GIF and SVG output fields: null (their default) accepted, a value a 400 (png, jpeg and webp are served)
ANIMATION_FIELDS = ("frame_count", "frame_duration_ms", "svg")


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations: OpenAI's fields, then diffgraph's extensions. An explicit null means the
    field's default, as OpenAI's API reads it; unknown keys are a 400, as there."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    n: StrictInt = 1
    size: StrictStr | None = None               # "WxH"; default: the model's native size
    response_format: StrictStr = "b64_json"     # or "url": stored for --image-ttl, served at /v1/images/files/
    model: StrictStr | None = None
    user: StrictStr | None = None
    quality: StrictStr | None = None            # QUALITY_STEPS; None: "auto"
    background: StrictStr | None = None         # BACKGROUNDS
    style: StrictStr | None = None              # STYLES
    moderation: StrictStr | None = None         # MODERATIONS
    output_compression: StrictInt | None = None  # jpeg / webp: 0..100 (OpenAI's); None: quality 95
    safety_identifier: StrictStr | None = None  # OpenAI's end-user id: accepted, recorded nowhere (as `user`)
    complexity: StrictStr | None = None         # COMPLEXITIES
    frame_count: StrictInt | None = None        # ANIMATION_FIELDS: null only
    frame_duration_ms: StrictInt | None = None
    svg: dict[str, Any] | None = None
    # extensions
    negative_prompt: StrictStr | None = None
    num_inference_steps: StrictInt = 20
    guidance_scale: StrictFloat | None = None    # ints are accepted as numbers
    true_cfg_scale: StrictFloat | None = None    # vLLM-Omni's (and QwenImagePipeline's) name of guidance_scale
    schedule_shift: StrictFloat | None = None    # a flow model's time shift at every size (None: its schedule's)
    # [lo, hi], fractions of the steps: step i of N runs classifier-free guidance iff lo <= i/N < hi
    guidance_interval: list[StrictFloat] | None = None
    guidance_rescale: StrictFloat = 0.0          # diffusers' rescaled CFG, 0..1 (0 = off)
    seed: StrictInt | None = None
    sampler: StrictStr | None = None             # None: the model family's default (GET /info)
    schedule: StrictStr | None = None
    output_format: StrictStr = "png"
    stream: StrictBool = False
    loras: list[LoraRef] | None = None  # up to --max-request-loras (8) adapters for this request alone
    controls: list[ControlRef] | None = None  # up to 3 ControlNet controls (--controlnet-dir)
    image_prompts: ImagePromptRef | None = None  # an IP-Adapter image prompt (--ip-adapter-dir)
    prompt_syntax: StrictStr | None = None       # "plain" | "a1111"; None: the server's --prompt-syntax
    clip_skip: StrictInt | None = None           # None: the server's --clip-skip
    emphasis: StrictStr = "original"             # a1111 syntax: "original" | "no_norm"
    timestep_spacing: StrictStr | None = None    # "leading" | "linspace" | "trailing"; None: the model's own
    eta: StrictFloat | None = None               # TCD's gamma or DDIM's eta, 0..1; None: 0.3 / 0
    tiling: StrictBool = False                   # AUTOMATIC1111's tiling: circular padding (UNet families)
    partial_images: StrictInt | None = None      # OpenAI's: 0-3 previews in the stream, spread over the steps
    preview: PreviewBody | None = None           # previews every K steps in the stream

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """An explicit null on a field whose default is not null takes that default (OpenAI's clients send them)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)}

    def openai_choices(self) -> None:
        """APIError 400 naming the OpenAI field whose value is not one this server takes."""
        for name, allowed in (("quality", tuple(QUALITY_STEPS)), ("background", BACKGROUNDS + ("transparent",)),
                              ("style", STYLES), ("moderation", MODERATIONS), ("complexity", COMPLEXITIES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise APIError(400, f"{name} {value!r} is unknown; allowed: {', '.join(allowed)}", param=name)
        for name in ANIMATION_FIELDS:
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: GIF and SVG output are not served here (output_format png, jpeg or "
                                    "webp); send null or leave it out", param=name)
        if self.background == "transparent":
            raise APIError(400, "background 'transparent' cannot be honoured: the models served here make opaque "
                                "images; send 'opaque' or 'auto'", param="background")

    def steps(self, model_default: int | None = None) -> int | None:
        """num_inference_steps, else the share of the model's default (`model_default`: its checkpoint's steps; None:
        the field's) that `quality` asks for; None where the body names neither (the engine's default then: the
        model's, or what the request's LoRA sidecars recommend)."""
        if "num_inference_steps" in self.model_fields_set:
            return self.num_inference_steps
        if self.quality is None:
            return None
        default = self.num_inference_steps if model_default is None else model_default
        return default if self.quality is None else max(1, round(default * QUALITY_STEPS[self.quality]))

    def preview_params(self) -> dict[str, Any] | PreviewSpec | None:
        """The request's `preview` (stream.py sends them; a request that does not stream gets none)."""
        if self.preview is not None and self.partial_images:
            raise APIError(400, "give preview or partial_images, not both", param="partial_images")
        if not self.stream:  # no previews to send; a bad `preview` is still the caller's 400, as when streaming
            if self.preview is not None:
                try:
                    PreviewSpec(**self.preview.model_dump())
                except ParamError as e:
                    raise error_from_param_error(e) from None
            return None
        if self.preview is not None:
            return self.preview.model_dump()
        if self.partial_images is None:
            return None
        try:
            return PreviewSpec.partial_images(self.partial_images)
        except ParamError as e:
            raise error_from_param_error(e) from None

    def request_params(self, model_steps: int | None = None) -> dict[str, Any]:
        """The `GenerationRequest.create` keywords these fields carry (`size` parsed, `n` as num_images; steps: the
        model's `model_steps` where the body names none and the model has a default). Raises APIError for a
        malformed size."""
        width, height = self.width_height()
        self.openai_choices()
        return dict(negative_prompt=self.negative_prompt, width=width, height=height,
                    num_inference_steps=self.steps(model_steps), guidance_scale=self.guidance(),
                    guidance_interval=self.guidance_interval, guidance_rescale=self.guidance_rescale,
                    sampler=self.sampler, schedule=self.schedule, seed=self.seed, num_images=self.n,
                    output_format=self.output_format, loras=tuple((a.name, a.scale) for a in self.loras or ()),
                    prompt_syntax=self.prompt_syntax, clip_skip=self.clip_skip, emphasis=self.emphasis,
                    timestep_spacing=self.timestep_spacing, eta=self.eta, schedule_shift=self.schedule_shift,
                    preview=self.preview_params(),
                    output_compression=self.output_compression, tiling=self.tiling)

    def guidance(self) -> float | None:
        """guidance_scale, or its alias true_cfg_scale; both, unequal, are a 400."""
        if self.true_cfg_scale is None:
            return self.guidance_scale
        if self.guidance_scale is not None and self.guidance_scale != self.true_cfg_scale:
            raise APIError(400, f"true_cfg_scale {self.true_cfg_scale:g} and guidance_scale {self.guidance_scale:g} "
                                "are one setting (true_cfg_scale is its alias); send one of them",
                           param="true_cfg_scale")
        return self.true_cfg_scale

    def width_height(self) -> tuple[int | None, int | None]:
        """`size` as (width, height); (None, None) for the native size. Raises APIError for a malformed size."""
        if self.size is None or self.size == "auto":
            return None, None
        m = _SIZE.match(self.size)
        if m is None:
            raise APIError(400, f"size {self.size!r} must look like WIDTHxHEIGHT, e.g. 512x512", param="size")
        return int(m.group(1)), int(m.group(2))


class ImageData(BaseModel):
    b64_json: str | None = None                 # response_format "b64_json" (the default)
    url: str | None = None                      # response_format "url": served by GET /v1/images/files/ID.EXT
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    created: int
    data: list[ImageData]
    id: str
    seed: int                                   # one generator per request: all its images come from this seed
    output_format: str
    timings: dict[str, float]                   # ms: queue, denoise, decode, total


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffgraph"
    capabilities: list[str] | None = None  # what requests may ask of it beyond a prompt (None: not loaded yet)
    # what a request that names none gets (None: not loaded yet); steps: the route's default where None
    default_steps: int | None = None
    default_guidance: float | None = None
    native_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors ---------------------------------------------------------------------------------------
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def check_prompt_bytes(limit: int, **prompts: str | None) -> None:
    """--max-prompt-bytes on each prompt (keyword: its field), checked before any of them is parsed: a prompt's
    syntax is read only once it is known to be within the limit."""
    for name, text in prompts.items():
        size = len((text or "").encode("utf-8", errors="surrogatepass"))  # create() names an unpaired surrogate
        if size > limit:
            raise APIError(400, f"{name} has {size} bytes (UTF-8); the limit is {limit} (--max-prompt-bytes): "
                                f"shorten it", param=name)


def error_from_validation(err: ValidationError, model: type[BaseModel] | None = None) -> APIError:
    """The first pydantic error, as one sentence naming the field, what it must be and what came."""
    e = err.errors(include_url=False)[0]
    param = ".".join(str(p) for p in e["loc"]) or None
    if e["type"] == "extra_forbidden":  # the fields of the object that holds it (a nested one: preview, loras.0)
        allowed = ", ".join(_fields_at(model or ImageGenerationRequest, e["loc"][:-1]))
        return APIError(400, f"unknown parameter {param!r}; accepted: {allowed}", param=param)
    if e["type"] == "missing":
        return APIError(400, f"{param} is required", param=param)
    if e["type"] == "model_type":
        return APIError(400, "the body must be a JSON object, e.g. {\"prompt\": \"a red fox\"}")
    got = e.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    return APIError(400, f"{param}: {_expected(e['type'], e['msg'])}, got {shown}", param=param)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The fields of the object at `loc` inside `model` (list indexes skipped)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = _model_in(field.annotation) if field is not None else None
        if inner is not None:
            model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`X`, `X | None`, `list[X]`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _expected(kind: str, msg: str) -> str:
    if kind.startswith("string"):
        return "must be a string"
    if kind.startswith("int"):
        return "must be an integer"
    if kind.startswith("float"):
        return "must be a number"
    if kind.startswith("bool"):
        return "must be true or false"
    return msg[0].lower() + msg[1:]


def error_from_param_error(err: ValueError, extensions: tuple[str, ...] = ()) -> APIError:
    """A request's ParamError ("num_images 17 is out of range; ...") -> 400 naming the body field that carries it
    (n, size, ...), with the message in the client's words; `extensions`: the registered capabilities' parameters
    (body fields of their own names)."""
    message = str(err)
    name = getattr(err, "param", None)
    known = name in ImageGenerationRequest.model_fields or name in ("image", "mask", "strength") or (
        (name or "").split(".")[0] in extensions)  # + the edits', and a capability's fields ("step_cache.method")
    param = _ENGINE_TO_API.get(name, name if known else None)
    if name == "num_images" and message.startswith("num_images"):
        message = "n" + message[len("num_images"):]
    return APIError(400, message, param=param)


CONTROL_FILES = tuple(f"control_image_{i}" for i in range(MAX_CONTROLS))  # control i's map, beside `controls`
PROMPT_FILES = tuple(f"image_prompt_{i}" for i in range(MAX_PROMPT_IMAGES))  # the image prompt's images
# the formats read: each declares its size in a header read before any pixel is decoded (an ICO decodes its
# entry while it opens, whatever size its directory claims: past --max-image-pixels before the check)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG opens a phone's MPO too (its factory)
# modes PIL opens but cannot convert to L or RGB (premultiplied alpha, CIELab): read as these
_CONVERTIBLE = {"La": "LA", "RGBa": "RGBA", "LAB": "RGB", "HSV": "RGB"}
EXIF_ORIENTATION = 0x0112


def decode_upload(name: str, data: bytes | None, max_bytes: int, max_pixels: int) -> Any:
    """A PIL image, its size checked from the header before its pixels are decoded, turned upright as its EXIF
    orientation says (a phone's photo is stored sideways with a mark: diffusers' load_image turns it too)."""
    from PIL import Image

    if not data:
        raise APIError(400, f"{name} is empty; upload a PNG, JPEG or WebP image", param=name)
    if len(data) > max_bytes:
        raise APIError(400, f"{name} has {len(data)} bytes; the limit is {max_bytes} (--max-image-bytes)",
                       param=name, code="image_too_large")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise APIError(400, f"{name} declares too many pixels (a decompression bomb?); the limit is {max_pixels}",
                       param=name, code="image_too_large") from None
    except Exception:
        raise APIError(400, f"{name} is not an image this server can read; upload a PNG, JPEG or WebP (or GIF, "
                            "BMP, TIFF)", param=name) from None
    width, height = image.size
    if width * height > max_pixels:
        raise APIError(400, f"{name} is {width}x{height} ({width * height} pixels); the limit is {max_pixels} "
                            "(--max-image-pixels)", param=name, code="image_too_large")
    try:
        image.load()
    except Exception as e:
        raise APIError(400, f"{name} could not be decoded ({type(e).__name__}); upload an intact PNG, JPEG or WebP",
                       param=name) from None
    if image.getexif().get(EXIF_ORIENTATION, 1) != 1:  # a camera's photo as it is shown (diffusers' load_image too)
        from PIL import ImageOps
        image = ImageOps.exif_transpose(image)
    return image.convert(_CONVERTIBLE[image.mode]) if image.mode in _CONVERTIBLE else image


def eight_bit(image: Any) -> Any:
    """An 8-bit `L` image of a 16-bit or float grayscale one (modes I;16*, I, F), scaled: PIL's convert clips them
    to 0..255 (a 16-bit upload turned nearly all white). The full scale is the smallest of 1 (float images only),
    255 and 65535 that holds the largest value (I;16: 65535), else that value; below 0 is black. Other modes
    pass through."""
    from PIL import Image

    if not (image.mode.startswith("I") or image.mode == "F"):
        return image
    values = np.nan_to_num(np.asarray(image, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    top = float(values.max(initial=0.0))
    scales = (65535.0,) if image.mode.startswith("I;16") else (1.0, 255.0, 65535.0) if image.mode == "F" \
        else (255.0, 65535.0)
    full = next((s for s in scales if top <= s), top)
    return Image.fromarray(np.clip(np.rint(values * (255.0 / full)), 0, 255).astype(np.uint8), "L")


def decode_b64(field: str, text: str, max_bytes: int, max_pixels: int) -> Any:
    """A base64 image (a `data:image/...;base64,` prefix allowed), checked as an upload is (edits.py)."""
    if "," in text[:100] and text.startswith("data:"):
        text = text.split(",", 1)[1]
    if text.startswith(("http://", "https://")):
        raise APIError(400, f"{field}: this server does not fetch URLs; send the image as base64", param=field)
    if len(text) > 4 * (max_bytes // 3 + 2) + 1024:
        raise APIError(400, f"{field} is larger than {max_bytes} bytes (--max-image-bytes)", param=field,
                       code="image_too_large")
    try:
        data = base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{field} is not base64 text; send a base64-encoded PNG, JPEG or WebP",
                       param=field) from None
    return decode_upload(field, data, max_bytes, max_pixels)


def decode_images(field: str, value: Any, max_bytes: int, max_pixels: int) -> list[Any]:
    """A capability's list of base64 images (`Param.images`) as RGB images; a 400 naming the field otherwise."""
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise APIError(400, f"{field} must be a list of base64 images", param=field)
    return [eight_bit(decode_b64(f"{field}[{i}]", t, max_bytes, max_pixels)).convert("RGB")
            for i, t in enumerate(value)]


def decode_controls(refs: list[ControlRef] | None, max_bytes: int, max_pixels: int,
                    files: dict[str, bytes] | None = None) -> list[dict[str, Any]]:
    """A body's `controls` with their images decoded (GenerationRequest.create checks the rest): base64 in each
    control's `image`, or (the edits form) the file part control_image_<i>."""
    out = []
    files = files or {}
    if len(refs or ()) > MAX_CONTROLS:
        raise APIError(400, f"{len(refs)} controls given; at most {MAX_CONTROLS} per request", param="controls")
    for i, ref in enumerate(refs or ()):
        part = CONTROL_FILES[i]
        if (ref.image is None) == (part not in files):
            raise APIError(400, f"controls[{i}] needs its control image once: as the file part {part} or as base64 "
                                "in its image field", param=f"controls[{i}].image")
        image = (decode_upload(part, files[part], max_bytes, max_pixels) if ref.image is None
                 else decode_b64(f"controls[{i}].image", ref.image, max_bytes, max_pixels))
        out.append({**ref.model_dump(), "image": eight_bit(image).convert("RGB")})
    extra = sorted(set(files) & set(CONTROL_FILES[len(refs or ()):]))
    if extra:
        raise APIError(400, f"file part {extra[0]} has no control in controls; add one, or leave the part out",
                       param=extra[0])
    return out


def decode_image_prompt(ref: ImagePromptRef | None, max_bytes: int, max_pixels: int,
                        files: dict[str, bytes] | None = None) -> dict[str, Any] | None:
    """A body's `image_prompts` with its images decoded (GenerationRequest.create checks the rest): base64 in its
    `images`, or (the edits form) the file parts image_prompt_<i>."""
    files = files or {}
    parts = [p for p in PROMPT_FILES if p in files]
    if ref is None:
        if parts:
            raise APIError(400, f"file part {parts[0]} has no image_prompts field; add one ({{\"model\": ...}}), or "
                                "leave the part out", param=parts[0])
        return None
    if (ref.images is None) == (not parts):
        raise APIError(400, "image_prompts needs its images once: as the file parts image_prompt_0, image_prompt_1 or "
                            "as base64 in its images field", param="image_prompts.images")
    images = ([decode_upload(p, files[p], max_bytes, max_pixels) for p in parts] if ref.images is None else
              [decode_b64(f"image_prompts.images[{i}]", t, max_bytes, max_pixels) for i, t in enumerate(ref.images)])
    return {"model": ref.model, "scale": ref.scale, "images": [eight_bit(i).convert("RGB") for i in images]}


def generation_request(info: ModelInfo, config: ServerConfig, params: ImageGenerationRequest,
                        edit: EditInput | None = None, controls: list | tuple = (),
                        image_prompts: dict | None = None, extras: dict | None = None) -> GenerationRequest:
    """Checks the HTTP-only fields of typed parameters, then builds the request (the one validation)."""
    if params.model is not None and params.model != info.name:
        raise APIError(400, f"model {params.model!r} is not served here; this server serves {info.name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if params.response_format not in ("b64_json", "url"):
        raise APIError(400, f"response_format {params.response_format!r} is unknown; allowed: b64_json, url",
                       param="response_format")
    if params.controls and not controls:  # not decoded by the route (a batch job's item): its images are base64
        controls = decode_controls(params.controls, config.max_image_bytes, config.max_image_pixels)
    if params.image_prompts is not None and image_prompts is None:
        image_prompts = decode_image_prompt(params.image_prompts, config.max_image_bytes, config.max_image_pixels)
    kwargs = params.request_params(info.default_steps)
    if kwargs["prompt_syntax"] is None:
        kwargs["prompt_syntax"] = config.prompt_syntax
    if kwargs["clip_skip"] is None:
        kwargs["clip_skip"] = config.clip_skip
    check_prompt_bytes(config.max_prompt_bytes, prompt=params.prompt, negative_prompt=kwargs["negative_prompt"])
    try:
        require_prompt(params.prompt, edit)  # OpenAI's API requires a prompt; an edit has its image to go on
        return GenerationRequest.create(params.prompt, request_id=f"img-{secrets.token_hex(8)}", model=info,
                                        image=edit, controls=controls, image_prompts=image_prompts, extras=extras,
                                        **kwargs)
    except ParamError as e:
        raise error_from_param_error(e, info.extension_params) from None
