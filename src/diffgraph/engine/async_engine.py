"""`AsyncEngine`: the engine for asyncio code, and the in-process `EngineClient` the HTTP server uses.

`await engine.generate(...)` waits without blocking the event loop (cancelling it aborts the request);
`engine.stream(...)` is an async iterator of `ProgressEvent`s (one per step) ending with the
`GenerationResult`. Closing the iterator early aborts the request, which frees its rows at the next step:
`async with contextlib.aclosing(engine.stream(request)) as events:` closes it when the block is left; an
iterator left unclosed is closed only when it is garbage-collected (Python's rule for async generators).
`submit` returns a `RequestHandle` (client.py); answers travel from the engine's threads to the event loop
through one queue per request. Requests go straight to the engine core (the `Engine` builds it; nothing here
forwards through it), and one step listener on the core serves both this engine's step times and its listeners.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, AsyncIterator, Callable

from ..request import GenerationRequest, GenerationResult, ProgressEvent
from .client import EngineStats, StepEvent
from .engine import Engine
from .handles import RequestHandleImpl
from .scheduler import StepPlan

__all__ = ["AsyncEngine", "ProgressEvent"]

logger = logging.getLogger(__name__)

class AsyncEngine:
    """An `Engine` behind the `EngineClient` protocol (client.py). It is also the in-process replica of a `Router`
    (router.py): the server holds a router over this one engine or over replica processes, and submits to this
    engine directly when it is the router's only replica."""

    restarts = 0  # an in-process engine is never restarted: a failed loop leaves it "failed"

    def __init__(self, engine: Engine | None = None, name: str | None = None, **engine_kwargs: Any):
        self.engine = engine or Engine(**engine_kwargs)
        self.core = self.engine.core  # built and started: requests, aborts and readiness go to it directly
        self.info = self.engine.info
        self.name = name or str(self.engine.runner.device)
        self._closed = False
        self._step_times: dict[int, tuple[int, float]] = {}  # bucket -> (steps, seconds): this engine's steps
        self._step_lock = threading.Lock()
        self._listeners: list[Callable[[StepEvent], None]] = []
        self._open = 0  # requests submitted and not yet answered
        self.core.step_listeners.append(self._on_step)

    @property
    def ready(self) -> bool:
        return self.core.ready

    @property
    def state(self) -> str:
        """The replica states of replica.py: "ready", "closed", or "failed" (its loop stopped)."""
        return "ready" if self.core.ready else "closed" if self._closed else "failed"

    @property
    def error(self) -> str | None:
        if self.state != "failed":
            return None
        return self.core.failures.reason or "the engine loop stopped after an internal error (see the log)"

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready  # built in the constructor: nothing to wait for

    def _on_step(self, plan: StepPlan, seconds: float) -> None:
        """After each step, on the loop thread: this engine's step times, then its listeners."""
        bucket = plan.cost_rows or plan.n_rows
        with self._step_lock:
            n, total = self._step_times.get(bucket, (0, 0.0))
            self._step_times[bucket] = (n + 1, total + seconds)
        if self._listeners:
            event = StepEvent(plan.key, plan.n_rows, bucket, seconds, sum(s.rows for s in plan.live if s.batch))
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:  # a listener must not stop the engine, nor the listeners after it
                    logger.exception("step listener %r failed", listener)

    def in_flight(self) -> int:
        """Requests submitted and not yet answered."""
        with self._step_lock:
            return self._open

    def _opened(self, n: int) -> None:
        with self._step_lock:
            self._open += n

    @property
    def ready_s(self) -> float:
        return self.engine.ready_s

    def make_request(self, prompt: Any, **params: Any) -> GenerationRequest:
        return self.engine.make_request(prompt, **params)

    def check_extras(self, request: GenerationRequest) -> None:
        """ParamError naming the first capability parameter of `request` this engine's model cannot honour: what
        `submit` checks of them, with nothing queued or prepared."""
        if request.extras:
            self.core.runner.capabilities.check(dict(request.extras), self.info.name)

    async def submit(self, request: GenerationRequest, progress: bool = False) -> RequestHandleImpl:
        core = self.core
        # a handle aborts its own request, not a later one that reuses its id
        handle = RequestHandleImpl(lambda h: core.abort(h.request_id, sink=h), request, progress,
                                   on_finish=lambda: self._opened(-1))
        # the files it names (LoRA adapters, ...) are read off the event loop (a large one takes a while)
        files = await asyncio.to_thread(core.resolve_files, request) if core.asks_files(request) else {}
        self._opened(1)
        try:
            if request.edit is not None or request.controls:  # images prepared, nets read at submit: off the loop
                await asyncio.to_thread(core.submit, request, handle, files)
            else:
                core.submit(request, handle, files)
        except BaseException:
            self._opened(-1)
            raise
        return handle

    async def generate(self, prompt: Any, **params: Any) -> GenerationResult:
        return await self.run(self.make_request(prompt, **params))

    async def run(self, request: GenerationRequest) -> GenerationResult:
        handle = await self.submit(request)
        return await handle.result()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[ProgressEvent | GenerationResult]:
        handle = await self.submit(request, progress=True)
        events = handle.events()
        try:
            async for item in events:
                yield item
        finally:
            await events.aclose()

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def loras(self) -> dict[str, Any]:
        """Engine.loras(): reads adapter files it has not seen (call it off the event loop)."""
        return self.engine.loras()

    def stats(self) -> EngineStats:
        e = self.engine
        s = e.stats
        with self._step_lock:
            step_seconds = dict(self._step_times)
        return EngineStats(ready=e.ready, queue_depth=e.queue_depth(), live_rows=e.live_rows(), steps=s["steps"],
                           failed_steps=s["failed_steps"], growth_holds=e.core.scheduler.growth_holds,
                           prompt_cache_hits=s["prompt_cache_hits"], prompt_cache_misses=s["prompt_cache_misses"],
                           compile_fallbacks=s["compile_fallbacks"],
                           device_memory_bytes=_device_memory_bytes(e), graphs=e.graph_table(),
                           step_seconds=step_seconds, memory=e.memory())

    def graph_table(self) -> list[dict[str, Any]]:
        return self.engine.graph_table()

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        self._listeners.append(listener)

    def close(self) -> None:
        self._closed = True
        self.engine.close()


def _device_memory_bytes(engine: Engine) -> int:
    """torch.cuda.memory_allocated on a CUDA engine, else this process's resident set size (0 if unknown)."""
    if engine.runner.cuda:
        import torch
        return int(torch.cuda.memory_allocated(engine.runner.device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
