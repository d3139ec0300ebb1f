"""The ControlNet routes (issue 32): `GET /v1/controlnets` (the ControlNets requests' `controls` may name: the
`--controlnet-dir` folder's and the model's built-in ones) and `POST /v1/controlnets/preview` (a control image
through its preprocessor and resize mode, as the engine will prepare it: the playground shows it before
generating). Both are torch-free: the preview runs control_maps.py (OpenCV for canny, imported then) on a thread.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from ..control_maps import control_map, fit_map
from ..models.controlnet_dir import ControlNetDir
from ..models.presets import builtin_control_folder
from ..request import MAX_CONTROLS, ControlInput, ParamError
from .bodies import read_json
from .config import ServerConfig
from .edits import decode_b64, eight_bit
from .protocol import _SIZE, APIError, error_from_param_error, error_from_validation


class ControlPreviewBody(BaseModel):
    """POST /v1/controlnets/preview: a control's image and how its map is made, and the output size (WxH; default:
    the image's own size)."""

    model_config = ConfigDict(extra="forbid")

    image: StrictStr
    preprocess: StrictStr = "none"
    canny_low: StrictInt = 100
    canny_high: StrictInt = 200
    resize_mode: StrictStr | StrictInt = "just_resize"
    size: StrictStr | None = None


def add_control_routes(app: FastAPI, config: ServerConfig, prompt_limit: int) -> bool:
    """Mounts the routes on `app`; True where the server has ControlNets (requests may carry control images)."""
    roots = tuple(r for r in (config.controlnet_dir, builtin_control_folder(config.model)) if r)
    catalog = ControlNetDir(*roots) if roots else None
    limit = prompt_limit + MAX_CONTROLS * 4 * (config.max_image_bytes // 3 + 2)

    @app.get("/v1/controlnets")
    async def controlnets() -> Response:
        """The ControlNets requests may name (`controls: [{"model", "image", "scale", "start", "end", ...}]`)."""
        rows = await asyncio.to_thread(catalog.describe) if catalog is not None else []
        return JSONResponse({"object": "list", "data": rows,
                             "max_controlnets": config.max_controlnets if catalog is not None else 0})

    @app.post("/v1/controlnets/preview")
    async def preview(http: Request) -> Response:
        """The control map a control would get: {"image": base64 PNG, "width", "height"}."""
        try:
            try:
                body = ControlPreviewBody.model_validate(await read_json(http, limit))
            except ValidationError as e:
                raise error_from_validation(e) from None
            return JSONResponse(await asyncio.to_thread(_preview, body, config))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    return catalog is not None


def _preview(body: ControlPreviewBody, config: ServerConfig) -> dict[str, Any]:
    from PIL import Image
    image = eight_bit(decode_b64("image", body.image, config.max_image_bytes, config.max_image_pixels)).convert("RGB")
    width, height = image.size
    if body.size is not None:
        m = _SIZE.match(body.size)
        if m is None:
            raise APIError(400, f"size {body.size!r} must look like WIDTHxHEIGHT, e.g. 512x512", param="size")
        width, height = int(m.group(1)), int(m.group(2))
        if not (8 <= width <= 8192 and 8 <= height <= 8192) or width * height > config.max_image_pixels:
            raise APIError(400, f"size {body.size!r} is out of range; each side 8-8192 and at most "
                                f"{config.max_image_pixels} pixels", param="size")
    try:
        control = ControlInput(model="preview", image=image, preprocess=body.preprocess, canny_low=body.canny_low,
                               canny_high=body.canny_high, resize_mode=body.resize_mode)
        pixels = fit_map(control_map(control), width, height, control.resize_mode)
    except ParamError as e:
        raise error_from_param_error(e) from None
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return {"object": "control_map", "width": width, "height": height,
            "image": base64.b64encode(out.getvalue()).decode("ascii")}
