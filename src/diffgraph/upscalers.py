"""Image upscalers by AUTOMATIC1111's names, and its rules for using them: the built-in "None", "Lanczos" and
"Nearest", and model upscalers (`ModelUpscalers`: upscaler_models.py reads ESRGAN-family files from --upscaler-dir;
each rule here takes one, or None for the built-ins alone), `upscale` as its Upscaler.upscale sizes a result (a model
run until the image covers the size, at most 3 times; a multiple of 8 on each side, a last Lanczos resize to reach
it), `postprocess` as its extras tab's upscale step (scale by a factor or to a size, the optional centre crop, a
second upscaler blended in), and the tile grid its "SD upscale" script cuts an image into and pastes back
(`split_tiles`, `combine_tiles`).

Pure Pillow and numpy on the caller's thread (the server calls these on a worker thread); the callers check sizes
against their limits first (`upscaled_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
from PIL import Image

UPSCALERS = ("None", "Lanczos", "Nearest")  # AUTOMATIC1111's built-in upscalers, in its order
_RESAMPLE = {"Lanczos": Image.LANCZOS, "Nearest": Image.NEAREST}


MODEL_PASSES = 3  # AUTOMATIC1111's Upscaler.upscale runs a model at most this often to reach a size


class UpscalerError(ValueError):
    """A request for an upscaler or a size these rules cannot serve; the message says what to send."""


class ModelUpscalers(Protocol):
    """Model upscalers by name (upscaler_models.UpscalerModels)."""

    def names(self) -> Sequence[str]:
        """The models' names, in AUTOMATIC1111's order (after the built-ins)."""
        ...

    def find(self, name: str, field: str) -> str | None:
        """`name` as listed (case-insensitive), None where there is none; an UpscalerError naming `field` where its
        file can never be used (a pickle)."""
        ...

    def enlarge(self, image: Image.Image, name: str) -> Image.Image:
        """`image` (RGB) through the model `name` once: its own scale."""
        ...


def all_upscalers(models: ModelUpscalers | None) -> tuple[str, ...]:
    """Every upscaler a request may name: the built-ins, then the models."""
    return UPSCALERS + (tuple(models.names()) if models is not None else ())


def upscaler_name(name: str | None, field: str, models: ModelUpscalers | None = None) -> str:
    """The upscaler `name` names (case-insensitive, as AUTOMATIC1111's scripts match it; None is "None"), or an
    UpscalerError naming `field` and the upscalers there are."""
    wanted = (name or "None").strip().lower()
    for known in UPSCALERS:
        if known.lower() == wanted:
            return known
    found = models.find((name or "").strip(), field) if models is not None else None
    if found is not None:
        return found
    raise UpscalerError(f"{field}: upscaler {name!r} is not available here; send one of "
                        f"{', '.join(all_upscalers(models))} (GET /sdapi/v1/upscalers; model upscalers: "
                        "--upscaler-dir)")


def _enlarge(image: Image.Image, name: str, scale: float, width: int, height: int,
             models: ModelUpscalers | None) -> Image.Image:
    """`image` enlarged by the upscaler `name` where `scale` > 1: a built-in's resize by `scale`, or a model run until
    the image covers `width` x `height` (at most MODEL_PASSES times); else as it is."""
    if scale <= 1 or name == "None":
        return image
    if name in _RESAMPLE:
        return image.resize((int(image.width * scale), int(image.height * scale)), resample=_RESAMPLE[name])
    if models is None:
        raise UpscalerError(f"upscaler {name!r} is a model, and no model upscalers are served here (--upscaler-dir)")
    for _ in range(MODEL_PASSES):
        if image.width >= width and image.height >= height:
            break
        image = models.enlarge(image, name)
    return image


def upscaled_size(width: int, height: int, scale: float) -> tuple[int, int]:
    """The size AUTOMATIC1111's Upscaler.upscale gives an image: each side times `scale`, down to a multiple of 8."""
    return int(width * scale // 8 * 8), int(height * scale // 8 * 8)


def upscale(image: Image.Image, name: str, scale: float, models: ModelUpscalers | None = None) -> Image.Image:
    """`image` upscaled by `scale` with the upscaler `name` (UPSCALERS, or one of `models`), to `upscaled_size`: the
    upscaler's own resize (a model's passes) when it enlarges, then Lanczos to the exact size where it differs
    ("None", or a scale below 1: that resize alone)."""
    width, height = upscaled_size(image.width, image.height, scale)
    image = _enlarge(image, name, scale, width, height, models)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    return image


def resize_to(image: Image.Image, name: str, width: int, height: int,
              models: ModelUpscalers | None = None) -> Image.Image:
    """`image` at exactly `width` x `height` as AUTOMATIC1111's resize_image (mode 0, "just resize") gives it with the
    upscaler `name` (UPSCALERS, or one of `models`): "None" a Lanczos resize; else, where it enlarges, the upscaler's
    own resize by the larger of the two ratios (a model: `upscale`'s passes), then Lanczos to the exact size where
    that differs."""
    scale = max(width / image.width, height / image.height)
    if name in _RESAMPLE or name == "None":
        image = _enlarge(image, name, scale, width, height, models)
    elif scale > 1:
        image = upscale(image, name, scale, models)
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    return image


@dataclass(frozen=True)
class Postprocess:
    """The extras tab's upscale step (AUTOMATIC1111's ExtrasBaseRequest fields, in their meaning)."""

    to_size: bool = False            # resize_mode 1: to width x height (else by `scale`)
    scale: float = 2.0               # upscaling_resize
    width: int = 512                 # upscaling_resize_w
    height: int = 512                # upscaling_resize_h
    crop: bool = True                # upscaling_crop: to_size's result cut to width x height, centred
    upscaler: str = "None"           # upscaler_1: "None" leaves the image as it is
    second: str = "None"             # upscaler_2, blended in at `second_visibility`
    second_visibility: float = 0.0

    def factor(self, width: int, height: int) -> float:
        """The scale for an image of `width` x `height`."""
        return max(self.width / width, self.height / height) if self.to_size else self.scale

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """The size `postprocess` gives an image of `width` x `height`."""
        if self.upscaler == "None":
            return width, height
        if self.to_size and self.crop:
            return self.width, self.height
        return upscaled_size(width, height, self.factor(width, height))

    def info(self) -> dict[str, str]:
        """AUTOMATIC1111's `Postprocess ...` infotext entries for this step (none when it does nothing)."""
        if self.upscaler == "None":
            return {}
        out = ({"Postprocess upscale to": f"{self.width}x{self.height}"} if self.to_size else
               {"Postprocess upscale by": f"{self.scale:g}"})
        if self.to_size and self.crop:
            out["Postprocess crop to"] = f"{self.width}x{self.height}"
        out["Postprocess upscaler"] = self.upscaler
        if self.second != "None" and self.second_visibility > 0:
            out["Postprocess upscaler 2"] = self.second
        return out


def postprocess(image: Image.Image, step: Postprocess, models: ModelUpscalers | None = None) -> Image.Image:
    """`image` (RGB) after the extras tab's upscale step, as AUTOMATIC1111 runs it (`models`: the model upscalers
    the step may name)."""
    if step.upscaler == "None":
        return image
    factor = step.factor(image.width, image.height)

    def one(name: str) -> Image.Image:
        out = upscale(image, name, factor, models)
        if step.to_size and step.crop:
            cropped = Image.new("RGB", (step.width, step.height))
            cropped.paste(out, box=(step.width // 2 - out.width // 2, step.height // 2 - out.height // 2))
            out = cropped
        return out

    result = one(step.upscaler)
    if step.second != "None" and step.second_visibility > 0:
        result = Image.blend(result, one(step.second).convert(result.mode), step.second_visibility)
    return result


@dataclass(frozen=True)
class Tile:
    x: int
    y: int
    image: Image.Image


@dataclass(frozen=True)
class TileGrid:
    """An image cut into tiles of tile_w x tile_h that overlap by `overlap` pixels, row by row
    (AUTOMATIC1111's images.split_grid)."""

    tiles: tuple[tuple[Tile, ...], ...]  # rows, top to bottom; each left to right
    tile_w: int
    tile_h: int
    width: int
    height: int
    overlap: int

    def flat(self) -> list[Tile]:
        return [tile for row in self.tiles for tile in row]


def tile_count(width: int, height: int, tile_w: int, tile_h: int, overlap: int) -> int:
    """How many tiles `split_tiles` cuts a width x height image into."""
    cols = math.ceil((width - overlap) / (tile_w - overlap))
    rows = math.ceil((height - overlap) / (tile_h - overlap))
    return max(cols, 1) * max(rows, 1)


def split_tiles(image: Image.Image, tile_w: int, tile_h: int, overlap: int) -> TileGrid:
    """`image` cut as AUTOMATIC1111's split_grid cuts it: evenly spaced tiles, the last of each row and column flush
    with the edge (0 <= overlap < the tile's sides)."""
    w, h = image.size
    cols = max(math.ceil((w - overlap) / (tile_w - overlap)), 1)
    rows = max(math.ceil((h - overlap) / (tile_h - overlap)), 1)
    dx = (w - tile_w) / (cols - 1) if cols > 1 else 0
    dy = (h - tile_h) / (rows - 1) if rows > 1 else 0
    grid = []
    for row in range(rows):
        y = int(row * dy)
        y = h - tile_h if y + tile_h >= h else y
        line = []
        for col in range(cols):
            x = int(col * dx)
            x = w - tile_w if x + tile_w >= w else x
            line.append(Tile(x, y, image.crop((x, y, x + tile_w, y + tile_h))))
        grid.append(tuple(line))
    return TileGrid(tuple(grid), tile_w, tile_h, w, h, overlap)


def combine_tiles(grid: TileGrid, images: list[Image.Image]) -> Image.Image:
    """The grid's image with its tiles replaced by `images` (in `flat` order), each overlap blended by a linear ramp
    (AUTOMATIC1111's combine_grid)."""
    o = grid.overlap
    ramp = np.arange(o, dtype=np.float32) * 255 / max(o, 1)
    mask_w = Image.fromarray(np.repeat(ramp.reshape(1, o), grid.tile_h, axis=0).astype(np.uint8), "L") if o else None
    mask_h = Image.fromarray(np.repeat(ramp.reshape(o, 1), grid.width, axis=1).astype(np.uint8), "L") if o else None
    out = Image.new("RGB", (grid.width, grid.height))
    pictures = iter(images)
    for row in grid.tiles:
        y, h = row[0].y, grid.tile_h
        line = Image.new("RGB", (grid.width, h))
        for tile in row:
            picture = next(pictures).convert("RGB")
            if tile.x == 0 or not o:
                line.paste(picture, (tile.x, 0))
                continue
            line.paste(picture.crop((0, 0, o, h)), (tile.x, 0), mask=mask_w)
            line.paste(picture.crop((o, 0, grid.tile_w, h)), (tile.x + o, 0))
        if y == 0 or not o:
            out.paste(line, (0, y))
            continue
        out.paste(line.crop((0, 0, line.width, o)), (0, y), mask=mask_h)
        out.paste(line.crop((0, o, line.width, h)), (0, y + o))
    return out
