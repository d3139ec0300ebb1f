"""Image analysis routes of AUTOMATIC1111 and its ControlNet extension: `POST /controlnet/detect` (the extension's
preprocessor run alone, for the preprocessors that exist here: "none", "canny", "invert") and `POST /sdapi/v1/
interrogate` (captioning: CLIP and DeepDanbooru need weights this server does not have, so a one-line 404 names it,
as AUTOMATIC1111 answers for a model it lacks).

detect's body, the extension's: `controlnet_module`, `controlnet_input_images` (webuiapi sends
`controlnet_images`: both are read), `controlnet_processor_res` (the map is made at that short side, as the
extension's preprocessors resize before they detect; 0 or less keeps the image's size), `controlnet_threshold_a` /
`_b` (canny's low / high, read as a unit's are: outside 1..255, the slider's default). The answer: {"images": [base64
PNG], "info": "Success"}; an unknown module or no image is the extension's 422, with its message.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..api.config import ServerConfig
from ..api.protocol import APIError, decode_b64, eight_bit, error_from_param_error
from ..request import ControlInput, ParamError
from .a1111_controlnet import MODULES, thresholds
from .a1111_info import read_object

MAX_DETECT_IMAGES = 8


def analysis_router(config: ServerConfig) -> APIRouter:
    """The routes of the module doc, on `config`'s image limits."""
    router = APIRouter()

    @router.post("/controlnet/detect")
    async def detect(http: Request) -> Response:
        try:
            body = await read_object(http, config, MAX_DETECT_IMAGES)
            return JSONResponse(await asyncio.to_thread(detected, body, config))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)

    @router.post("/sdapi/v1/interrogate")
    async def interrogate() -> Response:
        e = APIError(404, "interrogate: no captioning model (clip, deepdanbooru) is served by diffgraph",
                     param="model")
        return JSONResponse(e.body(), status_code=e.status)

    return router


def detected(body: dict[str, Any], config: ServerConfig) -> dict[str, Any]:
    """detect's answer for a parsed body (see the module doc)."""
    module = body.get("controlnet_module", "none")
    if not isinstance(module, str) or module not in MODULES:
        raise APIError(422, f"controlnet_module: module {module!r} not available here; use "
                            f"{', '.join(repr(m) for m in MODULES)}", param="controlnet_module")
    field = "controlnet_input_images" if "controlnet_input_images" in body else "controlnet_images"
    images = body.get(field) or []
    if not isinstance(images, list) or not images:
        raise APIError(422, f"{field}: no image selected (a list of base64 images)", param=field)
    if len(images) > MAX_DETECT_IMAGES:
        raise APIError(400, f"{field}: at most {MAX_DETECT_IMAGES} images a request", param=field)
    res = body.get("controlnet_processor_res", 512)
    low, high = thresholds(module, body.get("controlnet_threshold_a"), body.get("controlnet_threshold_b"))
    return {"images": [_map(f"{field}[{i}]", image, MODULES[module], res, low, high, config)
                       for i, image in enumerate(images)], "info": "Success"}


def _map(field: str, text: Any, module: str, res: Any, low: Any, high: Any, config: ServerConfig) -> str:
    from PIL import Image

    from ..control_maps import control_map
    if not isinstance(text, str):
        raise APIError(400, f"{field}: a base64 image", param=field)
    image = eight_bit(decode_b64(field, text, config.max_image_bytes, config.max_image_pixels)).convert("RGB")
    if isinstance(res, (int, float)) and not isinstance(res, bool) and 0 < res <= 4096:
        scale = res / min(image.size)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                             Image.LANCZOS if scale > 1 else Image.BOX)
    try:
        control = ControlInput(model="detect", image=image, preprocess=module, canny_low=low, canny_high=high)
        pixels = control_map(control)
    except ParamError as e:
        raise error_from_param_error(e) from None
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")
