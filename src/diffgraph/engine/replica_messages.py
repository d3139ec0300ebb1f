"""The messages of a replica's pipe, typed: what the server's side (engine/replica.py) and the replica process
(engine/replica_process.py) send each other, each kind one frozen dataclass (they are pickled across the pipe).

Parent to replica: `Submit` (a request, whether it streams progress, the held model of a set it goes to), `Abort`,
`Ask` (a question with a token its `Answer` carries back: stats, the adapter listing, a set's models or one to
acquire), `Release` (a set's held model), `Close`.
Replica to parent: `Ready` (the engine's info and the CPU's timed steps), `Failed`, `Beat` (how long the engine
loop has been in its current pass), `Accepted` / `Rejected` (a submit's answer), `Progress`, `Done` (a request's
result or error), `Step` (a step's metrics event), `Answer`, and `Batch` (small messages queued together, sent as
one). A Ray engine replica's request stream (ray.py, read by ray_ingress.py) is `Accepted` or `Rejected`, its progress
events, then `Done`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ASKS = ("stats", "loras", "acquire", "models")  # the questions an `Ask` may put


# -- parent to replica ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request: Any            # request.GenerationRequest
    progress: bool = False  # stream its progress events
    hold: int | None = None  # a model set's held model (remote_models.py); None: the replica's engine


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Ask:
    what: str           # one of ASKS
    token: int          # its Answer's
    args: tuple = ()    # acquire: (model, seconds); loras: (model,) or ()


@dataclass(frozen=True)
class Release:
    hold: int


@dataclass(frozen=True)
class Close:
    pass


# -- replica to parent ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    info: Any                  # request.ModelInfo
    step_s: tuple | None = None  # the CPU's warm steps at two sizes ((pixels, seconds), ...), or None


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Beat:
    busy_s: float = 0.0  # how long the engine loop has been in its current pass (0: idle, or still building)


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    error: BaseException


@dataclass(frozen=True)
class Progress:
    request_id: str
    step: int
    total: int
    previews: tuple = ()
    preview_format: str | None = None

    def event(self) -> Any:
        from ..request import ProgressEvent
        return ProgressEvent(self.request_id, self.step, self.total, self.previews, self.preview_format)


@dataclass(frozen=True)
class Done:
    request_id: str
    result: Any = None            # results.GenerationResult (without its request: the parent has it)
    error: BaseException | None = None


@dataclass(frozen=True)
class Step:
    event: Any  # async_engine.StepEvent


@dataclass(frozen=True)
class Answer:
    token: int
    value: Any  # the answer, or the exception that is the caller's answer


@dataclass(frozen=True)
class Batch:
    messages: tuple
