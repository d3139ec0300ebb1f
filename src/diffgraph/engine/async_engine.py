"""`AsyncEngine`: the engine for asyncio code (the HTTP server).

`await engine.generate(...)` waits without blocking the event loop (cancelling it aborts the request);
`engine.stream(...)` is an async iterator of `ProgressEvent`s (one per step) ending with the
`GenerationResult`. Closing the iterator early aborts the request, which frees its rows at the next step:
`async with contextlib.aclosing(engine.stream(request)) as events:` closes it when the block is left; an
iterator left unclosed is closed only when it is garbage-collected (Python's rule for async generators).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..request import GenerationRequest, GenerationResult
from .engine import Engine


@dataclass(frozen=True)
class ProgressEvent:
    request_id: str
    step: int
    total: int


class AsyncEngine:
    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any):
        self.engine = engine or Engine(**engine_kwargs)

    def make_request(self, prompt: Any, **params: Any) -> GenerationRequest:
        return self.engine.make_request(prompt, **params)

    async def generate(self, prompt: Any, **params: Any) -> GenerationResult:
        return await self.run(self.make_request(prompt, **params))

    async def run(self, request: GenerationRequest) -> GenerationResult:
        wrapped = asyncio.wrap_future(self.engine.submit(request))
        try:
            return await asyncio.shield(wrapped)
        except asyncio.CancelledError:
            # the abort fails the request with RequestAborted, which nobody awaits any more: retrieve it, or
            # asyncio logs "Future exception was never retrieved" for every cancelled call
            wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.engine.abort(request.request_id)
            raise

    async def stream(self, request: GenerationRequest) -> AsyncIterator[ProgressEvent | GenerationResult]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_progress(rid: str, step: int, total: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ProgressEvent(rid, step, total))

        future = self.engine.submit(request, on_progress=on_progress)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, f))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, ProgressEvent):
                    yield item
                    continue
                finished = True
                yield item.result()  # raises the request's error, if any
                return
        finally:
            if not finished:
                self.engine.abort(request.request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def close(self) -> None:
        self.engine.close()
