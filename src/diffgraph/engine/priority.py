"""Admission policy: scheduling classes (who goes first, which batch rows give way) and bucket growth. CPU only,
pure Python, used by the scheduler.

Two classes (`GenerationRequest.priority`): interactive rows (the images APIs, the playground, AUTOMATIC1111's
routes) go first; batch rows (a job's items) fill what they leave free, so the GPU stays full.

- Admission order inside a group (`admission_order`): interactive requests first, oldest first; then preempted
  batch requests (they resume before new ones start); then new batch requests shared fairly between jobs: the job
  with the fewest live rows in the group goes next (round-robin between jobs, not first come first served), oldest
  first within a job.
- Preemption (`victims_order`, the scheduler's `_victims`): an interactive request that does not fit its group takes rows from live batch requests at
  the step boundary, never mid-step: the fewest batch requests that make it fit, those with the most steps left
  first. A victim keeps what its gates gave it (its adapter slots) and goes back to the waiting queue with its rows'
  whole state saved (the engine core copies them out before the step and back in at its re-admission), so it
  resumes where it stopped. Victims resume before new batch requests start and no request overtakes one that does
  not fit, so a group holds at most its `max_rows` rows saved.
- Growth into a larger bucket (`growth_limit`, step mode, graphs): the step costs what its bucket costs, so 9 live
  rows on bucket 16 pay nearly what 16 rows pay. A live group admits the longest prefix of its queue that stays
  within its current bucket or fills at least `grow_fill` of the larger bucket it grows into; once the head of the
  queue has waited `grow_hold_ms`, everything that fits (no request waits longer than that for this reason). Only
  resolutions whose steps pad to buckets (`padded`) apply it.
- Backfill (step mode): when a request does not fit its group now, the requests behind it (up to `BACKFILL_SCAN`)
  may join only where the first step at which it fits (`first_fit`) stays the same, so it starts no later than
  without them (conservative backfilling, as batch schedulers of clusters do). A burst of guided and guidance-free
  requests alternating (2 and 1 denoiser rows) left a row of bucket 32 empty at every other wave, and its last
  request ran alone for a whole schedule. A preempted request that does not fit is not backfilled past (its saved
  rows stay the only ones).
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable

import numpy as np

from ..request import GroupKey
from .request_state import RequestState
from .scheduler_config import SchedulerConfig

BACKFILL_SCAN = 64  # requests behind one that does not fit that admission considers in one step


def admission_order(waiting: Iterable[RequestState], live: Iterable[RequestState]) -> list[RequestState]:
    """The order in which a group's waiting requests are considered for admission (see the module docstring)."""
    interactive, resumed, fresh = [], [], {}
    for s in waiting:  # the queue is in arrival order
        if not s.batch:
            interactive.append(s)
        elif s.preempted:
            resumed.append(s)
        else:
            fresh.setdefault(s.job, []).append(s)
    held: Counter = Counter()
    for s in live:
        if s.batch:
            held[s.job] += s.rows
    heap = [(held[job], queue[0].arrival, i, job) for i, (job, queue) in enumerate(fresh.items())]
    heapq.heapify(heap)
    shared, at = [], dict.fromkeys(fresh, 0)
    while heap:
        rows, _, i, job = heapq.heappop(heap)
        queue = fresh[job]
        s = queue[at[job]]
        shared.append(s)
        at[job] += 1
        if at[job] < len(queue):
            heapq.heappush(heap, (rows + s.rows, queue[at[job]].arrival, i, job))
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


def first_fit(profile: np.ndarray, need: np.ndarray, capacity: int) -> int:
    """The first step from now (0: this one) at which a request of per-step demand `need` fits beside `profile`
    (the live rows' demand per future step, this one first); at the latest when the profile ends (`need` is within
    `capacity`: the scheduler refuses requests larger than its largest bucket)."""
    for t in range(len(profile)):
        rest = profile[t:t + len(need)]
        if (rest + need[:len(rest)] <= capacity).all():
            return t
    return len(profile)
