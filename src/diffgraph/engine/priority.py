"""Admission policy: scheduling classes (who goes first, which batch rows give way) and bucket growth. CPU only,
pure Python, used by the scheduler.

Two classes (`GenerationRequest.priority`): interactive rows (the images APIs, the playground, AUTOMATIC1111's
routes) go first; batch rows (a job's items) fill what they leave free, so the GPU stays full.

- Admission order inside a group (`admission_order`): interactive requests first, oldest first; then preempted
  batch requests (they resume before new ones start); then new batch requests shared fairly, first between shares
  (a job's API key), then between the share's jobs: the share with the fewest live rows in the group goes next, its
  job with the fewest live rows (round-robin, not first come first served; one key's ten jobs get the rows another
  key's one job gets), oldest first within a job.
- Preemption (`victims_order`, the scheduler's `_victims`): an interactive request that does not fit its group takes
  rows from live batch requests at the step boundary, never mid-step: the fewest batch requests that make it fit, those
  with the most steps left first. A victim keeps what its gates gave it (its adapter slots) and goes back to the waiting
  queue with its rows' whole state saved (the engine core copies them out before the step and back in at its
  re-admission), so it resumes where it stopped. Victims resume before new batch requests start and no request overtakes
  one that does not fit, so a group holds at most its `max_rows` rows saved.
- Growth into a larger bucket (`growth_limit`, step mode, graphs): the step costs what its bucket costs, so 9 live
  rows on bucket 16 pay nearly what 16 rows pay. A live group admits the longest prefix of its queue that stays
  within its current bucket or fills at least `grow_fill` of the larger bucket it grows into; once the head of the
  queue has waited `grow_hold_ms`, everything that fits (no request waits longer than that for this reason). Only
  resolutions whose steps pad to buckets (`padded`) apply it.
- Backfill (`Backfill`, step mode, conservative backfilling as cluster batch schedulers do it): a request that does
  not fit its group now is passed over with its rows reserved from the first step at which it fits (`first_fit`);
  a later request joins only where it fits beside every reservation and leaves the gates (adapter slots) admitting
  every passed-over request they admitted, so none ahead of it starts later because of it. Admission looks at
  `BACKFILL_SCAN` requests past the first one passed over at most, and none at all while a preempted request waits
  in the group (its saved rows stay the only ones) or the growth policy holds the queue. A burst of guided and
  guidance-free requests alternating (2 and 1 denoiser rows) left a row of bucket 32 empty at every other wave
  under strict FIFO, and its last request ran alone for a whole schedule.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Callable, Iterable

import numpy as np

from ..request import GroupKey
from .request_state import RequestState
from .scheduler_config import SchedulerConfig

BACKFILL_SCAN = 64  # requests not admitted that one admission pass looks at once one was passed over


def admission_order(waiting: Iterable[RequestState], live: Iterable[RequestState]) -> list[RequestState]:
    """The order in which a group's waiting requests are considered for admission (see the module docstring)."""
    interactive, resumed = [], []
    fresh: dict[str | None, dict[str | None, list[RequestState]]] = {}  # share -> job -> its queue
    for s in waiting:  # the queue is in arrival order
        if not s.batch:
            interactive.append(s)
        elif s.preempted:
            resumed.append(s)
        else:
            fresh.setdefault(s.share, {}).setdefault(s.job, []).append(s)
    held: Counter = Counter()  # live rows by share and by (share, job)
    for s in live:
        if s.batch:
            held[s.share] += s.rows
            held[(s.share, s.job)] += s.rows
    # a heap of shares, each with a heap of its jobs: (live rows, the head's arrival, a tie-breaker, name)
    jobs = {share: [(held[(share, job)], queue[0].arrival, i, job) for i, (job, queue) in enumerate(queues.items())]
            for share, queues in fresh.items()}
    for heap in jobs.values():
        heapq.heapify(heap)
    shares = [(held[share], jobs[share][0][1], i, share) for i, share in enumerate(fresh)]
    heapq.heapify(shares)
    shared, at = [], Counter()
    while shares:
        rows, _, i, share = heapq.heappop(shares)
        job_rows, _, j, job = heapq.heappop(jobs[share])
        queue = fresh[share][job]
        s = queue[at[(share, job)]]
        shared.append(s)
        at[(share, job)] += 1
        if at[(share, job)] < len(queue):
            heapq.heappush(jobs[share], (job_rows + s.rows, queue[at[(share, job)]].arrival, j, job))
        if jobs[share]:
            heapq.heappush(shares, (rows + s.rows, jobs[share][0][1], i, share))
    return interactive + resumed + shared


def victims_order(live: list[RequestState]) -> list[RequestState]:
    """The live batch requests in the order they give way: the most steps left first, then the latest admitted."""
    return sorted((s for s in live if s.batch), key=lambda s: (-(s.steps - s.step), -s.admitted_at))


def growth_limit(cfg: SchedulerConfig, key: GroupKey, live: int, order: list[RequestState],
                 now: float) -> tuple[int | None, int]:
    """Denoiser rows a live group (`live` denoiser rows now) may add at this step, and whether that held requests
    back (1 or 0, the scheduler's counter): the longest prefix of its queue (in admission order) that either stays
    within the current bucket or fills at least grow_fill of the bucket it grows into (counted in this step's
    denoiser rows); None (no limit) once the queue head has waited grow_hold_ms or where steps do not pad to
    buckets. Whether the rows fit at every later step is the scheduler's profile check."""
    if cfg.grow_fill <= 0 or not cfg.buckets or (cfg.padded and key not in cfg.padded):
        return None, 0  # no buckets here: an eager step costs its live rows, growing wastes nothing
    if (now - order[0].arrival) * 1e3 >= cfg.grow_hold_ms:
        return None, 0
    current = cfg.bucket_for(live)
    rows, best = live, live
    for s in order:  # the prefixes admission could take
        if rows + s.cost > cfg.max_rows:
            break
        rows += s.cost
        if rows <= current or rows >= cfg.grow_fill * cfg.bucket_for(rows):
            best = rows
    return best - live, int(best < rows)


class Backfill:
    """Conservative backfill in one admission pass (see the module docstring): every request passed over is reserved
    its rows from its first fit on, so no later one admitted now delays it; one admitted now must also leave the
    gates (adapter slots) admitting every passed-over request they admitted. Reservations are made only when a
    later request fits this step beside the live rows (most do not, in a full group: they cost a comparison)."""

    def __init__(self, capacity: int, gates_admit: Callable[[RequestState], bool]):
        self.capacity, self.gates_admit = capacity, gates_admit
        self.pending: list[tuple[RequestState, np.ndarray]] = []  # passed over, not yet reserved
        self.gated: list[RequestState] = []  # reserved, with the gates admitting them then
        self.looked = 0

    def pass_over(self, state: RequestState, need: np.ndarray) -> None:
        self.pending.append((state, need))

    def fits(self, state: RequestState, need: np.ndarray, profile: np.ndarray) -> tuple[np.ndarray, bool]:
        """Whether `state` (per-step demand `need`) fits now beside `profile` and every reservation; returns the
        profile with the reservations made so far. One that does not fit is passed over."""
        if len(need) and len(profile) and profile[0] + need[0] > self.capacity:
            self.pass_over(state, need)
            return profile, False
        for s, n in self.pending:  # reserve those passed over, in order, each from its first fit
            profile = add_at(profile, n, first_fit(profile, n, self.capacity))
            if self.gates_admit(s):
                self.gated.append(s)
        self.pending = []
        if first_fit(profile, need, self.capacity) == 0:
            return profile, True
        self.pass_over(state, need)
        return profile, False

    def open(self, profile: np.ndarray) -> bool:
        """After a request was not admitted: whether to look further (a row is free now, under BACKFILL_SCAN)."""
        self.looked += 1
        return self.looked < BACKFILL_SCAN and (not len(profile) or profile[0] < self.capacity)

    def keeps_gates(self, state: RequestState, release: Callable[[list[RequestState]], None]) -> bool:
        """After `state`'s gates took their part: whether every reserved request they admitted still is; if not,
        `state` gives back what it took."""
        if all(self.gates_admit(s) for s in self.gated):
            return True
        release([state])
        return False


def first_fit(profile: np.ndarray, need: np.ndarray, capacity: int) -> int:
    """The first step from now (0: this one) at which a request of per-step demand `need` fits beside `profile`
    (per future step, this one first); at the latest when the profile ends (`need` is within `capacity`: the
    scheduler refuses requests larger than its largest bucket)."""
    if not len(need):
        return 0
    padded = np.concatenate([profile, np.zeros(len(need), dtype=np.int64)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, len(need))[:len(profile) + 1]
    return int(np.argmax((windows + need <= capacity).all(axis=1)))


def add_at(profile: np.ndarray, need: np.ndarray, at: int = 0) -> np.ndarray:
    """`profile` (denoiser rows per future step, this one first) with `need` added from step `at` on."""
    out = np.zeros(max(len(profile), at + len(need)), dtype=np.int64)
    out[:len(profile)] += profile
    out[at:at + len(need)] += need
    return out
