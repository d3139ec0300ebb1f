"""The FastAPI app: OpenAI-shaped image generation over one `Engine`, its routes grouped in routers.

    /v1/images/*                  generations, edits, variations and stored images (image_routes.py)
    /v1/models, /v1/loras, /v1/embeddings   what requests may name (model_routes.py)
    /v1/controlnets*, /v1/ip-adapters       the conditioning models and the control map preview (control_routes.py)
    /sdapi/v1/*, /controlnet/*    AUTOMATIC1111's API: txt2img, img2img, models, samplers, progress ... (a1111.py)
    /v1/jobs*                     batch jobs that survive restarts, with --state-dir (jobs_routes.py, jobs/)
    /health, /ready, /info, /status, /metrics, the playground   the server's own state (page_routes.py)
    /docs                         Swagger UI from local files (pages.py)
With API keys (auth.py), /v1/* and /sdapi/v1/* need the key (and /metrics, /status with --protect-metrics); /docs
and its schema stay public, the schema declaring the keys (pages.py), so the page's calls carry one.

`create_app` returns at once; the engine is built on a background thread when the app starts, so the
server listens (and answers /health, /ready with 503) while the model loads and graphs are captured.
Bodies are read within their limits as they arrive (bodies.py: 413 at the limit, chunked or not) and within
--body-timeout; connections themselves (idle, slow heads and bodies, how many, how many a client) are bounded
below the app (connections.py).
The app talks to the engine only through the `EngineClient` protocol (engine/client.py). Each router factory
receives the `AppContext` (context.py: the server state, the model routing, the API keys, the embeddings folder)
and keeps no state of its own beyond what it builds from it. docs/ARCHITECTURE.md traces one request through the
modules (tests/test_trace.py counts the crossings).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api.config import ServerConfig
from ..api.protocol import APIError
from ..engine.remote_models import ModelSetSpec, ModelsBackend, RemoteModels
from ..text.embeddings import EmbeddingDir
from .a1111 import a1111_router
from .auth import APIKeyMiddleware
from .context import AppContext, error_response
from .control_routes import control_router
from .image_routes import images_router
from .image_store import ImageLinks, UrlSigner, make_store
from .jobs_routes import JobService, jobs_router
from .metrics import ModelCollector
from .model_routes import models_router
from .models import ModelRouting
from .page_routes import pages_router
from .pages import add_docs
from .requests import ServerState, logger


def _replicas(config: ServerConfig, spec: ModelSetSpec | None, remote: ModelsBackend | None) -> Callable[[], Any]:
    """The default engine factory: the engine in its own process, one per device (one code path for one GPU and
    many); with --model-dir each replica holds a model set of its own (on its device)."""
    def engine_factory():
        from ..engine.replica import ReplicaClient
        from ..engine.router import Router
        devices = config.devices or (config.device,)
        threads = max(1, config.resolved_torch_threads() // max(1, sum(d in ("cpu", None) for d in devices)))
        replicas = [ReplicaClient(d, config.engine_kwargs(), torch_threads=threads,
                                  name=f"{d}#{i}" if devices.count(d) > 1 else d,
                                  replica_timeout=config.replica_timeout, measure_step=config.max_pixels is None,
                                  models=spec) for i, d in enumerate(devices)]
        router = Router(replicas, min_ready=config.min_ready)
        if isinstance(remote, RemoteModels):
            remote.router = router
        return router
    return engine_factory


def _lifespan(state: ServerState, jobs: JobService) -> Callable[[FastAPI], Any]:
    """The app's start and stop: the engine built on a background thread, the jobs' coordinator."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        await jobs.start()
        yield
        await jobs.stop()  # before the engine closes: its requests are aborted, their candidates stay pending
        await asyncio.to_thread(state.close)
    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as the API's JSON error body: FastAPI's own (404, 405 ...) and unhandled ones (500)."""
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


def create_app(config: ServerConfig, engine_factory: Callable[[], Any] | None = None,
               models: ModelsBackend | None = None) -> FastAPI:
    """The app for `config`. `engine_factory` builds the engine client (default: a Router over one replica process
    per device of `config.devices`, or one for `config.device`, which with `model_dir` holds the model set). A
    factory may return an in-process `Engine` (tests, embedding); with `model_dir` a factory comes with the
    `models` backend its engine processes answer (Ray's, ray_ingress.py)."""
    # --model-dir: the set lives in the engine's processes, the server routes by name (server/models.py)
    remote = RemoteModels() if config.model_dir and engine_factory is None else models
    if config.model_dir and remote is None:
        raise ValueError("model_dir with an engine factory needs the models backend of its engine processes")
    spec = config.model_set()
    engine_factory = engine_factory or _replicas(config, spec, remote)
    routing = ModelRouting(config.model_dir, config.model, remote) if config.model_dir and remote is not None else None
    state = ServerState(config, engine_factory, on_close=routing.close if routing else None)
    if routing is not None:
        state.metrics.registry.register(ModelCollector(
            lambda: [(r.name, r.memory_bytes, r.client.in_flight()) for r in routing.models.resident()],
            routing.models.loading))
    body_limit = 8 * config.max_prompt_bytes + 65536  # JSON may escape each byte as \u00XX
    links = ImageLinks(make_store(config.image_store, config.image_ttl, config.image_store_bytes),
                       UrlSigner(config.api_keys) if config.api_keys else None, config.public_url)
    # a generations body with controls or image prompts may carry their images
    controls, images = control_router(config, body_limit)
    body_limit += images * 4 * (config.max_image_bytes // 3 + 2)
    ctx = AppContext(state, routing, tuple(k.encode() for k in config.api_keys),
                     EmbeddingDir(config.embeddings_dir) if config.embeddings_dir else None)
    routers = [pages_router(ctx), models_router(ctx), controls, images_router(ctx, links, body_limit),
               a1111_router(ctx)]
    jobs_routes, jobs = jobs_router(ctx)  # the job store and coordinator, started and stopped by the lifespan
    app = FastAPI(title="diffgraph", version="0.1.0", lifespan=_lifespan(state, jobs), docs_url=None, redoc_url=None,
                  description="OpenAI-shaped image generation on CUDA graphs with step-level batching")
    add_docs(app, bool(config.api_keys), config.protect_metrics)  # Swagger UI at /docs from local files (pages.py)
    app.state.server = state
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect_metrics=config.protect_metrics)
    _add_error_handlers(app)
    for router in (*routers, jobs_routes):
        app.include_router(router)
    return app
