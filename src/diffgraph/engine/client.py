"""The engine client protocol: what the server, the metrics and the async wrapper use to talk to an engine.

An engine in this process (`AsyncEngine`, async_engine.py), an engine replica in its own process
(`ReplicaClient`, replica.py), a Ray Serve engine deployment seen from its ingress (`diffgraph.ray`) and the
`Router` over any of them (router.py) implement it: the server holds a Router (and submits to its replica when it
has only one). They can, because everything that crosses it is plain picklable data: `GenerationRequest` in; `ProgressEvent`s and one `GenerationResult` (with the encoded image
bytes) or an error out (ParamError, errors.py; QueueFullError, RequestAborted, EngineStepError, EngineClosed,
results.py); `EngineStats`, `StepEvent` and graph-table rows for monitoring. Nobody outside the engine package
reaches into an engine's scheduler, runner or graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, runtime_checkable

from ..request import GenerationRequest, GenerationResult, GroupKey, ModelInfo, ProgressEvent


@dataclass(frozen=True)
class StepEvent:
    """One denoising step: its group, live rows, the rows it cost (its batch bucket, or the rows when eager),
    its host-side wall time, and how many of its live rows were batch rows (a job's items: priority.py)."""

    key: GroupKey
    rows: int
    bucket: int
    seconds: float
    batch_rows: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's state, read when asked (e.g. at each metrics scrape)."""

    ready: bool
    queue_depth: int
    live_rows: dict[GroupKey, int]      # every graphed resolution (0 when idle), other sizes while they run
    steps: int
    failed_steps: int
    growth_holds: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    device_memory_bytes: int
    graphs: list[dict[str, Any]] = field(default_factory=list)  # the graph table (runner.GraphStats rows)
    # per batch bucket (the rows a step cost): (steps, summed host seconds) since start, per engine
    step_seconds: dict[int, tuple[int, float]] = field(default_factory=dict)
    # several replicas: per replica {"replica", "state", "restarts", "stats": EngineStats or None (not answering)}
    replicas: list[dict[str, Any]] = field(default_factory=list)
    compile_fallbacks: int = 0  # compiled callables that fell back to uncompiled code (the compile tier)
    # what the engine holds: buffer_groups (resolutions with step buffers), buffer_bytes (their
    # device bytes), pinned_bytes (host staging and adapter copies, pinned on a GPU), prompt_cache_bytes,
    # lora_host_bytes (the prepared adapter copies, bounded by --lora-host-bytes)
    memory: dict[str, int] = field(default_factory=dict)


class RequestHandle(Protocol):
    """A submitted request. `events()` yields its ProgressEvents (when asked for) and ends with its
    GenerationResult, or raises its error; leaving the iteration early aborts the request."""

    request_id: str
    # live previews its reader never got: superseded by newer ones while it lagged (engine/handles.py keeps the newest
    # few unread); 0 where the previews are bounded in another process (Ray's engine replicas)
    dropped_previews: int

    def events(self) -> AsyncIterator[ProgressEvent | GenerationResult]: ...

    async def result(self) -> GenerationResult: ...

    def abort(self) -> bool: ...


@runtime_checkable
class EngineClient(Protocol):
    info: ModelInfo

    @property
    def ready(self) -> bool:
        """Built and able to take requests (False while loading, after a loop failure, once closed)."""

    async def submit(self, request: GenerationRequest, progress: bool = False) -> RequestHandle:
        """Queues a request. Raises ParamError (bad for this model), QueueFullError (retry later), EngineClosed."""

    def abort(self, request_id: str) -> bool: ...

    def stats(self) -> EngineStats: ...

    def graph_table(self) -> list[dict[str, Any]]: ...

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """`listener(event)` after every step, on the engine's thread: keep it short."""

    def close(self) -> None: ...
