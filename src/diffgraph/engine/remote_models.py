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
from typing import Any

from ..request import EngineClosed, GenerationRequest, ModelInfo


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


class ModelClient:
    """A held model's requests, to the replica with the hold (the default model's client is the replica itself)."""

    def __init__(self, replica: Any, info: ModelInfo, hold: int, in_flight: int = 0):
        self.replica, self.info, self.hold, self._in_flight = replica, info, hold, in_flight

    async def submit(self, request: GenerationRequest, progress: bool = False) -> Any:
        return await self.replica.submit(request, progress=progress, hold=self.hold)

    def in_flight(self) -> int:
        return self._in_flight


@dataclass
class RemoteResident:
    name: str
    client: ModelClient
    memory_bytes: int


class RemoteModels:
    """`ModelSet`'s calls, answered by the sets in `replicas` (set once the server built them; until then every call
    raises EngineClosed). With several replicas (`--devices`), each holds a set of its own on its device: a model is
    acquired where it is resident already (the least busy such replica), else on the least busy one."""

    LISTING_S = 30.0  # how long a listing waits for a replica before it counts as not answering

    def __init__(self) -> None:
        self.replicas: list[Any] = []

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
        return RemoteResident(name, ModelClient(replica, info, hold), memory_bytes)

    def release(self, resident: RemoteResident) -> None:
        resident.client.replica.tell(("release", resident.client.hold))

    def resident(self) -> list[RemoteResident]:
        """Every model resident on some replica: its bytes and requests in flight summed over the replicas."""
        merged: dict[str, RemoteResident] = {}
        for replica, view in self._views():
            for name, info, memory_bytes, in_flight in view.resident:
                known = merged.get(name)
                merged[name] = RemoteResident(name, ModelClient(replica, info, 0, in_flight + (
                    known.client.in_flight() if known else 0)), memory_bytes + (known.memory_bytes if known else 0))
        return list(merged.values())

    def loading(self) -> list[str]:
        return sorted({name for _, view in self._views() for name in view.loading})

    @property
    def errors(self) -> dict[str, str]:
        return {name: error for _, view in self._views() for name, error in view.errors.items()}

    def close(self) -> None:
        """Nothing here: each set closes with its replica process."""
