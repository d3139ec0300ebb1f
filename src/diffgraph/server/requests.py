"""The life of one generation request inside the server: the engine client it goes to, its submission, the wait
for its events (with the request timeout and client-disconnect checks), its abort, and the outcome it counts.

`ServerState` owns the engine (a `Router`, None until built on a background thread), the client requests are
submitted to (the router's only replica when there is one: no choice to make, one hop less per request), the
model's `ModelInfo` (what validation needs, read once when the engine is built), the drain flags and the handles of
the requests in flight; the routers' routes use these functions and hold no request state of their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request

from ..cli_flags import quantize_error
from ..engine.client import EngineClient, RequestHandle
from ..engine.router import Router
from ..prompt_syntax import MARKS, a1111_marks
from ..request import (EngineClosed, EngineStepError, GenerationRequest, GenerationResult, ModelInfo, ParamError,
                       ProgressEvent, QueueFullError, RequestAborted)
from ..api.config import ServerConfig
from .metrics import ServerMetrics
from ..api.protocol import APIError, error_from_param_error

logger = logging.getLogger("diffgraph.server")

POLL_S = 0.1  # how often a waiting handler checks for a disconnected client
# what a request asked that was taken, but likely not as meant (the images routes; AUTOMATIC1111's answer its
# `warnings`): sentences joined by " | "
WARNINGS_HEADER = "X-Diffgraph-Warnings"

_OUTCOME = {400: "bad_request", 404: "bad_request", 405: "bad_request", 408: "timeout", 413: "bad_request",
            429: "queue_full", 499: "aborted", 503: "unavailable", 504: "timeout"}


def outcome(e: APIError) -> str:
    """The metrics outcome of an error answer: aborted requests (the drain timeout) count as aborted."""
    return "aborted" if e.code == "aborted" else _OUTCOME.get(e.status, "error")


class ClientGone(Exception):
    """The client closed the connection; its request was aborted."""


REFERENCE_STEPS = 20  # the request the CPU's pixel limit is measured for
CPU_TIMEOUT_SHARE = 0.25  # ... which may take this share of the request timeout


def step_cost_fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of a step's seconds = a * pixels + b * pixels^2 through the (pixels, seconds) of steps timed at two
    sizes (attention grows with the square of the pixels, the rest with the pixels). Both are kept >= 0: a fit that
    bends down (timing noise) is a line through the costlier sample per pixel, and one that would need a < 0, or a
    single sample, is all quadratic; both err towards a lower limit."""
    ordered = sorted(samples)
    (p1, t1), (p2, t2) = ordered[0], ordered[-1]
    if p1 == p2:
        return 0.0, max(t for _, t in ordered) / p1 ** 2
    b = (t2 / p2 - t1 / p1) / (p2 - p1)
    if b < 0:
        return max(t1 / p1, t2 / p2), 0.0
    a = t1 / p1 - b * p1
    return (a, b) if a >= 0 else (0.0, max(t1 / p1 ** 2, t2 / p2 ** 2))


def cpu_pixel_limit(info: ModelInfo, samples: Sequence[tuple[int, float]], request_timeout: float) -> int:
    """--max-pixels' CPU default: the pixels at which a REFERENCE_STEPS-step image takes CPU_TIMEOUT_SHARE of the
    request timeout, by the step cost fitted to steps timed at two sizes (step_cost_fit), never below the native
    size."""
    native = info.native_size ** 2
    a, b = step_cost_fit(samples)
    budget = CPU_TIMEOUT_SHARE * request_timeout / REFERENCE_STEPS  # seconds one step may take
    allowed = budget / max(a, 1e-12) if b == 0 else (math.sqrt(a * a + 4 * b * budget) - a) / (2 * b)
    return max(native, int(allowed))


def syntax_warnings(request: GenerationRequest) -> list[str]:
    """A warning for each prompt read as plain text that holds AUTOMATIC1111's syntax (prompt_syntax.MARKS): the
    tags and weights are words there, silently, unless the answer says so."""
    if request.prompt_syntax != "plain":
        return []
    out = []
    for field, text in (("prompt", request.prompt), ("negative_prompt", request.negative_prompt or "")):
        marks = a1111_marks(text) if ":" in text else ()  # both marks hold a colon: most prompts need no search
        if marks:
            out.append(f"{field} holds AUTOMATIC1111 syntax ({' and '.join(MARKS[m] for m in marks)}), read as plain "
                       "words here (prompt_syntax \"plain\"): no adapter loaded, no weight applied; send "
                       "\"prompt_syntax\": \"a1111\" to read it as AUTOMATIC1111 does")
    return out


def warnings_header(warnings: Sequence[str]) -> dict[str, str]:
    """The WARNINGS_HEADER of an answer (none without warnings)."""
    return {WARNINGS_HEADER: " | ".join(warnings)} if warnings else {}


def _is_local_engine(built: Any) -> bool:
    """An `Engine` of this process: only a factory that built one has imported the engine module (and torch)."""
    import sys

    engine_class = getattr(sys.modules.get("diffgraph.engine.engine"), "Engine", None)  # None: not (yet) imported
    return engine_class is not None and isinstance(built, engine_class)


def _in_process(engine: Any, state: "ServerState") -> EngineClient:
    """An in-process Engine as a client: one image end to end before /ready says yes (the first pass is slow; a
    broken model fails here, not on a client's request), and on the CPU warm steps timed for --max-pixels."""
    from ..engine.async_engine import AsyncEngine
    from ..engine.replica_process import time_step_sizes

    engine.generate("warm-up", num_inference_steps=1, seed=0)
    if state.config.max_pixels is None and engine.info.device.startswith("cpu"):
        samples = time_step_sizes(engine)
        state.max_pixels = cpu_pixel_limit(engine.info, samples, state.config.request_timeout) if samples else None
    return AsyncEngine(engine)


class ServerState:
    """The engine client (None until built), the drain flag and the requests in flight."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Any],
                 on_close: Callable[[], None] | None = None):
        self.config = config
        self.engine: Router | None = None  # always a router: over one engine here, or over replica processes
        self.client: EngineClient | None = None  # where requests go: the router, or its only replica
        self.info: ModelInfo | None = None       # the served model (set with the engine)
        self.error: str | None = None      # why the engine could not be built
        self.draining = False
        self.drain_aborted = False  # the drain timeout passed: in-flight requests were aborted
        self.inflight = 0
        self.handles: dict[str, RequestHandle] = {}
        # the most pixels an image may have (--max-pixels; on the CPU measured at start-up); None: no limit here
        self.max_pixels: int | None = config.max_pixels or None
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine, config.batch_buckets, lambda: self.ready)
        self._factory = engine_factory
        self._on_close = on_close  # what else closes with the engine (a model set's other models)
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self.draining

    @property
    def down(self) -> str | None:
        """Why this server cannot serve again until it restarts (/health's 503), else None."""
        if self.error is not None:
            return f"the engine failed to start: {self.error}"
        lost = self.engine.down if self.engine is not None else None
        return None if lost is None else (f"too few replicas can serve again ({lost}); restart the server (a "
                                          "liveness probe on GET /health does)")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._build, name="diffgraph-build", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        t0 = time.perf_counter()
        built = None
        try:  # the imports too: a broken install is reported like any build failure, not a silent dead thread
            built = self._factory()
            if _is_local_engine(built):  # an in-process Engine (tests, embedding): warmed and measured here
                built = _in_process(built, self)
            if not isinstance(built, EngineClient):
                raise TypeError(f"the engine factory returned {type(built).__name__}, not an Engine or EngineClient")
            if not isinstance(built, Router):  # one engine (or one remote deployment): a router of one replica
                built = Router([built])
            if not built.wait_ready():  # replica processes warm themselves up
                states = "; ".join(f"{r['replica']}: {r['state']} {r['error'] or ''}".strip()
                                   for r in built.replica_states())
                raise RuntimeError(f"fewer than {built.min_ready} replica(s) became ready ({states})")
            measured = [s for s in (getattr(r, "step_samples", None) for r in built.replicas) if s]
            if self.config.max_pixels is None and measured and built.info is not None:  # CPU replicas' warm steps
                self.max_pixels = min(cpu_pixel_limit(built.info, s, self.config.request_timeout) for s in measured)
        except Exception as e:
            logger.exception("the engine could not be built")
            self.error = quantize_error(f"{type(e).__name__}: {e}", toml=True)  # serve's words for an fp8 refusal
            if built is not None:
                built.close()
            return
        built.add_step_listener(self.metrics.on_step)
        self.client = built.sole if built.sole is not None else built
        self.info = built.info
        self.engine = built  # last: a built engine means ready (with client and info set)
        logger.info("engine ready in %.1f s: model %s, mode %s%s", time.perf_counter() - t0, built.info.name,
                    built.info.mode, f", at most {self.max_pixels} pixels an image" if self.max_pixels else "")

    def require_engine(self) -> Router:
        """The engine, or an APIError: draining, not built (yet, or ever), or stopped after an internal error."""
        engine = self.accepting()
        if not engine.ready:
            why = "; ".join(f"{r['replica']}: {r['error']}" for r in engine.replica_states() if r.get("error"))
            raise APIError(503, f"the engine failed ({why or 'an internal error; see the server log'}); retry on "
                                "another replica (a replica process restarts by itself)", code="engine_failed")
        return engine

    def accepting(self) -> Router:
        """The engine, or an APIError when the server takes no requests (draining, not built). A generation request
        checks no more before its body is read: `submit` refuses it when the engine stopped (EngineClosed, under the
        core's lock: a check here could pass and be stale a moment later)."""
        if self.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests; retry on another "
                                "replica", code="draining")
        if self.engine is None:
            why = (f"the engine failed to start: {self.error}" if self.error
                   else "the model is loading and graphs are being captured; retry when GET /ready answers 200")
            raise APIError(503, why, code="not_ready")
        return self.engine

    def begin_drain(self) -> None:
        """Stops accepting generation requests; those in flight go on (SIGTERM)."""
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.inflight)
        self.draining = True

    def abort_all(self) -> None:
        """Aborts every request in flight (the drain timeout passed); any submitted later is refused."""
        self.drain_aborted = True
        for handle in list(self.handles.values()):
            handle.abort()

    def close(self) -> None:
        # An engine still being built is left to its daemon thread: a drain must not wait for graph capture.
        if self.engine is not None:
            self.engine.close()
        if self._on_close is not None:
            self._on_close()


async def submit(state: ServerState, request: GenerationRequest, progress: bool,
                 client: EngineClient | None = None, deadline: float | None = None,
                 http: Request | None = None) -> RequestHandle:
    """Submits to the engine client (`client`: another model's, else the server's) before any response starts, so a
    full queue is a plain 429 even when streaming. With `deadline` (and `http`) the submission itself is bounded by
    the request timeout (504) and the client's disconnect: a replica that stopped answering or a saturated remote
    deployment never holds the HTTP request; a submission that completes after that is aborted at once."""
    pixels = request.width * request.height
    if state.max_pixels is not None and pixels > state.max_pixels:
        how = ("--max-pixels" if state.config.max_pixels else "measured at start-up from this CPU's step time, so "
               f"that a {REFERENCE_STEPS}-step image ends well within the request timeout; --max-pixels sets it")
        raise APIError(400, f"size {request.width}x{request.height} is {pixels} pixels; this server takes at most "
                            f"{state.max_pixels} pixels an image ({how})", param="size")
    if state.drain_aborted:  # its body finished arriving after the drain timeout's aborts
        raise APIError(503, "the server shut down before this request started; retry on another replica",
                       code="aborted")
    try:
        pending = (client or state.client).submit(request, progress=progress)
        handle = await (pending if deadline is None else _bounded(state, pending, deadline, http))
    except QueueFullError as e:
        raise APIError(429, str(e), code="queue_full") from None
    except ParamError as e:  # the engine refused the request itself (e.g. its step count on this model)
        raise error_from_param_error(e, state.info.extension_params if state.info is not None else ()) from None
    except EngineClosed as e:  # the engine was closed under us (a drain) or its loop stopped
        raise APIError(503, str(e), code="draining" if state.draining else "engine_failed") from None
    state.handles[request.request_id] = handle
    return handle


async def _bounded(state: ServerState, submission: Awaitable[RequestHandle], deadline: float,
                   http: Request | None) -> RequestHandle:
    task = asyncio.ensure_future(submission)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timeout = state.config.request_timeout
                raise APIError(504, f"the engine did not accept the request within the {timeout:g} s request timeout "
                                    "(a replica not answering, or a saturated deployment); retry, or raise "
                                    "--request-timeout", code="timeout")
            done, _ = await asyncio.wait({task}, timeout=min(POLL_S, remaining))
            if done:
                return task.result()
            if http is not None and await http.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():  # never cancelled mid-protocol: once it is queued after all, it is aborted
            task.add_done_callback(_abort_late)


def _abort_late(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().abort()


async def results(state: ServerState, handle: RequestHandle, deadline: float,
                  http: Request) -> AsyncIterator[ProgressEvent | GenerationResult]:
    """The request's progress events (when it asked for them), then its result. Aborts the request and raises on
    timeout or disconnect; maps the request's own error to an APIError. Leaving it early (`aclose`) closes the
    handle's events, which aborts a request that has not finished."""
    events = handle.events()
    try:
        while True:
            item = await _next(state, handle, asyncio.ensure_future(events.__anext__()), deadline, http)
            yield item
            if not isinstance(item, ProgressEvent):
                return
    finally:
        await events.aclose()
        if handle.dropped_previews:
            state.metrics.previews_dropped.inc(handle.dropped_previews)


async def _next(state: ServerState, handle: RequestHandle, pending: asyncio.Future, deadline: float,
                http: Request) -> ProgressEvent | GenerationResult:
    """`pending` (the handle's next event), waited for within the deadline while the client is connected."""
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                abort(state, handle)
                timeout = state.config.request_timeout
                raise APIError(504, f"the request did not finish within the {timeout:g} s request timeout and was "
                                    "aborted; ask for fewer steps or images, or raise --request-timeout",
                               code="timeout")
            done, _ = await asyncio.wait({pending}, timeout=min(POLL_S, remaining))
            if done:
                break
            if state.drain_aborted:  # the drain timeout passed: answer now, not when a long step ends
                abort(state, handle)
                raise APIError(503, f"the server shut down (its {state.config.drain_timeout:g} s drain timeout passed) "
                                    "before this request finished; retry on another replica", code="aborted")
            if await http.is_disconnected():
                abort(state, handle)
                raise ClientGone()
    finally:
        if not pending.done():  # let the cancelled read finish, so the event iterator can be closed after it
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):
                pass
    try:
        item = pending.result()
    except RequestAborted:
        state.handles.pop(handle.request_id, None)
        raise APIError(503, "the server shut down before this request finished", code="aborted") from None
    except EngineStepError as e:
        state.handles.pop(handle.request_id, None)
        raise APIError(500, str(e), code="engine_error") from None
    except EngineClosed as e:
        state.handles.pop(handle.request_id, None)
        raise APIError(503, str(e), code="draining" if state.draining else "engine_failed") from None
    except Exception as e:
        state.handles.pop(handle.request_id, None)
        logger.exception("request %s failed", handle.request_id)
        raise APIError(500, f"generation failed: {type(e).__name__}: {e}", code="engine_error") from None
    if not isinstance(item, ProgressEvent):
        state.handles.pop(handle.request_id, None)
    return item


def abort(state: ServerState, handle: RequestHandle) -> None:
    state.handles.pop(handle.request_id, None)
    handle.abort()
