"""The conditioning routes: `GET /v1/controlnets` (the ControlNets requests' `controls` may name: the
`--controlnet-dir` folder's and the model's built-in ones), `POST /v1/controlnets/preview` (a control image through
its preprocessor and resize mode, as the engine will prepare it: the playground shows it before generating) and
`GET /v1/ip-adapters` (the IP-Adapters an `image_prompts` may name). All torch-free: the preview runs
control_maps.py (OpenCV for canny, imported then) on a thread.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from ..control_maps import control_map, fit_map
from ..models.controlnet_dir import ControlNetDir
from ..models.presets import builtin_control_folder
from ..models.ip_adapter_dir import IPAdapterDir
from ..request import MAX_CONTROLS, MAX_PROMPT_IMAGES, ControlInput, ParamError
from .bodies import read_json
from ..api.config import ServerConfig
from ..api.protocol import decode_b64, eight_bit
from ..api.protocol import _SIZE, APIError, error_from_param_error, error_from_validation


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


def control_router(config: ServerConfig, prompt_limit: int) -> tuple[APIRouter, int]:
    """The routes, and how many images a generations body may carry beside its prompt (control maps where the server
    has ControlNets, image prompts where it has IP-Adapters)."""
    roots = tuple(r for r in (config.controlnet_dir, builtin_control_folder(config.model)) if r)
    catalog = ControlNetDir(*roots) if roots else None
    adapters = IPAdapterDir(config.ip_adapter_dir) if config.ip_adapter_dir else None
    limit = prompt_limit + 4 * (config.max_image_bytes // 3 + 2)
    router = APIRouter()

    @router.get("/v1/ip-adapters")
    async def ip_adapters() -> Response:
        """The IP-Adapters image prompts may name (`image_prompts: {"model", "images", "scale"}`)."""
        names = await asyncio.to_thread(adapters.listing) if adapters is not None else {}
        return JSONResponse({"object": "list", "data": [{"name": n} for n in names]})

    @router.get("/v1/controlnets")
    async def controlnets() -> Response:
        """The ControlNets requests may name (`controls: [{"model", "image", "scale", "start", "end", ...}]`)."""
        rows = await asyncio.to_thread(catalog.describe) if catalog is not None else []
        return JSONResponse({"object": "list", "data": rows,
                             "max_controlnets": config.max_controlnets if catalog is not None else 0})

    @router.post("/v1/controlnets/preview")
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

    return router, (MAX_CONTROLS if catalog is not None else 0) + (MAX_PROMPT_IMAGES if adapters is not None else 0)


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
