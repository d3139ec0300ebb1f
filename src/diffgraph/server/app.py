"""The FastAPI app: OpenAI-shaped image generation over one `Engine`.

    POST /v1/images/generations   JSON answer, or server-sent events with "stream": true
    GET  /v1/models               the served model
    GET  /health                  200 while the process is alive
    GET  /ready                   200 once the engine is built, its prewarm graphs captured and one warm-up
                                  image made; 503 before, and while draining
    GET  /metrics                 Prometheus text (metrics.py)

`create_app` returns at once; the engine is built on a background thread when the app starts, so the
server listens (and answers /health, /ready with 503) while the model loads and graphs are captured.
A generation request is validated (protocol.py types, then `engine.make_request`), submitted to the
engine (the engine thread does the work; the event loop only waits), and watched: a client that
disconnects or a request that outlives `request_timeout` is aborted, which frees its rows at the next
step boundary. Every request ends in one outcome counted in the metrics.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import threading
import time
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine.async_engine import ProgressEvent
from ..engine.engine import EngineStepError
from ..engine.scheduler import QueueFullError, RequestAborted
from ..request import GenerationRequest, GenerationResult
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import (APIError, ImageData, ImageGenerationRequest, ImageGenerationResponse, ModelCard, ModelList,
                       ProgressEventBody, error_from_validation, error_from_value_error)

logger = logging.getLogger("diffgraph.server")

POLL_S = 0.1  # how often a waiting handler checks for a disconnected client

_OUTCOME = {400: "bad_request", 404: "bad_request", 405: "bad_request", 408: "timeout", 413: "bad_request",
            429: "queue_full", 499: "aborted", 503: "unavailable", 504: "timeout"}


def _outcome(e: APIError) -> str:
    """The metrics outcome of an error answer: aborted requests (the drain timeout) count as aborted."""
    return "aborted" if e.code == "aborted" else _OUTCOME.get(e.status, "error")


class ClientGone(Exception):
    """The client closed the connection; its request was aborted."""


class ServerState:
    """The engine (None until built), the drain flag and the requests in flight."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Any]):
        self.config = config
        self.engine: Any = None
        self.error: str | None = None      # why the engine could not be built
        self.draining = False
        self.drain_aborted = False  # the drain timeout passed: in-flight requests were aborted
        self.inflight = 0
        self.jobs: dict[str, Job] = {}
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine, config.batch_buckets, lambda: self.ready)
        self._factory = engine_factory
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    def start(self) -> None:
        self._thread = threading.Thread(target=self._build, name="diffgraph-build", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        t0 = time.perf_counter()
        engine = None
        try:
            engine = self._factory()
            # One image end to end before /ready says yes: the first forward pass is slow (lazy kernels,
            # allocator growth) and a broken model should fail here, not on a client's request.
            engine.generate("warm-up", num_inference_steps=1, seed=0)
        except Exception as e:
            logger.exception("the engine could not be built")
            self.error = f"{type(e).__name__}: {e}"
            if engine is not None:
                engine.close()
            return
        engine.step_listeners.append(self.metrics.on_step)
        self.engine = engine
        logger.info("engine ready in %.1f s: model %s, mode %s", time.perf_counter() - t0, engine.model.name,
                    engine.mode)

    def require_engine(self) -> Any:
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests; retry on another "
                                "replica", code="draining")
        if self.engine is None:
            why = (f"the engine failed to start: {self.error}" if self.error
                   else "the model is loading and graphs are being captured; retry when GET /ready answers 200")
            raise APIError(503, why, code="not_ready")
        if not self.engine.ready:
            raise APIError(503, "the engine stopped after an internal error (see the server log); restart the "
                                "server, and retry on another replica meanwhile", code="engine_failed")
        return self.engine

    def begin_drain(self) -> None:
        """Stops accepting generation requests; those in flight go on (SIGTERM)."""
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.inflight)
        self.draining = True

    def abort_all(self) -> None:
        """Aborts every request in flight (the drain timeout passed); any submitted later is refused."""
        self.drain_aborted = True
        for rid in list(self.jobs):
            self.engine.abort(rid)

    def close(self) -> None:
        # An engine still being built is left to its daemon thread: a drain must not wait for graph capture.
        if self.engine is not None:
            self.engine.close()


class Job:
    """One submitted request as seen from the event loop: its progress events and its end, in one queue.

    Submitting happens here, before any response starts, so a full queue is a plain 429 even when streaming."""

    def __init__(self, state: ServerState, request: GenerationRequest, deadline: float, progress: bool):
        loop = asyncio.get_running_loop()
        self.state = state
        self.request = request
        self.deadline = deadline
        self.queue: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:  # engine / image threads -> event loop
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        on_progress = (lambda rid, step, total: put(ProgressEvent(rid, step, total))) if progress else None
        if state.drain_aborted:  # its body finished arriving after the drain timeout's aborts
            raise APIError(503, "the server shut down before this request started; retry on another replica",
                           code="aborted")
        try:
            self.future: Future = state.engine.submit(request, on_progress=on_progress)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full") from None
        except ValueError as e:  # the engine refused the request itself (e.g. its step count on this model)
            raise error_from_value_error(e) from None
        except RuntimeError as e:  # the engine was closed under us (a drain) or its loop stopped
            raise APIError(503, str(e), code="draining" if state.draining else "engine_failed") from None
        state.jobs[request.request_id] = self
        self.future.add_done_callback(put)  # after every progress event of the request

    async def next(self, http: Request) -> ProgressEvent | GenerationResult:
        """The next progress event or the result. Aborts the request and raises on timeout or disconnect."""
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.abort()
                timeout = self.state.config.request_timeout
                raise APIError(504, f"the request did not finish within the {timeout:g} s request timeout and was "
                                    "aborted; ask for fewer steps or images, or raise --request-timeout",
                               code="timeout")
            try:
                item = await asyncio.wait_for(self.queue.get(), min(POLL_S, remaining))
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    self.abort()
                    raise ClientGone() from None
                continue
            if isinstance(item, ProgressEvent):
                return item
            return self._result(item)

    def _result(self, future: Future) -> GenerationResult:
        self.state.jobs.pop(self.request.request_id, None)
        try:
            return future.result()
        except RequestAborted:
            raise APIError(503, "the server shut down before this request finished", code="aborted") from None
        except EngineStepError as e:
            raise APIError(500, str(e), code="engine_error") from None
        except Exception as e:
            logger.exception("request %s failed", self.request.request_id)
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}", code="engine_error") from None

    def abort(self) -> None:
        self.state.jobs.pop(self.request.request_id, None)
        self.state.engine.abort(self.request.request_id)


# -- request handling ----------------------------------------------------------------------------------
async def _read_json(http: Request, limit: int) -> Any:
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"the body has {length} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left while sending its body
        raise ClientGone() from None
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON ({e}); send a JSON object such as "
                            "{\"prompt\": \"a red fox\"}", code="invalid_json") from None


def _generation_request(engine: Any, config: ServerConfig, body: Any) -> tuple[ImageGenerationRequest,
                                                                               GenerationRequest]:
    """Checks the body, top to bottom, and returns it with the engine request it asks for."""
    try:
        params = ImageGenerationRequest.model_validate(body)
    except ValidationError as e:
        raise error_from_validation(e) from None
    if params.model is not None and params.model != engine.model.name:
        raise APIError(400, f"model {params.model!r} is not served here; this server serves {engine.model.name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if params.response_format == "url":
        raise APIError(400, "response_format 'url' is not supported: this server does not store images; use "
                            "'b64_json'", param="response_format")
    if params.response_format != "b64_json":
        raise APIError(400, f"response_format {params.response_format!r} is unknown; allowed: b64_json",
                       param="response_format")
    for name in ("prompt", "negative_prompt"):
        text = getattr(params, name)
        if text is None:
            continue
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON \ud800-style escape
            raise APIError(400, f"{name} is not valid text: it holds an unpaired surrogate at character {e.start}; "
                                "send UTF-8 text", param=name) from None
        if size > config.max_prompt_bytes:
            raise APIError(400, f"{name} has {size} bytes (UTF-8); the limit is {config.max_prompt_bytes}",
                           param=name)
    if not params.prompt.strip():
        raise APIError(400, "prompt is empty; describe the image to generate", param="prompt")
    width, height = params.width_height()
    try:
        request = engine.make_request(
            params.prompt, negative_prompt=params.negative_prompt, width=width, height=height,
            num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
            sampler=params.sampler, schedule=params.schedule, seed=params.seed, num_images=params.n,
            output_format=params.output_format, request_id=f"img-{secrets.token_hex(8)}")
    except ValueError as e:
        raise error_from_value_error(e) from None
    return params, request


def _response(result: GenerationResult) -> dict[str, Any]:
    r = result.request
    return ImageGenerationResponse(
        created=int(time.time()), id=result.request_id, seed=result.seed, output_format=r.output_format,
        data=[ImageData(b64_json=base64.b64encode(b).decode("ascii")) for b in result.encoded],
        timings={k: round(v, 3) for k, v in result.timings.items()}).model_dump(exclude_none=True)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


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


def create_app(config: ServerConfig, engine_factory: Callable[[], Any] | None = None) -> FastAPI:
    """The app for `config`. `engine_factory` builds the engine (default: `Engine(**config.engine_kwargs())`)."""
    if engine_factory is None:
        def engine_factory():
            from ..engine.engine import Engine
            return Engine(**config.engine_kwargs())

    state = ServerState(config, engine_factory)
    body_limit = 8 * config.max_prompt_bytes + 65536  # JSON may escape each byte as \u00XX

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await asyncio.to_thread(state.close)

    app = FastAPI(title="diffgraph", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-shaped image generation on CUDA graphs with step-level batching")
    app.state.server = state

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "ready": state.ready, "draining": state.draining}

    @app.get("/ready")
    async def ready() -> Response:
        try:
            engine = state.require_engine()
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"status": "ready", "model": engine.model.name, "mode": engine.mode,
                             "ready_s": round(engine.ready_s, 3)})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = state.engine.model.name if state.engine is not None else config.model
        return ModelList(data=[ModelCard(id=name, created=state.created)]).model_dump()

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=content_type)

    schema = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": ImageGenerationRequest.model_json_schema()}}}}

    @app.post("/v1/images/generations", openapi_extra=schema)
    async def generations(http: Request) -> Response:
        t0 = time.monotonic()
        state.inflight += 1
        state.metrics.inflight.inc()
        streaming = False
        try:
            engine = state.require_engine()
            try:  # a body that never finishes arriving must not hold the request (or a drain) forever
                body = await asyncio.wait_for(_read_json(http, body_limit), config.request_timeout)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within the {config.request_timeout:g} s "
                                    "request timeout; send the whole body at once", code="body_timeout") from None
            params, request = _generation_request(engine, config, body)
            job = Job(state, request, t0 + config.request_timeout, progress=params.stream)
            if params.stream:
                streaming = True  # the stream ends the request's accounting
                end = _StreamEnd(job, t0)
                return _ClosingStream(_stream(job, http, end), end.close, media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache"})
            while True:
                item = await job.next(http)
                if isinstance(item, GenerationResult):
                    break
            body = await asyncio.to_thread(_response, item)
            state.metrics.observe_request("success", time.monotonic() - t0)
            return JSONResponse(body)
        except APIError as e:
            state.metrics.observe_request(_outcome(e))
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

        def __init__(self, job: Job, t0: float):
            self.job, self.t0, self.outcome, self.closed = job, t0, "aborted", False

        def close(self) -> None:
            if self.closed:
                return
            self.closed = True
            if self.outcome == "aborted" and self.job.request.request_id in state.jobs:
                self.job.abort()  # the client went away: free the rows
            state.metrics.observe_request(self.outcome, time.monotonic() - self.t0)
            _leave()

    async def _stream(job: Job, http: Request, end: "_StreamEnd") -> AsyncIterator[bytes]:
        try:
            while True:
                item = await job.next(http)
                if isinstance(item, ProgressEvent):
                    yield _sse("progress", ProgressEventBody(id=item.request_id, step=item.step,
                                                             total=item.total).model_dump())
                    continue
                body = await asyncio.to_thread(_response, item)
                end.outcome = "success"
                yield _sse("completed", {"type": "completed", **body})
                return
        except APIError as e:
            end.outcome = _outcome(e)
            yield _sse("error", {"type": "error", "status": e.status, **e.body()})
        except ClientGone:
            pass
        finally:
            end.close()

    def _leave() -> None:
        state.inflight -= 1
        state.metrics.inflight.dec()

    return app
