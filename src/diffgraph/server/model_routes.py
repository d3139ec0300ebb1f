"""The listings of what requests may name:

    GET  /v1/models       the served model (with --model-dir, every model of the folder, resident or not)
    GET  /v1/models/ID    one of them (OpenAI's models.retrieve)
    GET  /v1/loras        the LoRA adapters requests may name (`?model=`: as that model's engine sees them)
    GET  /v1/embeddings   the textual-inversion embeddings a1111-syntax prompts may name

The listings themselves (adapter and embedding headers, bounded in time) are pages.py's; the ControlNets and
IP-Adapters are control_routes.py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..api.protocol import APIError, ModelCard, ModelList
from .context import AppContext, error_response
from .pages import embedding_listing, lora_listing


def models_router(ctx: AppContext) -> APIRouter:
    """The routes of the module doc, over `ctx`."""
    state, routing, config = ctx.state, ctx.routing, ctx.state.config
    router = APIRouter()

    async def cards() -> list[dict[str, Any]]:
        if routing is not None:  # every model of --model-dir, resident or not
            return await asyncio.to_thread(routing.listing, state.created)
        info = state.engine.info if state.engine is not None else None
        if info is None:
            return ModelList(data=[ModelCard(id=config.model, created=state.created)]).model_dump()["data"]
        return ModelList(data=[ModelCard(id=info.name, created=state.created, capabilities=list(info.capabilities),
                                         default_steps=info.default_steps, default_guidance=info.default_guidance,
                                         native_size=info.native_size)]).model_dump()["data"]

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await cards()}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """One card of the listing (OpenAI's `models.retrieve`); a name not served is a 404 naming it."""
        for card in await cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        return error_response(APIError(404, f"model {model_id!r} is not served here (GET /v1/models)",
                                       param="model", code="model_not_found"))

    @router.get("/v1/loras")
    async def loras(model: str | None = None) -> Response:
        """The LoRA adapters requests may name (`loras: [{"name", "scale"}]`), from their headers (pages.py); with
        `?model=`, as that model's engine sees them (a --model-dir model's own slots)."""
        try:
            return JSONResponse({"object": "list", **await lora_listing(state, model, routing)})
        except APIError as e:
            return error_response(e)

    @router.get("/v1/embeddings")
    async def embeddings() -> Response:
        """The textual-inversion embeddings a1111-syntax prompts may name (--embeddings-dir), from their headers."""
        try:
            return JSONResponse({"object": "list", **await embedding_listing(ctx.embedding_dir)})
        except APIError as e:
            return error_response(e)

    return router
