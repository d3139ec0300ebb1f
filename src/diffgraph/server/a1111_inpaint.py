"""The pixels of an AUTOMATIC1111 img2img request, before and after the engine: base64 images
read within the upload limits (edits.py's checks), flattened and resized by `resize_mode`, the mask read as
AUTOMATIC1111 reads it (an alpha channel with transparency is the mask, opaque = repaint; else its gray levels,
white = repaint), inverted, blurred (`mask_blur_x` / `_y`, a Gaussian of that standard deviation), the masked area
pre-filled from its surroundings (`inpainting_fill` 0), and "inpaint only masked" (`inpaint_full_res`): the mask's
bounding box plus `inpaint_full_res_padding`, grown to the requested width:height and clamped to the image, is cut
out and generated at the full requested size, then scaled back and pasted in. Every inpainting result is laid over
the input by the blurred mask (`PreparedEdit.finish`), so pixels outside the mask come back unchanged.

Pure numpy and Pillow, run on a worker thread (a1111.py), never on the event loop or the engine's loop. What the
engine gets is an `EditInput` (request_inputs.py) at the processing size; what comes back is composited here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter, ImageOps

from ..request import EditInput, ParamError
from .a1111_protocol import Img2ImgBody, a1111_error
from ..api.protocol import eight_bit
from ..api.protocol import APIError

Box = tuple[int, int, int, int]  # (left, top, right, bottom) pixels, right and bottom exclusive (PIL's crop box)


@dataclass(frozen=True)
class MaskOptions:
    """How one request's mask is used (its img2img fields)."""

    blur_x: int = 4
    blur_y: int = 4
    invert: bool = False
    fill: bool = True           # inpainting_fill 0: the masked area starts from its surroundings' colours
    full_res: bool = True       # inpaint_full_res: only the masked area, at the full requested size
    padding: int = 0            # inpaint_full_res_padding, pixels around the mask's box
    resize_mode: int = 0        # 0 resize, 1 crop and resize, 2 resize and fill


@dataclass(frozen=True, eq=False)
class PreparedEdit:
    """One init image ready for the engine, and how its result goes back."""

    edit: EditInput                  # what the engine denoises, at the processing size
    width: int
    height: int
    base: np.ndarray | None = None   # uint8 [H, W, 3]: the image the result is laid over (None: returned as it is)
    weight: np.ndarray | None = None  # float32 [H, W] in 0..1: how much of the generated image each pixel takes
    box: Box | None = None           # inpaint_full_res: where the generated crop goes back in `base`
    warning: str | None = None

    def finish(self, generated: np.ndarray) -> np.ndarray:
        """The answer's pixels (uint8 [H, W, 3]) from the engine's (uint8 [height, width, 3])."""
        if self.base is None or self.weight is None:
            return generated
        layer = self.base.astype(np.float32)
        if self.box is not None:
            x1, y1, x2, y2 = self.box
            crop = Image.fromarray(generated).resize((x2 - x1, y2 - y1), Image.Resampling.LANCZOS)
            layer[y1:y2, x1:x2] = np.asarray(crop, dtype=np.float32)
        else:
            layer = generated.astype(np.float32)
        w = self.weight[..., None]
        out = self.base.astype(np.float32) * (1 - w) + layer * w
        return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def flatten(image: Image.Image) -> Image.Image:
    """RGB, transparent pixels laid on white (AUTOMATIC1111's img2img background)."""
    image = eight_bit(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        out = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        out.alpha_composite(rgba)
        return out.convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, mode: int, width: int, height: int) -> Image.Image:
    """`image` at width x height: 0 stretched, 1 scaled to cover and centre-cropped, 2 scaled to fit, centred, the
    rest filled by repeating its edge pixels."""
    if image.size == (width, height):
        return image
    if mode == 0:
        return image.resize((width, height), Image.Resampling.LANCZOS)
    if image.mode in ("P", "CMYK"):  # np.pad below keeps the values, not the palette (a palette mask read as gray)
        image = image.convert("RGB")
    w, h = image.size
    scale = max(width / w, height / h) if mode == 1 else min(width / w, height / h)
    sw, sh = max(1, round(w * scale)), max(1, round(h * scale))
    scaled = image.resize((sw, sh), Image.Resampling.LANCZOS)
    left, top = (sw - width) // 2, (sh - height) // 2
    if mode == 1:
        return scaled.crop((left, top, left + width, top + height))
    pixels = np.asarray(scaled)
    pad_y, pad_x = height - sh, width - sw
    pads = ((pad_y // 2, pad_y - pad_y // 2), (pad_x // 2, pad_x - pad_x // 2)) + ((0, 0),) * (pixels.ndim - 2)
    return Image.fromarray(np.pad(pixels, pads, mode="edge"))


def read_mask(image: Image.Image, invert: bool) -> Image.Image:
    """An L mask, white = repaint: a transparent-alpha image's alpha thresholded (opaque = repaint), else its gray."""
    if image.mode in ("RGBA", "LA") and image.getextrema()[-1] != (255, 255):
        mask = image.getchannel("A").point(lambda a: 255 if a > 128 else 0)
    else:
        mask = eight_bit(image).convert("L")
    return ImageOps.invert(mask) if invert else mask


def blur(mask: Image.Image, blur_x: int, blur_y: int) -> Image.Image:
    if blur_x <= 0 and blur_y <= 0:
        return mask
    return mask.filter(ImageFilter.GaussianBlur((max(blur_x, 0), max(blur_y, 0))))


def _grow(lo: int, hi: int, want: int, limit: int) -> tuple[int, int]:
    """[lo, hi) widened about its middle to `want` (at most `limit`), shifted back inside [0, limit)."""
    want = min(max(want, hi - lo), limit)
    lo -= (want - (hi - lo)) // 2
    lo = min(max(lo, 0), limit - want)
    return lo, lo + want


def crop_box(mask: Image.Image, padding: int, width: int, height: int) -> Box | None:
    """The mask's bounding box plus `padding`, grown to the width:height aspect and kept inside the image; None for a
    blank mask."""
    box = mask.getbbox()
    if box is None:
        return None
    w, h = mask.size
    x1, y1 = max(box[0] - padding, 0), max(box[1] - padding, 0)
    x2, y2 = min(box[2] + padding, w), min(box[3] + padding, h)
    if (x2 - x1) * height < (y2 - y1) * width:  # too narrow for the aspect: widen
        x1, x2 = _grow(x1, x2, round((y2 - y1) * width / height), w)
    else:
        y1, y2 = _grow(y1, y2, round((x2 - x1) * height / width), h)
    return x1, y1, x2, y2


def fill(pixels: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The masked pixels (mask 255 = unknown) replaced by the colours around them: weighted means of the known pixels
    over cells of 64, 16, 4 and 1 pixels, each finer level laid over the coarser where it has support."""
    h, w = mask.shape
    known = 1.0 - mask.astype(np.float32) / 255.0
    if known.sum() < 1e-3:
        return pixels
    weighted = pixels.astype(np.float32) * known[..., None]
    out = np.broadcast_to(weighted.sum((0, 1)) / known.sum(), pixels.shape).astype(np.float32)

    def smooth(plane: np.ndarray, cell: int) -> np.ndarray:  # the local mean over cells of `cell` pixels, upsampled
        small = Image.fromarray(plane).resize((max(1, w // cell), max(1, h // cell)), Image.Resampling.BOX)
        return np.asarray(small.resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)

    for cell in (64, 16, 4, 1):
        support = smooth(known, cell)
        level = np.stack([smooth(np.ascontiguousarray(weighted[..., c]), cell) for c in range(3)], -1)
        level /= np.maximum(support, 1e-6)[..., None]
        alpha = np.clip(support * 4, 0, 1)[..., None]
        out = level * alpha + out * (1 - alpha)
    out = pixels * known[..., None] + out * (1 - known[..., None])
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def mask_options(body: Img2ImgBody) -> MaskOptions:
    """The mask fields of a body (AUTOMATIC1111's defaults for nulls), checked."""
    blur_x, blur_y = (body.mask_blur, body.mask_blur) if body.mask_blur is not None else (
        4 if body.mask_blur_x is None else body.mask_blur_x, 4 if body.mask_blur_y is None else body.mask_blur_y)
    padding = body.inpaint_full_res_padding or 0
    for field, value in (("mask_blur", blur_x), ("mask_blur", blur_y), ("inpaint_full_res_padding", padding)):
        if not 0 <= value <= 256:
            raise APIError(400, f"{field} {value} is out of range; allowed: 0..256 pixels", param=field)
    if body.inpainting_mask_invert not in (None, 0, 1):
        raise APIError(400, "inpainting_mask_invert must be 0 (repaint the masked area) or 1 (the rest)",
                       param="inpainting_mask_invert")
    return MaskOptions(blur_x=blur_x, blur_y=blur_y, invert=body.inpainting_mask_invert == 1,
                       fill=body.inpainting_fill in (None, 0),
                       full_res=True if body.inpaint_full_res is None else bool(body.inpaint_full_res),
                       padding=padding, resize_mode=body.resize_mode or 0)


def _edit(pixels: np.ndarray, mask: np.ndarray | None, strength: float) -> EditInput:
    try:
        return EditInput(image=np.ascontiguousarray(pixels), mask=mask, strength=strength)
    except ParamError as e:
        raise a1111_error(e) from None


def prepare(image: Image.Image, mask: Image.Image | None, options: MaskOptions, width: int, height: int,
            strength: float) -> PreparedEdit:
    """One init image (and the request's mask) as the engine's input at width x height, and how its result goes
    back (see the module doc)."""
    image = flatten(image)
    if mask is None:
        return PreparedEdit(_edit(np.asarray(resize(image, options.resize_mode, width, height)), None, strength),
                            width, height)
    if options.full_res:
        full = read_mask(mask.resize(image.size, Image.Resampling.BILINEAR) if mask.size != image.size else mask,
                         options.invert)
        full = blur(full, options.blur_x, options.blur_y)
        box = crop_box(full, options.padding, width, height)
        if box is None:
            pixels = np.asarray(resize(image, options.resize_mode, width, height))
            return PreparedEdit(_edit(pixels, None, strength), width, height,
                                warning="the mask is blank, so inpaint_full_res ran image-to-image on the whole image")
        crop = resize(image.crop(box), 2, width, height)
        crop_mask = np.asarray(resize(full.crop(box), 2, width, height))
        pixels = fill(np.asarray(crop), crop_mask) if options.fill else np.asarray(crop)
        return PreparedEdit(_edit(pixels, crop_mask, strength), width, height, base=np.asarray(image),
                            weight=np.asarray(full, dtype=np.float32) / 255.0, box=box)
    image = resize(image, options.resize_mode, width, height)
    sized = blur(read_mask(resize(mask, options.resize_mode, width, height), options.invert), options.blur_x,
                 options.blur_y)
    repaint = np.asarray(sized)
    pixels = fill(np.asarray(image), repaint) if options.fill else np.asarray(image)
    # AUTOMATIC1111 lays the input back over the result by the blurred mask doubled (the edge leans to the result)
    weight = np.clip(repaint.astype(np.float32) * 2, 0, 255) / 255.0
    return PreparedEdit(_edit(pixels, repaint, strength), width, height, base=np.asarray(image), weight=weight)
