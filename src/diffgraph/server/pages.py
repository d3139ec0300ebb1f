"""What the playground page reads: its static files (shipped in the package, no CDN, no build step), `/info`
(the model, its defaults and what a request may ask for: its family's samplers, schedules and size multiple) and
`/status` (the engine's state as JSON). The same state as /metrics, for a person instead of a scraper. And the
listings of the adapters and embeddings requests may name (GET /v1/loras, /v1/embeddings and their /sdapi/v1
forms), bounded in time."""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

from fastapi.responses import FileResponse, JSONResponse, Response

from ..config import DEFAULT_BUCKETS, FP8_MIN_FEATURES
from ..request import MAX_IMAGES, MAX_STEPS, OUTPUT_FORMATS
from ..api.protocol import APIError, ImageGenerationRequest

LISTING_BOUND_S = 90.0  # past the engine's own per-read limit (lora.manager.READ_TIMEOUT_S)

PLAYGROUND = os.path.join(os.path.dirname(os.path.abspath(__file__)), "playground")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}


DOC_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8",
              "favicon.png": "image/png"}


def add_docs(app: Any, secured: bool = False, protect_metrics: bool = False) -> None:
    """GET /docs: FastAPI's Swagger UI with its script and styles served here, from the fastapi-offline package's
    copy of Swagger UI 5 (FastAPI's default loads them from a CDN: offline the page stayed blank; the
    swagger-ui-bundle package's Swagger UI 4 cannot read OpenAPI 3.1, FastAPI's schema, and rendered nothing). URLs
    are relative, so a mounted app (root_path) works too. With API keys (`secured`) the page and its schema stay
    public (auth.py) and the schema declares the keys as security schemes, Bearer and Basic, on every operation
    that needs one: Swagger UI's "Authorize" button takes the key and its calls send it."""
    from importlib.resources import files

    if secured:
        schema = app.openapi  # FastAPI's: builds the schema once and keeps it on the app

        def secured_schema() -> dict[str, Any]:
            if app.openapi_schema is None:
                _declare_keys(schema(), protect_metrics)
            return app.openapi_schema
        app.openapi = secured_schema

    from fastapi.openapi.docs import get_swagger_ui_html

    static = files("fastapi_offline") / "static"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="openapi.json", title=f"{app.title} API",
                                   swagger_js_url="docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="docs/assets/swagger-ui.css",
                                   swagger_favicon_url="docs/assets/favicon.png")

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        if name not in DOC_ASSETS:
            return JSONResponse({"error": {"message": f"no docs file {name!r}", "type": "not_found_error",
                                           "param": None, "code": None}}, status_code=404)
        return Response((static / name).read_bytes(), media_type=DOC_ASSETS[name],
                        headers={"Cache-Control": "public, max-age=86400"})


def _declare_keys(schema: dict[str, Any], protect_metrics: bool) -> None:
    """The API keys in an OpenAPI schema (in place): the two schemes and each operation's requirement."""
    from .auth import guarded

    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key of this server"},
        "basic": {"type": "http", "scheme": "basic",
                  "description": "any user name, an API key as the password (as AUTOMATIC1111's clients send it)"}}
    for path, operations in schema.get("paths", {}).items():
        needed = [{"bearer": []}, {"basic": []}] if guarded(path, protect_metrics) else []
        for operation in operations.values():
            operation["security"] = needed


def playground_file(name: str) -> Response:
    """One of the playground's files by its bare name (nothing outside its folder can be named)."""
    ext = os.path.splitext(name)[1]
    path = os.path.join(PLAYGROUND, name)
    if not re.fullmatch(r"[A-Za-z0-9_-]+\.[a-z]+", name) or ext not in CONTENT_TYPES or not os.path.isfile(path):
        return JSONResponse({"error": {"message": f"no playground file {name!r}", "type": "not_found_error",
                                       "param": None, "code": None}}, status_code=404)
    return FileResponse(path, media_type=CONTENT_TYPES[ext], headers={"Cache-Control": "no-cache"})


def _size(h: int, w: int) -> str:
    return f"{w}x{h}"


def server_info(state: Any) -> dict[str, Any]:
    config, engine = state.config, state.engine
    info = engine.info if engine is not None else None
    # the sizes with CUDA graphs: none on an eager (CPU) engine
    resolutions = [] if info is None or info.mode != "graph" else (
        [_size(h, w) for h, w in config.resolutions] or [_size(info.native_size, info.native_size)])
    return {
        "model": info.name if info else config.model, "ready": state.ready,
        "family": info.family if info else None, "mode": info.mode if info else None,
        "native_size": info.native_size if info else None,
        "default_guidance": info.default_guidance if info else None,
        "guidance": info.guidance if info else None, "capabilities": list(info.capabilities) if info else None,
        # the capabilities' request parameters (body fields beside the images API's own), and those taking images
        "extension_params": list(info.extension_params) if info else None,
        "extension_images": list(info.extension_images) if info else None,
        # the most images each of those takes and what they are called (the playground refuses more before sending)
        "image_limits": {name: {"max": most, "items": items} for name, most, items in info.image_limits}
        if info else None,
        "default_steps": info.default_steps if info is not None and info.default_steps is not None else
        ImageGenerationRequest.model_fields["num_inference_steps"].default,
        "max_images": min(MAX_IMAGES, info.max_rows if info else max(config.batch_buckets or DEFAULT_BUCKETS)),
        # the model family's names and sizes (unknown until the model is loaded)
        "max_steps": MAX_STEPS, "samplers": list(info.samplers) if info else None,
        "schedules": list(info.schedules) if info else None,
        "default_sampler": info.default_sampler if info else None,
        "default_schedule": info.default_schedule if info else None,
        "size_multiple": info.size_multiple if info else None,
        "output_formats": list(OUTPUT_FORMATS), "graphed_resolutions": resolutions,
        "batch_buckets": list(config.batch_buckets), "max_prompt_bytes": config.max_prompt_bytes,
        "auth_required": bool(config.api_keys),
        "edits": bool(info.edits) if info else None, "edit_strength": list(info.edit_strength) if info else None,
        "max_image_bytes": config.max_image_bytes, "max_image_pixels": config.max_image_pixels,
        "compile": config.compile, "quantize": config.quantize,
        "quantize_min_features": (None if config.quantize == "none" else
                                  config.quantize_min_features or FP8_MIN_FEATURES),  # the engines' tiers (every replica's the same)
    }


def server_status(state: Any, routing: Any = None) -> dict[str, Any]:
    """GET /status; with --model-dir (`routing`, server/models.py), a row per resident model and replica too."""
    out = _engine_status(state)
    if routing is not None:
        out["models"] = [{**row, "live_rows": {_size(h, w): n for (h, w), n in sorted(row.get("live_rows", {}).items())
                                               }} for row in routing.models.status()]
    return out


def _engine_status(state: Any) -> dict[str, Any]:
    engine = state.engine
    recent = list(state.metrics.recent_steps)
    out: dict[str, Any] = {"ready": state.ready, "draining": state.draining, "inflight": state.inflight,
                           "error": state.error, "step_ms_last": round(recent[-1] * 1e3, 2) if recent else None,
                           "step_ms_mean": round(sum(recent) / len(recent) * 1e3, 2) if recent else None}
    if engine is None:
        return {**out, "queue_depth": 0, "live_rows": {}, "steps": 0, "graph_buckets": []}
    stats = engine.stats()
    captured = sorted({r["bucket"] for r in stats.graphs if r["kind"] == "step" and r["status"] == "captured"})
    return {**out, "queue_depth": stats.queue_depth, "steps": stats.steps,
            "live_rows": {_size(h, w): n for (h, w), n in sorted(stats.live_rows.items())},
            "graph_buckets": captured}


def folder_listing(config: Any, family: str | None) -> dict[str, Any]:
    """GET /v1/loras where the engines live in other processes: the adapters of --lora-dir from their files'
    headers (rank, targets; `loaded` unknown: each replica has its own slots)."""
    from ..config import LoraConfig
    from ..lora.catalog import AdapterDir, describe

    if not config.lora_dir:
        return {"data": [], "unusable": [], "ignored": [], "max_loras": 0, "max_lora_rank": 0}
    folder = AdapterDir(config.lora_dir)
    listing = folder.listing()
    data, unusable = [], []
    for name, path in listing.adapters.items():
        try:
            data.append({"name": name, **describe(path), "family": family, "loaded": None, "source": "lora_dir"})
        except Exception as e:  # a truncated or foreign file: listed as unusable, with why
            unusable.append({"name": name, "error": f"{type(e).__name__}: {e}"})
    return {"data": data, "unusable": unusable, "ignored": listing.ignored,
            "max_loras": LoraConfig(config.lora_dir, config.max_loras).slots, "max_lora_rank": config.max_lora_rank}


async def lora_listing(state: Any, model: str | None = None, routing: Any = None) -> dict[str, Any]:
    """The LoRA adapters requests may name, with `model`'s (a --model-dir model; `routing`: server/models.py) slots
    and family where it is not the default. Listings read adapter headers only (an engine caches them per file
    version and reads on its own file pool); a listing that a stalled disk holds past the bound is a 503 (APIError);
    an unknown model a 404 naming `model`."""
    engine = state.require_engine()
    other = model is not None and model != (routing.default if routing is not None else engine.info.name)
    if other and routing is None:
        raise APIError(404, f"model {model!r} is not served here: this server serves {engine.info.name!r} (GET "
                            "/v1/models)", param="model", code="model_not_found")
    name = await routing.resolve(model) if other else None
    try:
        if name is not None:  # a resident model's own slots, else the folder with that model's family
            listing = await asyncio.wait_for(asyncio.to_thread(routing.models.loras, name), LISTING_BOUND_S)
            family = None if listing is not None else await asyncio.to_thread(routing.family, name)
        else:
            listing = await asyncio.wait_for(asyncio.to_thread(engine.loras), LISTING_BOUND_S)
            family = engine.info.family if engine.info else None
        if listing is None:  # replicas in other processes: what the folder holds, from the files' headers
            listing = await asyncio.wait_for(asyncio.to_thread(folder_listing, state.config, family), LISTING_BOUND_S)
    except TimeoutError:
        raise APIError(503, f"listing the adapters took longer than {LISTING_BOUND_S:g} s (a slow or stalled disk "
                            "under --lora-dir?); retry", code="lora_listing_timeout") from None
    return listing


async def embedding_listing(embedding_dir: Any) -> dict[str, Any]:
    """The textual-inversion embeddings of --embeddings-dir (an `EmbeddingDir`, or None), from their headers; a 503
    (APIError) past the bound."""
    if embedding_dir is None:
        return {"embeddings": [], "ignored": []}
    try:
        return await asyncio.wait_for(asyncio.to_thread(embedding_dir.listing), LISTING_BOUND_S)
    except TimeoutError:
        raise APIError(503, f"listing the embeddings took longer than {LISTING_BOUND_S:g} s (a slow or stalled disk "
                            "under --embeddings-dir?); retry", code="embedding_listing_timeout") from None
