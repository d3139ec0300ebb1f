"""`RequestHandleImpl`: one request's answers, carried from the thread that produces them (an engine's loop in
this process, or a replica's pipe reader) to the asyncio event loop that waits for them. Torch-free: the HTTP
process holds these for requests whose engine lives in a replica process.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable

from ..request import GenerationRequest, GenerationResult, ProgressEvent

_DONE = object()


class RequestHandleImpl:
    """One request's answers on the event loop: progress events, then ("done", result, error). It is the request's
    RequestSink (called on other threads) and its RequestHandle (read on the event loop); `abort` is how to abort it
    (in this process, or a message to a replica process)."""

    def __init__(self, abort: Callable[["RequestHandleImpl"], bool], request: GenerationRequest, progress: bool,
                 on_finish: Callable[[], None] | None = None):
        self.request_id = request.request_id
        self._abort = abort
        self._on_finish = on_finish
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._progress = progress
        self._lock = threading.Lock()
        self._finished = False
        self._done = False  # the result or error was taken by the reader

    # RequestSink: called on the engine's threads
    def progress(self, event: ProgressEvent) -> None:
        if self._progress:
            self._put(event)

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        if self._on_finish is not None:
            self._on_finish()
        self._put((_DONE, result, error))

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def next(self) -> ProgressEvent | GenerationResult:
        """The next progress event, or the result (raising the request's error)."""
        item = await self._queue.get()
        if isinstance(item, ProgressEvent):
            return item
        _, result, error = item
        self._done = True
        if error is not None:
            raise error
        return result

    async def events(self) -> AsyncIterator[ProgressEvent | GenerationResult]:
        try:
            while True:
                item = await self.next()
                yield item
                if not isinstance(item, ProgressEvent):
                    return
        finally:
            if not self._done:
                self.abort()

    async def result(self) -> GenerationResult:
        try:
            while True:
                item = await self.next()
                if not isinstance(item, ProgressEvent):
                    return item
        except asyncio.CancelledError:
            self.abort()
            raise

    def abort(self) -> bool:
        return self._abort(self)
