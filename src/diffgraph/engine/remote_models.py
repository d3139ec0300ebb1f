"""A `--model-dir` model set in the engine's replica process, seen from the server's process (torch-free).

The set itself (engine/model_set.py: every resident model's core on the replica's one device loop, loads on a
loader thread, LRU eviction by count and bytes) lives in the replica (replica_process.py); the server's
`ModelRouting` (server/models.py) holds a `RemoteModels`, which answers the same calls over the replica's pipe:

    acquire(name, timeout) -> RemoteResident   # ("acquire", token, name, seconds) -> (hold id, ModelInfo, bytes)
    release(resident)                          # ("release", hold id): after the request was submitted (the pipe
                                               #  keeps order, so the model stays held until its submit ran)
    resident(), loading(), errors              # ("models", token) -> ModelsView

A held model's requests go to the replica with their hold id (`ModelClient.submit`), and the replica submits them
to that model's engine. A replica that dies answers every call waiting on it with EngineClosed (503, retryable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..request import EngineClosed, GenerationRequest, ModelInfo
from .replica_messages import Release


@dataclass(frozen=True)
class ModelSetSpec:
    """What a replica needs to hold a `--model-dir` set (picklable: it crosses to the spawned process)."""

    root: str
    default: str                     # the default --model (held for good: /ready follows it)
    max_models: int = 2
    memory_bytes: int | None = None
    preload: tuple[str, ...] = ()    # loaded at start, beside the default (catalog names)


@dataclass(frozen=True)
class ModelsView:
    """The set's state when asked: resident models as (name, ModelInfo, memory bytes, requests in flight)."""

    resident: list[tuple[str, ModelInfo, int, int]] = field(default_factory=list)
    loading: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # the last load failure per model
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # per resident model: queue, steps, live rows


class ModelClient:
    """A held model's requests, to the replica with the hold through the router (which counts them with that
    replica's work); the default model's client is the router itself."""

    def __init__(self, router: Any, replica: Any, info: ModelInfo, hold: int, in_flight: int = 0):
        self.router, self.replica, self.info, self.hold, self._in_flight = router, replica, info, hold, in_flight

    async def submit(self, request: GenerationRequest, progress: bool = False) -> Any:
        return await self.router.submit_held(self.replica, self.hold, request, progress)

    def in_flight(self) -> int:
        return self._in_flight


@dataclass
class RemoteResident:
    name: str
    client: ModelClient
    memory_bytes: int


def merged_residents(views: Any, client: Any) -> list[RemoteResident]:
    """The resident models of the replicas' views (pairs of a replica and its `ModelsView`), each once: bytes and
    requests in flight summed, its client `client(replica, info, in_flight)`."""
    merged: dict[str, RemoteResident] = {}
    for replica, view in views:
        for name, info, memory_bytes, in_flight in view.resident:
            known = merged.get(name)
            total = in_flight + (known.client.in_flight() if known else 0)
            merged[name] = RemoteResident(name, client(replica, info, total),
                                          memory_bytes + (known.memory_bytes if known else 0))
    return list(merged.values())


def status_rows(views: Any) -> list[dict[str, Any]]:
    """/status's per-model rows from (replica name, `ModelsView`) pairs: each resident model on each replica."""
    return [{"model": name, "replica": replica, "in_flight": in_flight, "memory_bytes": memory_bytes,
             **view.stats.get(name, {})}
            for replica, view in views for name, _, memory_bytes, in_flight in view.resident]


class ModelsBackend(Protocol):
    """What the server's `ModelRouting` asks of a model set in other processes: `RemoteModels` over replica
    processes, `RayModels` (ray.py) over a Ray engine deployment."""

    def acquire(self, name: str, timeout: float | None = None) -> RemoteResident: ...
    def release(self, resident: RemoteResident) -> None: ...
    def resident(self) -> list[RemoteResident]: ...
    def loading(self) -> list[str]: ...
    @property
    def errors(self) -> dict[str, str]: ...
    def status(self) -> list[dict[str, Any]]:
        """/status's per-model rows: each resident model on each replica, with its engine's figures."""
        return status_rows((replica.name, view) for replica, view in self._views())

    def loras(self, name: str) -> dict[str, Any] | None: ...
    def close(self) -> None: ...


class RemoteModels:
    """`ModelSet`'s calls, answered by the sets of the router's replicas (set once the server built them; until then
    every call raises EngineClosed). With several replicas (`--devices`), each holds a set of its own on its device:
    a model is acquired where it is resident already (the least busy such replica), else on the least busy one."""

    LISTING_S = 30.0  # how long a listing waits for a replica before it counts as not answering

    def __init__(self) -> None:
        self.router: Any = None  # the server's Router over the replicas (engine/router.py), once built

    @property
    def replicas(self) -> list[Any]:
        return [] if self.router is None else self.router.replicas

    def _views(self) -> list[tuple[Any, ModelsView]]:
        """The ready replicas with their sets' views (a replica that does not answer is left out)."""
        views = []
        for replica in self.replicas:
            answer = replica.ask("models", self.LISTING_S) if replica.ready else None
            if isinstance(answer, ModelsView):
                views.append((replica, answer))
        return views

    def acquire(self, name: str, timeout: float | None = None) -> RemoteResident:
        """Blocks until the model is resident and held (loading it first), as `ModelSet.acquire`: ModelLoadError,
        TimeoutError (still loading after `timeout` s), EngineClosed (no replica is there)."""
        views = self._views()
        if not views:
            states = ", ".join(r.state for r in self.replicas) or "starting"
            raise EngineClosed(f"the engine process is {states}; retry shortly")

        def busy(view: ModelsView) -> int:
            return sum(in_flight for *_, in_flight in view.resident)
        holding = [(r, v) for r, v in views if any(m[0] == name for m in v.resident)]
        replica, _ = min(holding or views, key=lambda rv: busy(rv[1]))
        seconds = 3600.0 if timeout is None else max(0.0, timeout)
        answer = replica.ask("acquire", None, name, seconds)  # the replica bounds the wait by `seconds`
        if answer is None:
            raise EngineClosed(f"the engine process did not answer for model {name!r} (it is {replica.state}); "
                               "retry shortly")
        if isinstance(answer, BaseException):
            raise answer
        hold, info, memory_bytes = answer
        return RemoteResident(name, ModelClient(self.router, replica, info, hold), memory_bytes)

    def release(self, resident: RemoteResident) -> None:
        resident.client.replica.tell(Release(resident.client.hold))

    def resident(self) -> list[RemoteResident]:
        """Every model resident on some replica: its bytes and requests in flight summed over the replicas."""
        return merged_residents(self._views(), lambda replica, info, in_flight: ModelClient(
            self.router, replica, info, 0, in_flight))

    def loading(self) -> list[str]:
        return sorted({name for _, view in self._views() for name in view.loading})

    def status(self) -> list[dict[str, Any]]:
        """/status's per-model rows: each resident model on each replica, with its engine's figures."""
        return [{"model": name, "replica": replica.name, "in_flight": in_flight, "memory_bytes": memory_bytes,
                 **view.stats.get(name, {})}
                for replica, view in self._views() for name, _, memory_bytes, in_flight in view.resident]

    def loras(self, name: str) -> dict[str, Any] | None:
        """The adapter listing of model `name` as a replica where it is resident sees it (its slots), or None when
        it is resident nowhere."""
        for replica, view in self._views():
            if any(m[0] == name for m in view.resident):
                answer = replica.ask("loras", self.LISTING_S, name)
                if isinstance(answer, BaseException):
                    raise answer
                if answer is not None:
                    return answer
        return None

    @property
    def errors(self) -> dict[str, str]:
        return {name: error for _, view in self._views() for name, error in view.errors.items()}

    def close(self) -> None:
        """Nothing here: each set closes with its replica process."""
