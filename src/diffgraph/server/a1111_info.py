"""AUTOMATIC1111's information and housekeeping routes (v1.10's modules/api/api.py), answered in its shapes from what
diffgraph has; the image routes, options and progress are a1111.py's, which includes this router.

    POST /sdapi/v1/png-info            a base64 image's infotext, split as AUTOMATIC1111's parse_generation_parameters
    GET  /sdapi/v1/sd-vae              the --vae given, else none
    GET  /sdapi/v1/cmd-flags           the server's settings under AUTOMATIC1111's flag names (no key, no absolute path)
    GET  /sdapi/v1/memory              this process's RAM (/proc) and the engine's CUDA figures where it reports them
    GET  /sdapi/v1/latent-upscale-modes  AUTOMATIC1111's list
    GET  /sdapi/v1/prompt-styles       the --styles file's styles (read at start), else none
    GET  /sdapi/v1/script-info         the scripts a body may name (a1111_scripts.py)
    GET  /sdapi/v1/hypernetworks, /face-restorers, /realesrgan-models   none here
    POST /sdapi/v1/refresh-checkpoints, /refresh-loras, /refresh-embeddings, /refresh-vae   the listings re-read
    POST /sdapi/v1/reload-checkpoint, /unload-checkpoint   nothing to do: models load and go on demand

Nothing here imports torch: the engine's figures come from its stats, on a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable

from fastapi import APIRouter, Depends, Request, params
from fastapi.responses import JSONResponse, Response

from ..hires import LATENT_MODES
from ..image_metadata import PNG_KEY, infotext_parts, read_texts
from ..prompt_styles import StyleBook
from ..upscalers import ModelUpscalers
from .a1111_scripts import script_info
from .bodies import read_body
from ..api.config import ServerConfig
from .models import ModelRouting
from .pages import embedding_listing, lora_listing
from ..api.protocol import APIError
from .requests import ServerState
from ..api.protocol import decode_b64

if TYPE_CHECKING:
    from ..text.embeddings import EmbeddingDir

LATENT_UPSCALE_MODES = tuple(LATENT_MODES)  # AUTOMATIC1111's shared.latent_upscale_modes, in its order
# image.info keys AUTOMATIC1111's read_info_from_image drops from png-info's `items` (format details, not text)
IGNORED_INFO_KEYS = frozenset({"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "exif", "loop",
                               "background", "timestamp", "duration", "progressive", "progression", "icc_profile",
                               "chromaticity", "photoshop"})
_SIZE = re.compile(r"^(\d+)x(\d+)$")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InfoSources:
    """What these routes read: the server, its model routing (--model-dir), its embeddings folder and its styles
    (--styles)."""

    state: ServerState
    routing: ModelRouting | None
    embedding_dir: EmbeddingDir | None
    styles: StyleBook | None = None
    upscalers: ModelUpscalers | None = None  # --upscaler-dir's models (script-info's upscaler choices)


def shown_path(path: str | None) -> str | None:
    """A path as the API may show it: relative to the working folder when under it, else its last component."""
    if not path:
        return path
    full = os.path.abspath(path)
    here = os.getcwd()
    return os.path.relpath(full, here) if full.startswith(here + os.sep) else os.path.basename(full.rstrip(os.sep))


def png_info(image: Any) -> dict[str, Any]:
    """AUTOMATIC1111's PNGInfoResponse of a decoded image: its infotext, the other texts it carries and the
    infotext's parameters (strings, "Size-1"/"Size-2" beside a size), read by the linear-time infotext reader."""
    text, _ = read_texts(image)
    items = {k: v for k, v in (image.info or {}).items()
             if isinstance(k, str) and isinstance(v, str) and k not in IGNORED_INFO_KEYS and k != PNG_KEY}
    if not text:
        return {"info": "", "items": items, "parameters": {}}
    prompt, negative, params = infotext_parts(text)
    parameters: dict[str, Any] = {"Prompt": prompt, "Negative prompt": negative or ""}
    for key, value in params.items():
        parameters[key] = value
        size = _SIZE.match(value)
        if size:
            parameters[f"{key}-1"], parameters[f"{key}-2"] = size.group(1), size.group(2)
    return {"info": text, "items": items, "parameters": parameters}


def cmd_flags(state: ServerState) -> dict[str, Any]:
    """The server's settings under AUTOMATIC1111's flag names, where it has one (its FlagsModel's keys); folders
    relative, and no API key, key file or webhook secret."""
    c = state.config
    device = c.device or ""
    return {"ckpt": shown_path(c.model), "ckpt_dir": shown_path(c.model_dir), "vae_path": shown_path(c.vae),
            "lora_dir": shown_path(c.lora_dir), "embeddings_dir": shown_path(c.embeddings_dir),
            "styles_file": [shown_path(c.styles)] if c.styles else [],
            "controlnet_dir": shown_path(c.controlnet_dir), "esrgan_models_path": shown_path(c.upscaler_dir),
            "port": c.port, "server_name": c.host,
            "listen": c.host in ("0.0.0.0", "::"), "api": True, "api_log": c.access_log,
            "api_auth": None, "device_id": device.split(":", 1)[1] if device.startswith("cuda:") else None,
            "no_half": c.dtype in ("fp32", "float32"), "use_cpu": ["all"] if device == "cpu" else [],
            "skip_torch_cuda_test": device == "cpu", "api_server_stop": False}


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's fields, in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def ram() -> dict[str, Any]:
    """AUTOMATIC1111's `ram` section: this process's resident set (`used`), the machine's memory (`total`) and the
    rest (`free`), as its psutil figures are; its error shape where /proc cannot be read."""
    try:
        total = _meminfo()["MemTotal"]
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"free": total - used, "used": used, "total": total}


def cuda(state: ServerState) -> dict[str, Any]:
    """AUTOMATIC1111's `cuda` section. The engine reports the device bytes it allocated, not the allocator's
    statistics AUTOMATIC1111 lists (system, active, reserved, inactive, events): its error shape, naming the figure
    the engine does report; "unavailable" (AUTOMATIC1111's word) on the CPU."""
    info = state.info
    if info is None or not info.device.startswith("cuda") or state.engine is None:
        return {"error": "unavailable"}
    try:
        stats = state.engine.stats()
    except Exception as e:  # a replica not answering: AUTOMATIC1111's error shape, as for a failed torch call
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": f"the engine reports no CUDA allocator statistics; it has {stats.device_memory_bytes} bytes "
                     "allocated on its devices (diffgraph_device_memory_bytes in /metrics)"}


def vae_items(state: ServerState) -> list[dict[str, Any]]:
    """AUTOMATIC1111's SDVaeItem list: the --vae given (named, not a path on the server), else none."""
    vae = state.config.vae
    if not vae:
        return []
    name = os.path.basename(vae.rstrip("/" + os.sep))
    return [{"model_name": name.rsplit(".", 1)[0] if os.path.splitext(name)[1] else name, "filename": name}]


def info_router(sources: InfoSources) -> APIRouter:
    """The routes of the module doc, reading `sources` (each route's dependency)."""
    router = APIRouter(prefix="/sdapi/v1")

    def get_sources() -> InfoSources:
        return sources

    _add_reads(router, Depends(get_sources))
    _add_refreshes(router, Depends(get_sources))
    return router


async def _answer(work: Awaitable[Any]) -> Response:
    try:
        return JSONResponse(await work)
    except APIError as e:
        return JSONResponse(e.body(), status_code=e.status)


async def read_object(http: Request, config: ServerConfig, images: int = 1) -> dict[str, Any]:
    """A JSON object body of at most `images` base64 images within --max-image-bytes (and a little text), read
    within the body timeout and parsed on a worker thread; an APIError saying what to send otherwise."""
    seconds = min(config.body_timeout, config.request_timeout)
    try:
        raw = await asyncio.wait_for(read_body(http, images * 4 * (config.max_image_bytes // 3 + 2) + 4096), seconds)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {seconds:g} s; send the whole body at once",
                       code="body_timeout") from None
    return await asyncio.to_thread(_json_object, raw)


async def _png_info(http: Request, config: ServerConfig) -> dict[str, Any]:
    """POST /png-info's answer: the body within --max-image-bytes of base64, its image checked as the other routes'
    images are (bytes, then pixels from the header) before it is decoded, on a worker thread."""
    body = await read_object(http, config)
    image = body.get("image")
    if not isinstance(image, str) or not image.strip():
        raise APIError(400, "image is required: a base64 PNG (or JPEG, WebP) with its parameters", param="image")
    return await asyncio.to_thread(lambda: png_info(decode_b64("image", image.strip(), config.max_image_bytes,
                                                               config.max_image_pixels)))


def _add_reads(router: APIRouter, sources: params.Depends) -> None:
    """png-info and the GET routes (`sources`: the InfoSources dependency)."""
    @router.post("/png-info")
    async def post_png_info(http: Request, s: InfoSources = sources) -> Response:
        return await _answer(_png_info(http, s.state.config))

    @router.get("/sd-vae")
    async def sd_vae(s: InfoSources = sources) -> list[dict[str, Any]]:
        return vae_items(s.state)

    @router.get("/cmd-flags")
    async def get_cmd_flags(s: InfoSources = sources) -> dict[str, Any]:
        return cmd_flags(s.state)

    @router.get("/memory")
    async def memory(s: InfoSources = sources) -> dict[str, Any]:
        return {"ram": await asyncio.to_thread(ram), "cuda": await asyncio.to_thread(cuda, s.state)}

    @router.get("/latent-upscale-modes")
    async def latent_upscale_modes() -> list[dict[str, str]]:
        return [{"name": name} for name in LATENT_UPSCALE_MODES]

    @router.get("/prompt-styles")
    async def prompt_styles(s: InfoSources = sources) -> list[dict[str, str]]:
        return s.styles.listing() if s.styles is not None else []

    @router.get("/script-info")
    async def get_script_info(s: InfoSources = sources) -> list[dict[str, Any]]:
        return await asyncio.to_thread(script_info, s.upscalers)  # the upscaler folder is listed off the loop

    for path in ("/hypernetworks", "/face-restorers", "/realesrgan-models"):
        router.add_api_route(path, _none, methods=["GET"])  # none of these exist here


def _add_refreshes(router: APIRouter, sources: params.Depends) -> None:
    """The POST routes that re-list or (un)load: AUTOMATIC1111 answers null and {} (`sources`: the dependency)."""
    @router.post("/refresh-checkpoints")
    async def refresh_checkpoints(s: InfoSources = sources) -> Response:
        async def work() -> None:  # the listing re-reads the folder (by version)
            if s.routing is not None:
                await asyncio.to_thread(s.routing.listing, s.state.created)
        return await _answer(work())

    @router.post("/refresh-loras")
    async def refresh_loras(s: InfoSources = sources) -> Response:
        async def work() -> None:
            await lora_listing(s.state)
        return await _answer(work())

    @router.post("/refresh-embeddings")
    async def refresh_embeddings(s: InfoSources = sources) -> Response:
        async def work() -> None:
            await embedding_listing(s.embedding_dir)
        return await _answer(work())

    @router.post("/refresh-vae")
    async def refresh_vae() -> None:
        return None  # --vae is one file, read at start

    @router.post("/reload-checkpoint")
    async def reload_checkpoint() -> dict[str, Any]:
        return {}  # the served model stays loaded; --model-dir's load on demand

    @router.post("/unload-checkpoint")
    async def unload_checkpoint() -> dict[str, Any]:
        logger.info("POST /sdapi/v1/unload-checkpoint: nothing unloaded (the served model stays loaded; --model-dir "
                    "models go when --max-models or --model-memory needs their room)")
        return {}


async def _none() -> list[Any]:
    return []


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON ({e}); send {{\"image\": \"<base64 PNG>\", ...}}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object: {\"image\": \"<base64 PNG>\", ...}")
    return body
