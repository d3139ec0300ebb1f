"""The server's own state, for probes, scrapers and the playground page:

    GET  /health              200 while the server can serve (loading, draining included); 503 with the reason once
                              it cannot until it restarts: its engine failed to start, or fewer than --min-ready
                              replicas are left that can serve (the others left down after repeated crashes, or an
                              in-process engine whose loop stopped)
    GET  /ready               200 once the engine is built, its prewarm graphs captured and one warm-up image made;
                              503 before, and while draining
    GET  /info                the model, its defaults and what a request may ask for (the playground's form)
    GET  /status              the state as JSON, for the playground's status panel
    GET  /                    the playground page (playground/), unless --no-playground; its files under /playground/
    GET  /metrics             Prometheus text (metrics.py)

What these answer is pages.py's and metrics.py's; this module only routes.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ..api.protocol import APIError
from .context import AppContext, error_response
from .pages import playground_file, server_info, server_status


def pages_router(ctx: AppContext) -> APIRouter:
    """The routes of the module doc, over `ctx` (the playground's only with `config.playground`)."""
    state = ctx.state
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        down = state.down
        body = {"status": "down" if down else "ok", "ready": state.ready, "draining": state.draining}
        return JSONResponse({**body, "error": down}, status_code=503) if down else JSONResponse(body)

    @router.get("/ready")
    async def ready() -> Response:
        try:
            engine = state.require_engine()
        except APIError as e:
            return error_response(e)
        body = {"status": "ready", "model": engine.info.name, "mode": engine.info.mode,
                "ready_s": round(engine.info.ready_s, 3)}
        body["replicas"] = engine.replica_states()
        return JSONResponse(body)

    @router.get("/info")
    async def info() -> Response:
        return JSONResponse(server_info(state))

    @router.get("/status")
    async def status() -> Response:
        return JSONResponse(await asyncio.to_thread(server_status, state, ctx.routing))

    if state.config.playground:
        @router.get("/", include_in_schema=False)
        async def playground_page() -> Response:
            return playground_file("index.html")

        @router.get("/playground/{name}", include_in_schema=False)
        async def playground_asset(name: str) -> Response:
            return playground_file(name)

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=content_type)

    return router
