"""`Router`: one `EngineClient` over its replicas: replica processes (one engine per device, replica.py), or one
engine in this process (`AsyncEngine`). The server always holds a router (readiness, stats, the replica table are
the same for one GPU as for N); requests go through it when there is a choice to make: with one replica (`sole`)
the server submits to the replica itself, one hop less per request and no per-step progress events.

Routing: least outstanding work, counted as the remaining row-steps of each replica's requests in flight (images x
steps left, updated from their progress events); among replicas within one request's work of the least loaded,
one that already runs the request's resolution group wins (co-located rows fill batch buckets). `ready` holds
while at least `min_ready` replicas are ready, so one dead GPU does not take the host out of its load balancer;
`down` says why it never will again (too few replicas left that can be ready: the server's /health fails, so that a
supervisor restarts it); `replica_states()` lists each one. Stats are the replicas' summed, with the per-replica figures beside them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from ..request import EngineClosed, GenerationRequest, GroupKey, ModelInfo, ProgressEvent
from .client import EngineStats, StepEvent

# replica states that nothing in this process leaves: a replica left down (replica.py), an in-process engine whose
# loop stopped (async_engine.py)
GONE = ("down", "failed")


class Router:
    def __init__(self, replicas: list[Any], min_ready: int = 1):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if not 1 <= min_ready <= len(replicas):
            raise ValueError(f"min_ready {min_ready} must be in 1..{len(replicas)} (the number of replicas)")
        self.replicas = replicas
        self.min_ready = min_ready
        self.moved = 0  # requests moved to another replica before they started (their replica closed or failed)
        self._lock = threading.Lock()
        self._work: dict[str, tuple[Any, GroupKey, int, int]] = {}  # request id -> (replica, key, rows, steps left)
        # kept in step with _work, so a choice costs O(replicas), not O(requests in flight)
        self._load: dict[int, int] = {id(r): 0 for r in replicas}          # remaining row-steps per replica
        self._count: dict[int, int] = {id(r): 0 for r in replicas}         # requests in flight per replica
        self._groups: dict[int, dict[GroupKey, int]] = {id(r): {} for r in replicas}  # requests per group
        # request id -> its routed handle, so an abort by id finds a request also while it moves between replicas
        self._handles: weakref.WeakValueDictionary[str, _Tracked] = weakref.WeakValueDictionary()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until `min_ready` replicas are ready, or until every replica is ready or has given up."""
        for r in self.replicas:
            r.wait_ready(timeout)
            if self.ready and all(x.state != "starting" for x in self.replicas[:self.min_ready]):
                break
        return self.ready

    @property
    def sole(self) -> Any | None:
        """The only replica (requests go to it directly: there is nothing to choose), or None when there are more."""
        return self.replicas[0] if len(self.replicas) == 1 else None

    def check_extras(self, request: GenerationRequest) -> None:
        """ParamError naming the first capability parameter of `request` the model cannot honour, checked by an
        in-process replica (AsyncEngine.check_extras); replica processes check them when the request is submitted."""
        check = next((c for r in self.replicas if (c := getattr(r, "check_extras", None)) is not None), None)
        if check is not None:
            check(request)

    @property
    def info(self) -> ModelInfo | None:
        return next((r.info for r in self.replicas if r.info is not None), None)

    @property
    def ready(self) -> bool:
        return sum(r.ready for r in self.replicas) >= self.min_ready

    @property
    def down(self) -> str | None:
        """Why `ready` cannot hold again until the server restarts, else None: fewer than `min_ready` replicas are
        left that can become ready (the others left down after repeated crashes, or in-process engines whose loop
        stopped; a replica that is restarting or unresponsive may come back)."""
        gone = [r for r in self.replicas if r.state in GONE]
        if len(self.replicas) - len(gone) >= self.min_ready:
            return None
        return "; ".join(f"{r.name}: {r.error or r.state}" for r in gone)

    def loras(self) -> dict[str, Any] | None:
        """The adapter listing of the first replica that can give one (an in-process engine), else None."""
        for r in self.replicas:
            listing = getattr(r, "loras", None)
            if callable(listing) and r.ready:
                return listing()
        return None

    def replica_states(self) -> list[dict[str, Any]]:
        return [{"replica": r.name, "state": r.state, "restarts": getattr(r, "restarts", 0), "error": r.error,
                 "in_flight": self._in_flight(r), "pid": getattr(r, "pid", None)} for r in self.replicas]

    def _in_flight(self, replica: Any) -> int | None:
        """Requests in flight on a replica: counted here when routed, else as the sole replica counts them."""
        if self.sole is None:
            return self.outstanding(replica)[1]
        count = getattr(replica, "in_flight", None)
        return count() if callable(count) else None

    def outstanding(self, replica: Any) -> tuple[int, int]:
        """(remaining row-steps, requests) in flight on a replica."""
        with self._lock:
            return self._load[id(replica)], self._count[id(replica)]

    def choose(self, request: GenerationRequest, exclude: tuple = ()) -> Any:
        ready = [r for r in self.replicas if r.ready and r not in exclude]
        if not ready:
            raise EngineClosed("no replica is ready; retry shortly")
        cost = request.num_images * request.num_inference_steps
        with self._lock:
            loads = {id(r): self._load[id(r)] for r in ready}
            running = {id(r) for r in ready if self._groups[id(r)].get(request.key)}
        least = min(loads.values())
        close = [r for r in ready if loads[id(r)] <= least + cost]
        same_group = [r for r in close if id(r) in running]
        return min(same_group or close, key=lambda r: loads[id(r)])

    def track(self, request: GenerationRequest, replica: Any) -> None:
        """Counts a request as in flight on a replica (until `_done`)."""
        with self._lock:
            self._work[request.request_id] = (replica, request.key, request.num_images, request.num_inference_steps)
            rid = id(replica)
            self._load[rid] += request.num_images * request.num_inference_steps
            self._count[rid] += 1
            self._groups[rid][request.key] = self._groups[rid].get(request.key, 0) + 1

    async def submit_held(self, replica: Any, hold: int, request: GenerationRequest, progress: bool = False) -> Any:
        """A request for a model that `replica` holds for it (a `--model-dir` model's, remote_models.py): counted
        with the replica's work like any other, never moved (no other replica holds the model for it)."""
        if self.sole is not None:
            return await replica.submit(request, progress=progress, hold=hold)
        self.track(request, replica)
        try:
            handle = await replica.submit(request, progress=True, hold=hold)
        except BaseException:
            self._done(request.request_id)
            raise
        return self._routed(_Tracked(handle, self, request, progress, movable=False))

    def _routed(self, tracked: "_Tracked") -> "_Tracked":
        with self._lock:
            self._handles[tracked.request_id] = tracked
        return tracked

    async def submit(self, request: GenerationRequest, progress: bool = False) -> Any:
        if self.sole is not None:  # nothing to choose or to count: the replica's own handle
            return await self.sole.submit(request, progress=progress)
        refused: tuple = ()
        while True:  # a replica that refuses it as closed (it failed or died since the choice): another one
            replica = self.choose(request, exclude=refused)
            self.track(request, replica)
            try:
                # progress events keep the outstanding work per replica exact; with one replica there is no choice
                # to make, so the engine sends them only when the caller asked (no per-step events on the hot path)
                handle = await replica.submit(request, progress=progress or len(self.replicas) > 1)
                break
            except EngineClosed:
                self._done(request.request_id)
                refused += (replica,)
                if not any(r.ready and r not in refused for r in self.replicas):
                    raise
                self.moved += 1
            except BaseException:
                self._done(request.request_id)
                raise
        return self._routed(_Tracked(handle, self, request, progress))

    def _progress(self, request_id: str, event: ProgressEvent) -> None:
        with self._lock:
            w = self._work.get(request_id)
            if w is not None:
                left = event.total - event.step
                self._load[id(w[0])] -= w[2] * (w[3] - left)
                self._work[request_id] = (w[0], w[1], w[2], left)

    def _done(self, request_id: str) -> None:
        with self._lock:
            w = self._work.pop(request_id, None)
            if w is not None:
                rid = id(w[0])
                self._load[rid] -= w[2] * w[3]
                self._count[rid] -= 1
                self._groups[rid][w[1]] -= 1
                if not self._groups[rid][w[1]]:
                    del self._groups[rid][w[1]]

    def abort(self, request_id: str) -> bool:
        if self.sole is not None:
            return self.sole.abort(request_id)
        with self._lock:
            w, tracked = self._work.get(request_id), self._handles.get(request_id)
        if tracked is not None:
            return tracked.abort()
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
        step_seconds: dict[int, tuple[int, float]] = {}
        for s in got:
            for b, (n, t) in s.step_seconds.items():
                n0, t0 = step_seconds.get(b, (0, 0.0))
                step_seconds[b] = (n0 + n, t0 + t)
        replicas = [{"replica": r.name, "state": r.state, "restarts": getattr(r, "restarts", 0), "stats": s}
                    for r, s in per]
        return EngineStats(ready=self.ready, queue_depth=total("queue_depth"), live_rows=live, steps=total("steps"),
                           failed_steps=total("failed_steps"), growth_holds=total("growth_holds"),
                           prompt_cache_hits=total("prompt_cache_hits"),
                           prompt_cache_misses=total("prompt_cache_misses"),
                           compile_fallbacks=total("compile_fallbacks"),
                           device_memory_bytes=total("device_memory_bytes"), graphs=graphs, replicas=replicas,
                           step_seconds=step_seconds, memory=_summed([s.memory for s in got]))

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
    gets progress events only when it asked for them. A request that its replica answers EngineClosed before it
    ran a step (the replica died, or its failure policy tripped, while the request waited there) is submitted to
    another ready replica instead of failing; one that had started fails (retryable). The router finds it by id
    (`Router.abort`) also while it moves: the next replica's handle is aborted as it arrives."""

    def __init__(self, handle: Any, router: Router, request: GenerationRequest, progress: bool, movable: bool = True):
        self.request_id, self._request = request.request_id, request
        self._handle, self._router, self._progress, self._movable = handle, router, progress, movable
        self._started = False  # it made progress on a replica (then it is not moved: it fails, retryable)
        self._dropped = 0  # previews dropped by the handles of replicas it moved away from
        self._aborted = False
        self._moving = False  # between the replica that closed and the next one's handle: an abort waits for it

    @property
    def dropped_previews(self) -> int:
        return self._dropped + self._handle.dropped_previews

    async def events(self):
        moves = 0
        while True:
            events = self._handle.events()
            try:
                async for item in events:
                    if isinstance(item, ProgressEvent):
                        self._started = True
                        self._router._progress(self.request_id, item)
                        if not self._progress:
                            continue
                    yield item
                return
            except EngineClosed:
                moves += 1
                if self._started or not self._movable or moves > len(self._router.replicas) \
                        or not any(r.ready for r in self._router.replicas):
                    raise
                self._moving = True
            finally:
                self._router._done(self.request_id)
                await events.aclose()
            self._dropped += self._handle.dropped_previews
            try:
                replica = self._router.choose(self._request)  # it never ran: elsewhere (at most once per replica)
                self._router.track(self._request, replica)
                self._router.moved += 1
                self._handle = await replica.submit(self._request, progress=True)
            except BaseException:
                self._router._done(self.request_id)
                raise
            finally:
                self._moving = False
            if self._aborted:  # aborted while it moved: the new replica's handle is aborted too
                self._router._done(self.request_id)
                self._handle.abort()

    async def result(self):
        async for item in self.events():
            if not isinstance(item, ProgressEvent):
                return item

    def abort(self) -> bool:
        # its work leaves the replica's count now: an aborted handle's events may never be read (a late submission)
        self._movable, self._aborted = False, True
        self._router._done(self.request_id)
        return self._handle.abort() or self._moving


def _summed(parts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out
