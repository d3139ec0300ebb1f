"""AUTOMATIC1111's scripts that run here, by `script_name` and `script_args` as its API takes them: "SD upscale" on
img2img (its scripts/sd_upscale.py). The init image is upscaled by an upscaler (upscalers.py's built-ins, or a model
of --upscaler-dir: upscaler_models.py), cut into
tiles of the request's width x height that overlap, each tile an image-to-image row of one request (all queued
together, so they batch), and the results pasted back with the overlaps blended; each of `n_iter` passes makes one
image. Also GET /sdapi/v1/scripts' and /script-info's answers.

    script_args: [info (ignored), overlap (pixels, default 64), upscaler (name or index in GET /sdapi/v1/upscalers,
                  default "None"), scale (default 2.0)]

Pure Pillow on the caller's thread; a1111.py calls these on a worker thread and sizes the work before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from ..api.protocol import APIError
from ..upscalers import ModelUpscalers, TileGrid, UpscalerError, all_upscalers, split_tiles, tile_count, upscale, \
    upscaled_size, upscaler_name
from .a1111_protocol import SD_UPSCALE

MAX_SCALE = 8.0  # the most an SD upscale may enlarge (AUTOMATIC1111's slider ends at 4)


@dataclass(frozen=True)
class SdUpscale:
    """The SD upscale script's arguments."""

    overlap: int = 64
    upscaler: str = "None"
    scale: float = 2.0

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The upscaled size of a width x height init image (the image the tiles cover)."""
        return (width, height) if self.upscaler == "None" else upscaled_size(width, height, self.scale)

    def tiles(self, width: int, height: int, tile_w: int, tile_h: int) -> int:
        """How many tiles of tile_w x tile_h a width x height init image makes."""
        w, h = self.size(width, height)
        return tile_count(max(w, tile_w), max(h, tile_h), tile_w, tile_h, self.overlap)

    def grid(self, image: Image.Image, tile_w: int, tile_h: int, models: ModelUpscalers | None = None) -> TileGrid:
        """The init image (RGB) upscaled (`models`: the model upscalers) and cut into tiles (an image smaller than a
        tile is laid on black, so every tile is whole)."""
        if self.upscaler != "None":
            image = upscale(image, self.upscaler, self.scale, models)
        if image.width < tile_w or image.height < tile_h:
            canvas = Image.new("RGB", (max(image.width, tile_w), max(image.height, tile_h)))
            canvas.paste(image, (0, 0))
            image = canvas
        return split_tiles(image, tile_w, tile_h, self.overlap)

    def params(self) -> dict[str, Any]:
        """The infotext entries AUTOMATIC1111 adds for the script."""
        return {"SD upscale overlap": self.overlap, "SD upscale upscaler": self.upscaler}


def tile_seeds(seed: int, tiles: int, batch_size: int, n_iter: int) -> tuple[int, ...]:
    """The seed of each tile, pass after pass, as the script gives them: pass n starts at seed + n, its tiles go
    batch_size at a time, each batch starting one above the last batch's first seed, seed + j within it."""
    return tuple(seed + n + i // batch_size + i % batch_size for n in range(n_iter) for i in range(tiles))


def sd_upscale(script_name: str | None, args: list[Any] | None, width: int, height: int,
               models: ModelUpscalers | None = None) -> SdUpscale | None:
    """The SD upscale script a body asks for (None when it names no script), or an APIError naming the argument to
    change (`width` x `height`: the tile size; `models`: the model upscalers it may name, looked up in their folder:
    a worker thread)."""
    if not script_name or script_name.strip().lower() != SD_UPSCALE:
        return None
    args = list(args or [])
    defaults = ["", 64, "None", 2.0]
    if len(args) > len(defaults):
        raise APIError(400, f"script_args has {len(args)} values; SD upscale takes {len(defaults)}: [info, overlap, "
                            "upscaler, scale]", param="script_args")
    _, overlap, upscaler, scale = args + defaults[len(args):]
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or overlap != int(overlap) \
            or not 0 <= overlap < min(width, height):
        raise APIError(400, f"script_args[1] (overlap) must be whole pixels in 0..{min(width, height) - 1} (below "
                            f"the tile's {width}x{height}), got {overlap!r}", param="script_args")
    if isinstance(upscaler, int) and not isinstance(upscaler, bool):
        names = all_upscalers(models)
        if not 0 <= upscaler < len(names):
            raise APIError(400, f"script_args[2] (upscaler) index {upscaler} is not in 0..{len(names) - 1} "
                                f"({', '.join(names)})", param="script_args")
        upscaler = names[upscaler]
    if not isinstance(upscaler, str):
        raise APIError(400, f"script_args[2] (upscaler) must be a name from GET /sdapi/v1/upscalers, got {upscaler!r}",
                       param="script_args")
    try:
        name = upscaler_name(upscaler, "script_args[2]", models)
    except UpscalerError as e:
        raise APIError(400, str(e), param="script_args") from None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= MAX_SCALE:
        raise APIError(400, f"script_args[3] (scale) must be a factor above 0 and at most {MAX_SCALE:g}, got "
                            f"{scale!r}", param="script_args")
    return SdUpscale(int(overlap), name, float(scale))


def script_lists() -> dict[str, list[str]]:
    """GET /sdapi/v1/scripts: the scripts a body may name, per route."""
    return {"txt2img": [], "img2img": [SD_UPSCALE]}


def script_info(models: ModelUpscalers | None = None) -> list[dict[str, Any]]:
    """GET /sdapi/v1/script-info: AUTOMATIC1111's ScriptInfo of each script (its arguments, their defaults and
    ranges; the upscalers `models` adds among the choices)."""
    def arg(label: str | None, value: Any, minimum: Any = None, maximum: Any = None, step: Any = None,
            choices: list[str] | None = None) -> dict[str, Any]:
        return {"label": label, "value": value, "minimum": minimum, "maximum": maximum, "step": step,
                "choices": choices}
    return [{"name": SD_UPSCALE, "is_alwayson": False, "is_img2img": True, "args": [
        arg(None, "Will upscale the image by the selected scale factor; use width and height sliders to set tile "
                  "size"),
        arg("Tile overlap", 64, 0, 256, 16), arg("Upscaler", "None", choices=list(all_upscalers(models))),
        arg("Scale Factor", 2.0, 1.0, 4.0, 0.05)]}]
