"""Images that come with a request, checked before their pixels are decoded (the edits form's uploads, base64 in a
JSON body: the generations route's control maps and image prompts, AUTOMATIC1111's init images, batch jobs' items):
at most --max-image-bytes bytes, and at most --max-image-pixels pixels read from the header (a decompression bomb is
refused before it expands). 16-bit and float grayscale images (PIL modes I;16, I, F) are scaled to 8 bits, not
clipped (`eight_bit`). A refusal is an APIError naming the field.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from ..request import MAX_CONTROLS, MAX_PROMPT_IMAGES
from .protocol import APIError, ControlRef, ImagePromptRef

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
