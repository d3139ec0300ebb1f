"""The FastAPI app: OpenAI-shaped image generation over one `Engine`.

    POST /v1/images/generations   JSON answer, or server-sent events with "stream": true
    POST /v1/images/edits         image-to-image and inpainting: OpenAI's multipart form (edits.py), same answers
    POST /v1/images/variations    image-to-image of an image without a prompt (edits.py), same answers
    GET  /v1/images/files/ID.EXT  an image stored for `response_format: "url"` (image_store.py), until --image-ttl
    GET  /v1/models               the served model
    GET  /v1/loras                the LoRA adapters requests may name
    GET  /v1/controlnets          the ControlNets requests' controls may name
    GET  /v1/embeddings           the textual-inversion embeddings a1111-syntax prompts may name
    GET  /health                  200 while the server can serve (loading, draining included); 503 with the
                                  reason once it cannot until it restarts: its engine failed to start, or fewer
                                  than --min-ready replicas are left that can serve (the others left down after
                                  repeated crashes, or an in-process engine whose loop stopped)
    GET  /ready                   200 once the engine is built, its prewarm graphs captured and one warm-up
                                  image made; 503 before, and while draining
    GET  /metrics                 Prometheus text (metrics.py)
    GET  /status                  the same state as JSON, for the playground's status panel
    GET  /info                    the model, its defaults and what a request may ask for (the playground's form)
    GET  /                        the playground page (playground/), unless --no-playground
    /sdapi/v1/*                   AUTOMATIC1111's API: txt2img, img2img, models, samplers, progress ... (a1111.py)
    /v1/jobs*                     batch jobs that survive restarts, with --state-dir (jobs_routes.py, jobs/)
With API keys (auth.py), /v1/* and /sdapi/v1/* need the key (and /metrics, /status with --protect-metrics); /docs
and its schema stay public, the schema declaring the keys (pages.py), so the page's calls carry one.

`create_app` returns at once; the engine is built on a background thread when the app starts, so the
server listens (and answers /health, /ready with 503) while the model loads and graphs are captured.
Bodies are read within their limits as they arrive (bodies.py: 413 at the limit, chunked or not) and within
--body-timeout; connections themselves (idle, slow heads and bodies, how many, how many a client) are bounded
below the app (connections.py).
The app talks to the engine only through the `EngineClient` protocol (engine/client.py). A generation
request is type-checked (protocol.py), validated once (`GenerationRequest.create` with the model's `ModelInfo`;
its ParamError becomes a 400 naming the body field), submitted (requests.py: the engine's threads do the work; the
event loop only waits on the request's handle), and watched: a client that disconnects or a request that outlives
`request_timeout` is aborted, which frees its rows at the next step boundary. Every request ends in one
outcome counted in the metrics. docs/ARCHITECTURE.md traces one request through the modules (tests/test_trace.py
counts the crossings).
"""

from __future__ import annotations

import asyncio
import base64
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.client import RequestHandle
from ..engine.remote_models import ModelsBackend, RemoteModels
from ..request import GenerationRequest, GenerationResult, ModelInfo, ProgressEvent
from ..text.embeddings import EmbeddingDir
from ..api.config import ServerConfig
from ..api.protocol import (APIError, ImageData, ImageGenerationRequest, ImageGenerationResponse, ModelCard, ModelList,
                       error_from_validation)
from .a1111 import a1111_router
from .auth import APIKeyMiddleware, authorized
from .context import AppContext
from .control_routes import add_control_routes
from .bodies import read_json
from .edits import VARIATION_STRENGTH, ImageEditForm, edit_input, read_form, variation_schema
from ..api.protocol import decode_controls, decode_image_prompt
from .image_store import ImageLinks, UrlSigner, make_store
from .jobs_routes import jobs_router
from .metrics import ModelCollector
from .models import ModelRouting, Target
from .pages import add_docs, embedding_listing, lora_listing, playground_file, server_info, server_status
from . import stream as sse
from ..api.protocol import generation_request
from .requests import (ClientGone, ServerState, abort, logger, outcome, results, submit,
                       syntax_warnings, warnings_header)


# -- request handling ----------------------------------------------------------------------------------
def _response(result: GenerationResult, urls: Callable[[bytes, str], str] | None = None) -> dict[str, Any]:
    """The answer; with `urls` (response_format "url") each image is stored and named by its URL."""
    r = result.request
    fmt = r.output_format
    try:
        data = [ImageData(url=urls(b, fmt)) if urls else ImageData(b64_json=base64.b64encode(b).decode("ascii"))
                for b in result.encoded]
    except ValueError as e:  # the image store cannot take it (full, unwritable)
        raise APIError(507, str(e), code="image_store_full") from None
    return ImageGenerationResponse(
        created=int(time.time()), id=result.request_id, seed=result.seed, output_format=fmt, data=data,
        timings={k: round(v, 3) for k, v in result.timings.items()}).model_dump(exclude_none=True)


def _warned(build: Callable[..., GenerationRequest], *args: Any, **kwargs: Any) -> tuple[GenerationRequest, list[str]]:
    """`build(*args, **kwargs)`'s request and the warnings its prompts earn (a worker thread: text is read off the
    event loop)."""
    request = build(*args, **kwargs)
    return request, syntax_warnings(request)


def _error_response(e: APIError) -> JSONResponse:
    # a body refused while it arrives (too long, too slow): close, rather than read the rest of it to keep the
    # connection
    headers = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (sent, cancelled, or never started)."""

    def __init__(self, content: Any, on_close: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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
    if engine_factory is None:
        def engine_factory():  # the engine in its own process, one per device (one code path for one GPU and many)
            from ..engine.replica import ReplicaClient
            from ..engine.router import Router
            devices = config.devices or (config.device,)
            threads = max(1, config.resolved_torch_threads() // max(1, sum(d in ("cpu", None) for d in devices)))
            replicas = [ReplicaClient(d, config.engine_kwargs(), torch_threads=threads,
                                      name=f"{d}#{i}" if devices.count(d) > 1 else d,
                                      replica_timeout=config.replica_timeout, measure_step=config.max_pixels is None,
                                      models=spec) for i, d in enumerate(devices)]
            router = Router(replicas, min_ready=config.min_ready)
            if isinstance(remote, RemoteModels):  # each replica holds a model set of its own (on its device)
                remote.router = router
            return router

    routing = ModelRouting(config.model_dir, config.model, remote) if config.model_dir and remote is not None else None
    state = ServerState(config, engine_factory, on_close=routing.close if routing else None)
    if routing is not None:
        state.metrics.registry.register(ModelCollector(
            lambda: [(r.name, r.memory_bytes, r.client.in_flight()) for r in routing.models.resident()],
            routing.models.loading))
    body_limit = 8 * config.max_prompt_bytes + 65536  # JSON may escape each byte as \u00XX
    read_timeout = min(config.body_timeout, config.request_timeout)
    read_flag = "--body-timeout" if config.body_timeout <= config.request_timeout else "--request-timeout"
    links = ImageLinks(make_store(config.image_store, config.image_ttl, config.image_store_bytes),
                       UrlSigner(config.api_keys) if config.api_keys else None, config.public_url)
    key_bytes = tuple(k.encode() for k in config.api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        await jobs.start()
        yield
        await jobs.stop()  # before the engine closes: its requests are aborted, their candidates stay pending
        await asyncio.to_thread(state.close)

    app = FastAPI(title="diffgraph", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-shaped image generation on CUDA graphs with step-level batching")
    add_docs(app, bool(config.api_keys), config.protect_metrics)  # Swagger UI at /docs from local files (pages.py)
    app.state.server = state
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect_metrics=config.protect_metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health() -> Response:
        down = state.down
        body = {"status": "down" if down else "ok", "ready": state.ready, "draining": state.draining}
        return JSONResponse({**body, "error": down}, status_code=503) if down else JSONResponse(body)

    @app.get("/ready")
    async def ready() -> Response:
        try:
            engine = state.require_engine()
        except APIError as e:
            return _error_response(e)
        body = {"status": "ready", "model": engine.info.name, "mode": engine.info.mode,
                "ready_s": round(engine.info.ready_s, 3)}
        body["replicas"] = engine.replica_states()
        return JSONResponse(body)

    @app.get("/v1/images/files/{name}")
    async def image_file(name: str, http: Request) -> Response:
        """A stored image, while it has not expired; with API keys, only by a signed URL or a key."""
        try:
            data, headers = await asyncio.to_thread(links.serve, name, http.query_params.get("exp", ""),
                                                    http.query_params.get("sig", ""), authorized(http.scope, key_bytes))
        except LookupError as e:
            status, code = (401, "invalid_image_url") if isinstance(e, PermissionError) else (404, "image_not_found")
            return _error_response(APIError(status, str(e), code=code))
        return Response(data, headers=headers)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        if routing is not None:  # every model of --model-dir, resident or not
            return {"object": "list", "data": await asyncio.to_thread(routing.listing, state.created)}
        info = state.engine.info if state.engine is not None else None
        if info is None:
            return ModelList(data=[ModelCard(id=config.model, created=state.created)]).model_dump()
        return ModelList(data=[ModelCard(id=info.name, created=state.created, capabilities=list(info.capabilities),
                                         default_steps=info.default_steps, default_guidance=info.default_guidance,
                                         native_size=info.native_size)]).model_dump()

    @app.get("/v1/loras")
    async def loras(model: str | None = None) -> Response:
        """The LoRA adapters requests may name (`loras: [{"name", "scale"}]`), from their headers (pages.py); with
        `?model=`, as that model's engine sees them (a --model-dir model's own slots)."""
        try:
            return JSONResponse({"object": "list", **await lora_listing(state, model, routing)})
        except APIError as e:
            return _error_response(e)

    # /v1/controlnets and its map preview (control_routes.py); a body with controls may carry their images
    body_limit += add_control_routes(app, config, body_limit) * 4 * (config.max_image_bytes // 3 + 2)

    embedding_dir = EmbeddingDir(config.embeddings_dir) if config.embeddings_dir else None

    @app.get("/v1/embeddings")
    async def embeddings() -> Response:
        """The textual-inversion embeddings a1111-syntax prompts may name (--embeddings-dir), from their headers."""
        try:
            return JSONResponse({"object": "list", **await embedding_listing(embedding_dir)})
        except APIError as e:
            return _error_response(e)

    ctx = AppContext(state, routing, key_bytes, embedding_dir)
    app.include_router(a1111_router(ctx))  # /sdapi/v1: AUTOMATIC1111's API (a1111.py)
    jobs_routes, jobs = jobs_router(ctx)  # /v1/jobs: batch jobs (jobs_routes.py), with --state-dir
    app.include_router(jobs_routes)

    @app.get("/info")
    async def info() -> Response:
        return JSONResponse(server_info(state))

    @app.get("/status")
    async def status() -> Response:
        return JSONResponse(await asyncio.to_thread(server_status, state, routing))

    if config.playground:
        @app.get("/", include_in_schema=False)
        async def playground_page() -> Response:
            return playground_file("index.html")

        @app.get("/playground/{name}", include_in_schema=False)
        async def playground_asset(name: str) -> Response:
            return playground_file(name)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=content_type)

    schema = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": ImageGenerationRequest.model_json_schema()}}}}

    async def read_generation(http: Request) -> tuple[bool, bool, str | None, Callable[[ModelInfo], Any]]:
        body = await read_json(http, body_limit)
        # the registered capabilities' parameters (features/capability.py) beside the images API's own fields
        known = state.info.extension_params if state.info is not None else ()
        extras = {k: body.pop(k) for k in known if k in body} if isinstance(body, dict) else {}
        try:
            params = ImageGenerationRequest.model_validate(body)
        except ValidationError as e:
            raise error_from_validation(e) from None

        async def finish(info: ModelInfo) -> tuple[GenerationRequest, list[str]]:
            controls = await asyncio.to_thread(decode_controls, params.controls, config.max_image_bytes,
                                               config.max_image_pixels) if params.controls else ()
            prompt = await asyncio.to_thread(decode_image_prompt, params.image_prompts, config.max_image_bytes,
                                             config.max_image_pixels) if params.image_prompts else None
            return await asyncio.to_thread(_warned, generation_request, info, config, params, controls=controls,
                                           image_prompts=prompt, extras=extras)  # prompts read off the loop
        return params.stream, params.response_format == "url", params.model, finish

    async def read_edit(http: Request, variation: bool = False) -> tuple[bool, bool, str | None,
                                                                          Callable[[ModelInfo], Any]]:
        """An edit's form, or a variation's (`variation`: no prompt, no mask, `VARIATION_STRENGTH` by default)."""
        form, files = await read_form(http, config.max_image_bytes, variation)

        async def finish(info: ModelInfo) -> tuple[GenerationRequest, list[str]]:
            if not info.edits:
                raise APIError(400, f"model {info.name!r} takes no image inputs; use /v1/images/generations",
                               param="image")
            defaults = (VARIATION_STRENGTH,) * 2 if variation else info.edit_strength
            edit = await asyncio.to_thread(edit_input, files, form.strength, defaults, config.max_image_bytes,
                                           config.max_image_pixels, info.name, not variation)
            controls = await asyncio.to_thread(decode_controls, form.controls, config.max_image_bytes,
                                               config.max_image_pixels, files.parts)
            prompt = await asyncio.to_thread(decode_image_prompt, form.image_prompts, config.max_image_bytes,
                                             config.max_image_pixels, files.parts)
            return await asyncio.to_thread(_warned, generation_request, info, config, form.generation(), edit,
                                           controls=controls, image_prompts=prompt)
        return form.stream, form.response_format == "url", form.model, finish

    @app.post("/v1/images/generations", openapi_extra=schema)
    async def generations(http: Request) -> Response:
        return await _serve(http, read_generation, sse.GENERATION)

    edit_schema = {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": ImageEditForm.model_json_schema()}}}}

    @app.post("/v1/images/edits", openapi_extra=edit_schema)
    async def edits(http: Request) -> Response:
        return await _serve(http, read_edit, sse.EDIT)

    @app.post("/v1/images/variations", openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": variation_schema()}}}})
    async def variations(http: Request) -> Response:
        return await _serve(http, lambda h: read_edit(h, variation=True), sse.EDIT)

    async def _serve(http: Request, read: Callable[[Request, ModelInfo], Any], kind: str) -> Response:
        """One generation request: read and validate it (`read`), submit, wait (or stream the route's `kind` of
        events), answer."""
        t0 = time.monotonic()
        state.inflight += 1
        state.metrics.inflight.inc()
        streaming = False
        try:
            state.accepting()
            try:  # a body that never finishes arriving must not hold the request (or a drain) forever
                stream, by_url, model, finish = await asyncio.wait_for(read(http), read_timeout)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {read_timeout:g} s ({read_flag}); send "
                                    "the whole body at once", code="body_timeout") from None
            deadline = t0 + config.request_timeout
            default = Target(state.client, state.info, None)
            target = await routing.target(model, deadline - time.monotonic(), default) if routing else default
            try:  # the target is held (never evicted) until its request is queued
                request, warnings = await finish(target.info)
                handle = await submit(state, request, progress=stream, client=target.client, deadline=deadline,
                                      http=http)
            finally:
                if target.hold is not None:  # another model's, held until its request is queued
                    target.release(routing)
            urls = links.maker(str(http.base_url)) if by_url else None
            headers = warnings_header(warnings)  # OpenAI's answer has no field for them
            if stream:
                streaming = True  # the stream ends the request's accounting
                end = _StreamEnd(handle, t0)
                return _ClosingStream(_stream(handle, request, deadline, http, end, urls, kind), end.close,
                                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
            items = results(state, handle, deadline, http)
            try:
                async for item in items:
                    if isinstance(item, GenerationResult):
                        break
            finally:
                await items.aclose()
            body = await asyncio.to_thread(_response, item, urls)
            state.metrics.observe_request("success", time.monotonic() - t0)
            return JSONResponse(body, headers=headers)
        except APIError as e:
            state.metrics.observe_request(outcome(e))
            return _error_response(e)
        except ClientGone:
            state.metrics.observe_request("aborted")
            return Response(status_code=499)
        except asyncio.CancelledError:  # the process is exiting under this request: it still gets one outcome
            state.metrics.observe_request("aborted")
            raise
        finally:
            if not streaming:
                _leave()

    class _StreamEnd:
        """A stream's accounting, closed exactly once: by the generator, or by the response when the client
        left before the generator ever ran (then no `finally` of the generator would run)."""

        def __init__(self, handle: RequestHandle, t0: float):
            self.handle, self.t0, self.outcome, self.closed = handle, t0, "aborted", False

        def close(self) -> None:
            if self.closed:
                return
            self.closed = True
            if self.outcome == "aborted" and self.handle.request_id in state.handles:
                abort(state, self.handle)  # the client went away: free the rows
            state.metrics.observe_request(self.outcome, time.monotonic() - self.t0)
            _leave()

    async def _stream(handle: RequestHandle, request: GenerationRequest, deadline: float, http: Request,
                      end: "_StreamEnd", urls: Callable[[bytes, str], str] | None, kind: str) -> AsyncIterator[bytes]:
        """The request's events in OpenAI's image stream shape (stream.py)."""
        items, previews = results(state, handle, deadline, http), 0
        try:
            async for item in items:
                if isinstance(item, ProgressEvent):
                    if item.previews:
                        yield await asyncio.to_thread(sse.partials, item, previews, request, kind)
                        previews += 1
                    else:
                        yield sse.progress(item)
                    continue
                body = await asyncio.to_thread(_response, item, urls)
                end.outcome = "success"
                yield sse.completed(body, request, kind)
                return
        except APIError as e:
            end.outcome = outcome(e)
            yield sse.error(e.status, e.body())
        except ClientGone:
            pass
        finally:
            await items.aclose()
            end.close()

    def _leave() -> None:
        state.inflight -= 1
        state.metrics.inflight.dec()

    return app
