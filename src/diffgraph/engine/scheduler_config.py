"""`SchedulerConfig`: the scheduler's settings (batching mode, rows, queue, waits, buckets, the growth policy), checked
when made, and `AdmissionGate`, what the scheduler is given besides them. Pure Python; scheduler.py re-exports the
config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import smallest_bucket
from ..request import GroupKey
from .request_state import RequestState

BATCHING_MODES = ("step", "request", "off")
MAX_HOLD_MS = 60_000.0  # the longest max_wait_ms / grow_hold_ms: how long a request may wait for company


@dataclass(frozen=True)
class SchedulerConfig:
    batching: str = "step"
    max_rows: int = 16          # rows live per group: the largest batch bucket
    max_wait_ms: float = 0.0    # admission into an EMPTY group waits this long for company
    max_queue: int = 256        # waiting requests, all groups together
    max_skips: int = 1          # a group with work is passed over at most this many iterations in a row (one step
    #                             of another resolution at most: no size starves another beyond one step each)
    buckets: tuple[int, ...] = ()   # batch buckets the model runner pads to (graphs); () = a step costs its rows
    padded: tuple[GroupKey, ...] = ()  # the resolutions whose steps pad to `buckets` (graphed); () = all
    grow_fill: float = 0.85     # step mode: grow into a larger bucket only when filling this fraction of it...
    grow_hold_ms: float = 2000.0  # ...or when the head of the queue has waited this long

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching {self.batching!r} is unknown; allowed: {', '.join(BATCHING_MODES)}")
        for name in ("max_rows", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        for name in ("max_wait_ms", "grow_hold_ms", "max_skips"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} {getattr(self, name)} must be a finite number >= 0")
        for name in ("max_wait_ms", "grow_hold_ms"):  # a request may be held this long: keep it bounded
            if getattr(self, name) > MAX_HOLD_MS:
                raise ValueError(f"{name} {getattr(self, name)} is above {MAX_HOLD_MS:g} (a minute): requests would "
                                 f"wait that long for company; use a smaller value")
        if not 0.0 <= self.grow_fill <= 1.0:  # NaN fails this too
            raise ValueError(f"grow_fill {self.grow_fill} must be in [0, 1] (0 turns the growth policy off)")
        if list(self.buckets) != sorted(set(self.buckets)) or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets {self.buckets} must be distinct positive integers in increasing order")

    def bucket_for(self, rows: int) -> int:
        """The rows a step of `rows` live rows costs: the smallest bucket >= rows, else rows (eager)."""
        return smallest_bucket(self.buckets, rows) or rows


class AdmissionGate(Protocol):
    """What a request needs besides rows before it may join (e.g. LoRA adapter slots): CPU bookkeeping only,
    called on the engine loop's thread under the scheduler's lock. Gates compose: a request joins when every gate
    admits it; what each took is kept in `RequestState.admitted[gate.name]` by the scheduler and handed back."""

    name: str

    def can_admit(self, state: RequestState) -> bool: ...

    def admit(self, state: RequestState) -> Any | None:
        """Takes what the request needs and returns it; None: it keeps waiting (requests behind it may join)."""

    def release(self, state: RequestState, taken: Any) -> None:
        """The request's rows left (finished, failed, aborted): `taken` is what `admit` returned."""
