"""`RequestHandleImpl`: one request's answers, carried from the thread that produces them (an engine's loop in
this process, or a replica's pipe reader) to the asyncio event loop that waits for them. Torch-free: the HTTP
process holds these for requests whose engine lives in a replica process.

The engine never waits for a reader, so a reader that lags (a slow stream client) would hold every preview the
engine made meanwhile. A later preview supersedes an earlier one: the handle holds at most the newest
PREVIEWS_KEPT unread ones and drops the oldest; progress events (small, one a step) and the result are never dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, AsyncIterator, Callable

from ..request import GenerationRequest, GenerationResult, ProgressEvent

_DONE = object()
PREVIEWS_KEPT = 4  # a few: a reader briefly behind (a busy event loop) loses none, one that stays behind the oldest


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
        self._queue: deque = deque()  # touched on the event loop only (`_append`, `next`)
        self._ready = asyncio.Event()
        self._previews = 0  # unread preview events in the queue
        self.dropped_previews = 0
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
            self._loop.call_soon_threadsafe(self._append, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _append(self, item: Any) -> None:
        if _is_preview(item):
            if self._previews >= PREVIEWS_KEPT:  # the reader lags: the oldest unread preview is superseded
                del self._queue[next(i for i, queued in enumerate(self._queue) if _is_preview(queued))]
                self.dropped_previews += 1
            else:
                self._previews += 1
        self._queue.append(item)
        self._ready.set()

    async def next(self) -> ProgressEvent | GenerationResult:
        """The next progress event, or the result (raising the request's error)."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        item = self._queue.popleft()
        if isinstance(item, ProgressEvent):
            self._previews -= _is_preview(item)
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


def _is_preview(item: Any) -> bool:
    return isinstance(item, ProgressEvent) and bool(item.previews)
