"""POST /v1/images/edits: OpenAI's multipart form (image, optional mask, prompt, n, size, response_format, model)
plus the generations endpoint's extensions and `strength`, read into typed parameters and an `EditInput`.

Images are checked before their pixels are decoded: at most --max-image-bytes bytes, and at most
--max-image-pixels pixels read from the header (a decompression bomb is refused before it expands). Masks follow
OpenAI's convention when they have an alpha channel (fully transparent pixels = the region to repaint), and
diffusers' when they do not (white = repaint); without a mask, an image with transparent pixels is inpainted where
it is transparent (as OpenAI does) and an opaque image is an image-to-image request. 16-bit and float grayscale
images (PIL modes I;16, I, F) are scaled to 8 bits, not clipped (see `eight_bit`).

The form's number fields are read as the JSON route reads its body: "2" is 2, "2.0" is 2.0 (so `n` refuses it, as
the JSON route does), "٢" is text.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Json, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator

from ..request import MAX_CONTROLS, MAX_PROMPT_IMAGES, EditInput, ParamError
from .bodies import FormLimits, read_multipart
from .protocol import APIError, ControlRef, ImageGenerationRequest, ImagePromptRef, LoraRef, PreviewBody, error_from_param_error, error_from_validation

FORM_CONTENT = "multipart/form-data"
CONTROL_FILES = tuple(f"control_image_{i}" for i in range(MAX_CONTROLS))  # control i's map, beside `controls`
PROMPT_FILES = tuple(f"image_prompt_{i}" for i in range(MAX_PROMPT_IMAGES))  # the image prompt's images
FILES = ("image", "mask", *CONTROL_FILES, *PROMPT_FILES)
_NON_FINITE = ("nan", "inf", "infinity")


class FormControlRef(ControlRef):
    """A control in the edits form: its map as the file part control_image_<i> or as base64 in `image`."""

    image: StrictStr | None = None


class FormImagePromptRef(ImagePromptRef):
    """The image prompt in the edits form: its images as the file parts image_prompt_<i> or as base64."""

    images: list[StrictStr] | None = None


class ImageEditForm(BaseModel):
    """The form's text fields: the generations request's fields (form values are text: "20" is the integer 20
    here, read as JSON) and `strength`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    n: StrictInt = 1
    size: str | None = None
    response_format: str = "b64_json"
    model: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: StrictInt = 20
    guidance_scale: StrictFloat | None = None   # ints are accepted as numbers
    guidance_interval: Json[list[StrictFloat]] | None = None  # a JSON text field: [0.2, 0.8]
    guidance_rescale: StrictFloat = 0.0
    seed: StrictInt | None = None
    sampler: str | None = None                  # None: the model family's default
    schedule: str | None = None
    output_format: str = "png"
    stream: bool = False
    strength: StrictFloat | None = None
    loras: Json[list[LoraRef]] | None = None  # a JSON text field: [{"name": "styles/ink", "scale": 0.8}]
    prompt_syntax: str | None = None
    clip_skip: StrictInt | None = None
    emphasis: str = "original"
    timestep_spacing: str | None = None
    eta: StrictFloat | None = None
    partial_images: StrictInt | None = None     # OpenAI's: 0-3 previews in the stream
    preview: Json[PreviewBody] | None = None    # a JSON text field: {"every": 2, "format": "jpeg"}
    # a JSON text field: [{"model": "edges", "scale": 0.8}], control i's map in the file part control_image_<i>
    # (or as base64 in its "image")
    controls: Json[list[FormControlRef]] | None = None
    # a JSON text field: {"model": "sd15/ip-adapter_sd15", "scale": 0.6}, its images the file parts image_prompt_<i>
    image_prompt: Json[FormImagePromptRef] | None = None

    @field_validator("n", "num_inference_steps", "guidance_scale", "guidance_rescale", "seed", "strength",
                     "clip_skip", "eta", "partial_images", mode="before")
    @classmethod
    def _json_number(cls, value: Any) -> Any:
        """A number's text as the JSON route parses it (then checked by the same strict types), and nan / inf in
        any case (refused by the range checks, naming the range); other text is left as it came, to be refused
        naming the field."""
        if not isinstance(value, str):
            return value
        if value.strip().lower().lstrip("+-") in _NON_FINITE:
            return float(value)
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else value

    def generation(self) -> ImageGenerationRequest:
        """The same fields as a generations request (for the shared checks and request building)."""
        return ImageGenerationRequest.model_construct(**self.model_dump(exclude={"strength", "loras", "preview",
                                                                                 "controls", "image_prompt"}),
                                                      loras=self.loras, preview=self.preview)


async def read_form(http: Any, max_image_bytes: int) -> tuple[ImageEditForm, dict[str, bytes]]:
    """The parsed form: its text fields (typed) and the bytes of its files, read within their limits as they
    arrive (bodies.py). Raises APIError (400 / 413)."""
    content_type = http.headers.get("content-type", "")
    if not content_type.startswith(FORM_CONTENT):
        raise APIError(400, f"this endpoint takes {FORM_CONTENT} (OpenAI's images.edit: the image as a file part "
                            f"'image', an optional 'mask', and the text fields), not {content_type or 'no body type'}; "
                            "for text-to-image, POST JSON to /v1/images/generations", code="invalid_content_type")
    # the body: an image and a mask at the limit, and the text fields
    limits = FormLimits(body_bytes=len(FILES) * max_image_bytes + 1_048_576, file_names=FILES,
                        file_bytes=max_image_bytes, flag="--max-image-bytes")
    fields: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    for name, value in await read_multipart(http, limits):
        if name in files or name in fields:
            raise APIError(400, f"{name} is given more than once; send one", param=name)
        if isinstance(value, bytes):  # an upload
            if name not in FILES:
                raise APIError(400, f"unexpected file part {name!r}; files: {', '.join(FILES)}", param=name)
            files[name] = value
        elif name in FILES:
            raise APIError(400, f"{name} must be a file part (an uploaded image), not a text field", param=name)
        else:
            fields[name] = value
    try:
        return ImageEditForm.model_validate(fields), files
    except ValidationError as e:
        raise error_from_validation(e, ImageEditForm) from None


def decode_upload(name: str, data: bytes | None, max_bytes: int, max_pixels: int) -> Any:
    """A PIL image, its size checked from the header before its pixels are decoded."""
    from PIL import Image

    if not data:
        raise APIError(400, f"{name} is empty; upload a PNG, JPEG or WebP image", param=name)
    if len(data) > max_bytes:
        raise APIError(400, f"{name} has {len(data)} bytes; the limit is {max_bytes} (--max-image-bytes)",
                       param=name, code="image_too_large")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise APIError(400, f"{name} declares too many pixels (a decompression bomb?); the limit is {max_pixels}",
                       param=name, code="image_too_large") from None
    except Exception:
        raise APIError(400, f"{name} is not an image this server can read; upload a PNG, JPEG or WebP",
                       param=name) from None
    width, height = image.size
    if width * height > max_pixels:
        raise APIError(400, f"{name} is {width}x{height} ({width * height} pixels); the limit is {max_pixels} "
                            "(--max-image-pixels)", param=name, code="image_too_large")
    try:
        image.load()
    except Exception as e:
        raise APIError(400, f"{name} could not be decoded ({type(e).__name__}); upload an intact PNG, JPEG or WebP",
                       param=name) from None
    return image


def _alpha(image: Any) -> np.ndarray | None:
    """The alpha channel (uint8 [H, W]) of an image that has one, else None."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return np.asarray(image.convert("RGBA"))[..., 3]
    return None


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


def edit_arrays(image: Any, mask: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(RGB pixels, mask or None) of PIL images under the conventions in the module doc (the CLI uses it too)."""
    if mask is not None:
        alpha = _alpha(mask)
        mask_array = (np.where(alpha == 0, 255, 0).astype(np.uint8) if alpha is not None
                      else np.asarray(eight_bit(mask).convert("L")))
    else:
        alpha = _alpha(image)
        mask_array = None
        if alpha is not None and (alpha == 0).any():  # transparent pixels: inpaint them (OpenAI)
            mask_array = np.where(alpha == 0, 255, 0).astype(np.uint8)
    return np.asarray(eight_bit(image).convert("RGB")), mask_array


def edit_input(files: dict[str, bytes], strength: float | None, defaults: tuple[float, float], max_bytes: int,
               max_pixels: int) -> EditInput:
    """The EditInput of the form's files (see the module doc for the mask conventions)."""
    if "image" not in files:
        raise APIError(400, "image is required: upload the image to edit as the file part 'image'", param="image")
    image = decode_upload("image", files["image"], max_bytes, max_pixels)
    mask = decode_upload("mask", files["mask"], max_bytes, max_pixels) if "mask" in files else None
    rgb, mask_array = edit_arrays(image, mask)
    if strength is None:
        strength = defaults[1] if mask_array is not None else defaults[0]
    try:
        return EditInput(image=rgb, mask=mask_array, strength=strength)
    except ParamError as e:
        raise error_from_param_error(e) from None


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
    """A body's `image_prompt` with its images decoded (GenerationRequest.create checks the rest): base64 in its
    `images`, or (the edits form) the file parts image_prompt_<i>."""
    files = files or {}
    parts = [p for p in PROMPT_FILES if p in files]
    if ref is None:
        if parts:
            raise APIError(400, f"file part {parts[0]} has no image_prompt field; add one ({{\"model\": ...}}), or "
                                "leave the part out", param=parts[0])
        return None
    if (ref.images is None) == (not parts):
        raise APIError(400, "image_prompt needs its images once: as the file parts image_prompt_0, image_prompt_1 or "
                            "as base64 in its images field", param="image_prompt.images")
    images = ([decode_upload(p, files[p], max_bytes, max_pixels) for p in parts] if ref.images is None else
              [decode_b64(f"image_prompt.images[{i}]", t, max_bytes, max_pixels) for i, t in enumerate(ref.images)])
    return {"model": ref.model, "scale": ref.scale, "images": [eight_bit(i).convert("RGB") for i in images]}
