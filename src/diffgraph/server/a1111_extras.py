"""AUTOMATIC1111's extras routes (v1.10's /sdapi/v1/extra-single-image and /extra-batch-images): its upscale step on
one image or a list, with the built-in upscalers (upscalers.py: None, Lanczos, Nearest) and --upscaler-dir's models
(upscaler_models.py), and GET /sdapi/v1/upscalers listing them in its UpscalerItem shape.

    POST /sdapi/v1/extra-single-image   {"image": base64, ...}       -> {"html_info", "image"}
    POST /sdapi/v1/extra-batch-images   {"imageList": [{"data", "name"}], ...} -> {"html_info", "images"}

Bodies are read as AUTOMATIC1111's models read them (values coerced, unknown keys ignored and named in the answer's
header); face restoration (GFPGAN, CodeFormer) is out of scope here, so a visibility above 0 is a 400 naming it.
Each answer's PNG carries the input's text chunks and AUTOMATIC1111's `postprocessing` text. Images are decoded,
upscaled and encoded on a worker thread; a result above --max-image-pixels is refused before any work.
"""

from __future__ import annotations

import asyncio
import base64
import html
import io
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image, PngImagePlugin
from pydantic import BaseModel, ConfigDict, ValidationError

from ..api.config import ServerConfig
from ..api.protocol import APIError, decode_b64, error_from_validation
from ..upscalers import UPSCALERS, ModelUpscalers, Postprocess, UpscalerError, postprocess, upscaler_name
from ..upscaler_models import UpscalerModels
from .a1111_info import read_object
from .a1111_protocol import names_header

MAX_BATCH_IMAGES = 8  # extra-batch-images: images a request may carry (each within --max-image-bytes)
MAX_SCALE = 8.0       # upscaling_resize: AUTOMATIC1111's slider ends at 8


class ExtrasBody(BaseModel):
    """AUTOMATIC1111's ExtrasBaseRequest (its field names and defaults)."""

    model_config = ConfigDict(extra="allow")

    resize_mode: int | None = 0            # 0: by upscaling_resize, 1: to upscaling_resize_w x _h
    show_extras_results: bool | None = True
    gfpgan_visibility: float | None = 0.0
    codeformer_visibility: float | None = 0.0
    codeformer_weight: float | None = 0.0
    upscaling_resize: float | None = 2.0
    upscaling_resize_w: int | None = 512
    upscaling_resize_h: int | None = 512
    upscaling_crop: bool | None = True
    upscaler_1: str | None = "None"
    upscaler_2: str | None = "None"
    extras_upscaler_2_visibility: float | None = 0.0
    upscale_first: bool | None = False

    def step(self, models: ModelUpscalers | None = None) -> Postprocess:
        """The upscale step this body asks for (`models`: the model upscalers it may name), or an APIError naming the
        field to change (a worker thread: a model's name is looked up in its folder)."""
        for field in ("gfpgan_visibility", "codeformer_visibility"):
            if (getattr(self, field) or 0) > 0:
                raise APIError(400, f"{field}: face restoration (GFPGAN, CodeFormer) is out of scope for diffgraph; "
                                    "send 0", param=field, code="unsupported_parameter")
        mode = 0 if self.resize_mode is None else self.resize_mode
        if mode not in (0, 1):
            raise APIError(400, f"resize_mode {mode} is not one of AUTOMATIC1111's: send 0 (scale by "
                                "upscaling_resize) or 1 (to upscaling_resize_w x upscaling_resize_h)",
                           param="resize_mode")
        scale = 2.0 if self.upscaling_resize is None else self.upscaling_resize
        if mode == 0 and not 0 < scale <= MAX_SCALE:
            raise APIError(400, f"upscaling_resize {scale:g} is out of range; send a factor above 0 and at most "
                                f"{MAX_SCALE:g}", param="upscaling_resize")
        width, height = self.upscaling_resize_w or 512, self.upscaling_resize_h or 512
        if mode == 1 and min(width, height) < 8:
            raise APIError(400, f"upscaling_resize_w x upscaling_resize_h {width}x{height} is too small; send at least "
                                "8 on each side", param="upscaling_resize_w")
        visibility = self.extras_upscaler_2_visibility or 0.0
        if not 0 <= visibility <= 1:
            raise APIError(400, f"extras_upscaler_2_visibility {visibility:g} is out of range; send 0..1",
                           param="extras_upscaler_2_visibility")
        try:
            first = upscaler_name(self.upscaler_1, "upscaler_1", models)
            second = upscaler_name(self.upscaler_2, "upscaler_2", models)
        except UpscalerError as e:
            raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None
        return Postprocess(to_size=mode == 1, scale=scale, width=width, height=height,
                           crop=self.upscaling_crop is not False, upscaler=first, second=second,
                           second_visibility=visibility)


class ExtrasSingleBody(ExtrasBody):
    image: str | None = ""


class FileData(BaseModel):
    model_config = ConfigDict(extra="allow")

    data: str
    name: str = ""


class ExtrasBatchBody(ExtrasBody):
    imageList: list[FileData] | None = None


def upscaler_items(models: UpscalerModels | None = None) -> list[dict[str, Any]]:
    """GET /sdapi/v1/upscalers: AUTOMATIC1111's UpscalerItem of each built-in upscaler (no model, no file), then of
    each model (its file relative to --upscaler-dir)."""
    return [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4.0}
            for name in UPSCALERS] + (models.entries() if models is not None else [])


def _parse(raw: dict[str, Any], model: type[ExtrasBody]) -> tuple[ExtrasBody, list[str]]:
    try:
        body = model.model_validate(raw)
    except ValidationError as e:
        raise error_from_validation(e, model) from None
    ignored = list(body.__pydantic_extra__ or {})
    return body, ignored


def _run(field: str, text: str, step: Postprocess, config: ServerConfig,
         models: ModelUpscalers | None = None) -> tuple[str, str]:
    """(base64 PNG, infotext) of one image after `step` (a worker thread); a model upscaler that cannot be used is a
    400 naming its field."""
    image = decode_b64(field, text, config.max_image_bytes, config.max_image_pixels)
    width, height = step.output_size(*image.size)
    if width * height > config.max_image_pixels:
        raise APIError(400, f"{field}: the result would be {width}x{height} ({width * height} pixels); the limit is "
                            f"{config.max_image_pixels} (--max-image-pixels): send a smaller upscaling_resize",
                       param="upscaling_resize", code="image_too_large")
    texts = {k: v for k, v in (image.info or {}).items() if isinstance(k, str) and isinstance(v, str)}
    try:
        result = postprocess(image.convert("RGB"), step, models)
    except UpscalerError as e:
        param = "upscaler_1" if f"upscaler {step.upscaler!r}" in str(e) else "upscaler_2"
        raise APIError(400, f"{param}: {e}", param=param) from None
    info = ", ".join(f"{k}: {v}" for k, v in step.info().items())
    if info:
        texts["postprocessing"] = info
    chunks = PngImagePlugin.PngInfo()
    for key, value in texts.items():
        chunks.add_text(key, value)
    out = io.BytesIO()
    result.save(out, format="PNG", pnginfo=chunks if texts else None)
    return base64.b64encode(out.getvalue()).decode("ascii"), info


def _html(info: str) -> str:
    """AUTOMATIC1111's plaintext_to_html of an infotext."""
    return "<p>" + "<br>\n".join(html.escape(line) for line in info.split("\n")) + "</p>"


async def _single(http: Request, config: ServerConfig,
                  models: UpscalerModels | None) -> tuple[dict[str, Any], list[str]]:
    body, ignored = _parse(await read_object(http, config), ExtrasSingleBody)
    step = await asyncio.to_thread(body.step, models)
    if not (body.image or "").strip():
        raise APIError(400, "image is required: a base64 PNG (or JPEG, WebP)", param="image")
    image, info = await asyncio.to_thread(_run, "image", body.image.strip(), step, config, models)
    return {"html_info": _html(info), "image": image}, ignored


async def _batch(http: Request, config: ServerConfig,
                 models: UpscalerModels | None) -> tuple[dict[str, Any], list[str]]:
    body, ignored = _parse(await read_object(http, config, MAX_BATCH_IMAGES), ExtrasBatchBody)
    step = await asyncio.to_thread(body.step, models)
    files = body.imageList or []
    if not files or len(files) > MAX_BATCH_IMAGES:
        raise APIError(400, f"imageList has {len(files)} images; send 1 to {MAX_BATCH_IMAGES} "
                            "({\"data\": base64, \"name\": ...} each)", param="imageList")
    done = [await asyncio.to_thread(_run, f"imageList[{i}].data", f.data, step, config, models)
            for i, f in enumerate(files)]
    return {"html_info": _html(done[-1][1]), "images": [image for image, _ in done]}, ignored


def extras_router(config: ServerConfig, models: UpscalerModels | None = None) -> APIRouter:
    """The routes of the module doc, on `config`'s image limits, with the model upscalers `models`."""
    router = APIRouter(prefix="/sdapi/v1")

    async def answer(work: Any) -> Response:
        try:
            value, ignored = await work
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(value, headers=names_header(ignored))

    @router.post("/extra-single-image")
    async def extra_single_image(http: Request) -> Response:
        return await answer(_single(http, config, models))

    @router.post("/extra-batch-images")
    async def extra_batch_images(http: Request) -> Response:
        return await answer(_batch(http, config, models))

    @router.get("/upscalers")
    async def upscalers() -> list[dict[str, Any]]:
        return await asyncio.to_thread(upscaler_items, models)  # the folder is listed off the event loop

    return router
