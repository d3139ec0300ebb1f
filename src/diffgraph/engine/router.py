"""`Router`: one `EngineClient` over several replicas (one engine per device, each in its own process).

Routing: least outstanding work, counted as the remaining row-steps of each replica's requests in flight (images x
steps left, updated from their progress events); among replicas within one request's work of the least loaded,
one that already runs the request's resolution group wins (co-located rows fill batch buckets). `ready` holds
while at least `min_ready` replicas are ready, so one dead GPU does not take the host out of its load balancer;
`replica_states()` lists each one. Stats are the replicas' summed, with the per-replica figures beside them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..request import EngineClosed, GenerationRequest, GroupKey, ModelInfo, ProgressEvent
from .client import EngineStats, StepEvent


class Router:
    def __init__(self, replicas: list[Any], min_ready: int = 1):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if not 1 <= min_ready <= len(replicas):
            raise ValueError(f"min_ready {min_ready} must be in 1..{len(replicas)} (the number of replicas)")
        self.replicas = replicas
        self.min_ready = min_ready
        self._lock = threading.Lock()
        self._work: dict[str, tuple[Any, GroupKey, int, int]] = {}  # request id -> (replica, key, rows, steps left)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until `min_ready` replicas are ready, or until every replica is ready or has given up."""
        for r in self.replicas:
            r.wait_ready(timeout)
            if self.ready and all(x.state != "starting" for x in self.replicas[:self.min_ready]):
                break
        return self.ready

    @property
    def info(self) -> ModelInfo | None:
        return next((r.info for r in self.replicas if r.info is not None), None)

    @property
    def ready(self) -> bool:
        return sum(r.ready for r in self.replicas) >= self.min_ready

    def replica_states(self) -> list[dict[str, Any]]:
        return [{"replica": r.name, "state": r.state, "restarts": getattr(r, "restarts", 0), "error": r.error,
                 "in_flight": self.outstanding(r)[1]} for r in self.replicas]

    def outstanding(self, replica: Any) -> tuple[int, int]:
        """(remaining row-steps, requests) in flight on a replica."""
        with self._lock:
            mine = [w for w in self._work.values() if w[0] is replica]
        return sum(rows * left for _, _, rows, left in mine), len(mine)

    def choose(self, request: GenerationRequest) -> Any:
        ready = [r for r in self.replicas if r.ready]
        if not ready:
            raise EngineClosed("no replica is ready; retry shortly")
        cost = request.num_images * request.num_inference_steps
        loads = {id(r): self.outstanding(r)[0] for r in ready}
        least = min(loads.values())
        with self._lock:
            running = {id(w[0]) for w in self._work.values() if w[1] == request.key}
        close = [r for r in ready if loads[id(r)] <= least + cost]
        same_group = [r for r in close if id(r) in running]
        return min(same_group or close, key=lambda r: loads[id(r)])

    async def submit(self, request: GenerationRequest, progress: bool = False) -> Any:
        replica = self.choose(request)
        with self._lock:
            self._work[request.request_id] = (replica, request.key, request.num_images, request.num_inference_steps)
        try:
            handle = await replica.submit(request, progress=True)
        except BaseException:
            with self._lock:
                self._work.pop(request.request_id, None)
            raise
        return _Tracked(handle, self, request.request_id, progress)

    def _progress(self, request_id: str, event: ProgressEvent) -> None:
        with self._lock:
            w = self._work.get(request_id)
            if w is not None:
                self._work[request_id] = (w[0], w[1], w[2], event.total - event.step)

    def _done(self, request_id: str) -> None:
        with self._lock:
            self._work.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            w = self._work.get(request_id)
        return w is not None and w[0].abort(request_id)

    def stats(self) -> EngineStats:
        per = [(r, r.stats()) for r in self.replicas]
        got = [s for _, s in per if s is not None]
        live: dict[GroupKey, int] = {}
        for s in got:
            for k, n in s.live_rows.items():
                live[k] = live.get(k, 0) + n

        def total(name: str) -> int:
            return sum(getattr(s, name) for s in got)
        graphs = [{**row, "replica": r.name} for r, s in per if s is not None for row in s.graphs]
        return EngineStats(ready=self.ready, queue_depth=total("queue_depth"), live_rows=live, steps=total("steps"),
                           failed_steps=total("failed_steps"), growth_holds=total("growth_holds"),
                           prompt_cache_hits=total("prompt_cache_hits"),
                           prompt_cache_misses=total("prompt_cache_misses"),
                           device_memory_bytes=total("device_memory_bytes"), graphs=graphs)

    def graph_table(self) -> list[dict[str, Any]]:
        return self.stats().graphs

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        for r in self.replicas:
            r.add_step_listener(listener)

    def close(self) -> None:
        for r in self.replicas:
            r.close()


class _Tracked:
    """A replica's handle, seen through the router: progress updates the replica's outstanding work; the caller
    gets progress events only when it asked for them."""

    def __init__(self, handle: Any, router: Router, request_id: str, progress: bool):
        self.request_id = request_id
        self._handle, self._router, self._progress = handle, router, progress

    async def events(self):
        events = self._handle.events()
        try:
            async for item in events:
                if isinstance(item, ProgressEvent):
                    self._router._progress(self.request_id, item)
                    if not self._progress:
                        continue
                yield item
        finally:
            self._router._done(self.request_id)
            await events.aclose()

    async def result(self):
        async for item in self.events():
            if not isinstance(item, ProgressEvent):
                return item

    def abort(self) -> bool:
        return self._handle.abort()
