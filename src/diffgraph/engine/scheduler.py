"""The scheduler: which rows run next. CPU only (numpy, no torch), so it is tested with a fake runner.

Requests wait in one queue per resolution group. Each iteration `schedule()` picks one group, admits
waiting requests of that group into free rows at the step boundary (FIFO within a scheduling class: interactive
requests first, batch rows fair-shared between jobs, taking batch rows' places when they must: priority.py), and
hands the model runner a
`StepPlan`: row moves that keep live rows contiguous, the admitted requests and their first rows, and
the coefficient table of every live row for this step. `update()` advances the rows and retires the
finished requests. The denoiser rows a group's live requests need (a guiding row costs two, any other row one) never
exceed `max_rows` (the largest batch bucket) at any step: their per-step schedules are known at admission, so a
request joins only where its schedule fits beside the others' at every future step (a row that starts guiding
mid-schedule never overflows its group, and rows about to stop guiding make room for those that start).

Batching modes, on the same path:
  step     requests join between steps and leave when done (continuous batching);
  request  a group admits only when empty: requests with the same step count, up to max_rows or
           until max_wait_ms after the first arrived, run to the end together (the seed design);
  off      one request at a time in the whole engine.

Growth into a larger bucket (step mode, graphs) and backfill behind a request that does not fit: priority.py.

Across groups the oldest request goes first: the group holding the earliest-arrived live or admissible
request runs, which finishes old requests sooner than round-robin would (lower tail latency when
several resolutions are busy). The bound: a group with work that has been passed over `max_skips`
times in a row runs next, so no group starves whatever arrives elsewhere. Groups with interactive work go before
groups of batch rows only (the bound holds within each class).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..request import GroupKey, ParamError, QueueFullError, RequestAborted
from .priority import Backfill, admission_order, growth_limit, victims_order
from .request_state import RequestState
from .scheduler_config import BATCHING_MODES, MAX_HOLD_MS, AdmissionGate, SchedulerConfig

__all__ = ["BATCHING_MODES", "MAX_HOLD_MS", "QueueFullError", "RequestAborted", "RequestState", "Scheduler",
           "SchedulerConfig", "StepPlan"]


@dataclass
class StepPlan:
    """What the model runner does this iteration, for one group."""

    key: GroupKey
    moves: list[tuple[int, int, int]]     # (src, dst, count) row copies, in order, before admission
    admitted: list[RequestState]          # new requests: write their rows at state.first_row
    live: list[RequestState]              # every live request in row order (admitted included)
    coefs: np.ndarray                     # [n_rows, NUM_COEFS] this step's coefficients, row order
    cost_rows: int = 0                    # set by the engine core once it ran: its graph bucket, or n_rows if eager
    # batch requests preempted this iteration and the first row they held: their rows are saved before the moves
    preempted: list[tuple[RequestState, int]] = field(default_factory=list)
    resumed: list[RequestState] = field(default_factory=list)  # preempted ones back: restore at state.first_row
    # plain data, fixed when the plan is made (the core and the step listeners read them per step)
    n_rows: int = field(init=False)
    noise_requests: list[RequestState] = field(init=False)  # the live requests whose row draws noise this step

    def __post_init__(self) -> None:
        self.n_rows = self.coefs.shape[0]
        self.noise_requests = [s for s in self.live if s.plan.draws_noise and s.plan.noise_steps[s.step]]


@dataclass
class _Group:
    key: GroupKey
    waiting: deque = field(default_factory=deque)
    live: list[RequestState] = field(default_factory=list)
    skipped: int = 0  # iterations in a row this group had work but another group ran
    dirty: bool = False  # rows were freed: compact before the next step

    @property
    def live_rows(self) -> int:
        return sum(s.rows for s in self.live)

    @property
    def cost_now(self) -> int:
        """Denoiser rows its live requests cost at this step."""
        return sum(s.cost for s in self.live)

    def profile(self) -> np.ndarray:
        return _profile(self.live)

    def interactive(self) -> bool:  # an interactive request is live or waiting here (before batch-only groups)
        return any(not s.batch for s in (*self.live, *self.waiting))


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.groups: dict[GroupKey, _Group] = {}
        self._aborted: list[RequestState] = []
        self._ids: dict[str, RequestState] = {}  # request id -> its newest state in flight (found without a scan)
        self.steps_run = 0
        self.growth_holds = 0  # admissions cut short by the bucket growth policy (requests left waiting)
        self.gates: tuple[AdmissionGate, ...] = ()
        self._keep = partial(self._release, leaving=False)  # gives back gate units of a request that stays waiting

    # -- intake --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(g.waiting) for g in self.groups.values())

    @property
    def num_live_rows(self) -> int:
        return sum(g.live_rows for g in self.groups.values())

    def has_work(self) -> bool:
        return bool(self._aborted) or any(g.waiting or g.live for g in self.groups.values())

    def is_idle(self, key: GroupKey) -> bool:  # no live or waiting request in this group
        g = self.groups.get(key)
        return g is None or not (g.live or g.waiting)

    def add(self, state: RequestState) -> None:
        if state.peak > self.config.max_rows:
            per = state.peak // state.rows
            raise ParamError("num_images", f"num_images {state.rows} exceeds the largest batch bucket "
                                           f"{self.config.max_rows}" + (
                                               f" ({state.peak} denoiser rows: classifier-free guidance costs {per} "
                                               + (f"per image; use num_images <= {self.config.max_rows // per})"
                                                  if self.config.max_rows >= per else
                                                  f"per image; start the engine with a batch bucket of at least {per}: --buckets)")
                                               if per > 1 else ""))
        if self._in_flight(self._ids.get(state.request_id)):
            raise ParamError("request_id", f"request_id {state.request_id!r} is already in flight; give each request its own id "
                             "(or leave request_id unset)")
        if self.num_waiting >= self.config.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests); retry later "
                                 "or raise max_queue")
        self.groups.setdefault(state.key, _Group(state.key)).waiting.append(state)
        self._ids[state.request_id] = state

    def abort(self, request_id: str, owner: Any = None) -> bool:
        """Marks a request aborted; its rows are freed at the next step boundary. False if unknown. With `owner`,
        only the request whose sink is that object."""
        s = self._ids.get(request_id)
        if not self._in_flight(s) or (owner is not None and s.sink is not owner):
            return False
        s.aborted = True
        if s in (g := self.groups[s.key]).waiting:  # a live one is dropped at the next step boundary
            g.waiting.remove(s)
            self._aborted.append(s)
            self._release([s])  # a preempted request still holds what its gates gave it
        return True

    def _in_flight(self, s: RequestState | None) -> bool:  # waits or is live, not aborted
        return s is not None and not s.aborted and (g := self.groups.get(s.key)) is not None and (
            s in g.waiting or s in g.live)

    def drain(self) -> list[RequestState]:
        """Every waiting and live request, taken out with nothing given back (the engine fails them: closed)."""
        out = [s for g in self.groups.values() for s in (*g.waiting, *g.live)]
        self.groups, self._ids = {}, {}
        return out

    def take_aborted(self) -> list[RequestState]:
        """Requests aborted since the last call (their rows are already free)."""
        out, self._aborted = self._aborted, []
        return out

    # -- one iteration -------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Picks a group, admits into it, and returns its step; None when nothing can run now."""
        now = self.clock()
        for g in self.groups.values():
            self._drop_aborted(g)
        # a group without work is forgotten (it is made again on demand): any multiple of 8 is a valid size,
        # so keeping every size ever asked for would grow this dict, the per-step scan and the metrics labels
        self.groups = {k: g for k, g in self.groups.items() if g.waiting or g.live}
        ready = [(since, g) for g in self.groups.values() if (since := self._ready_since(g, now)) is not None]
        if not ready:
            return None
        if any(g.interactive() for _, g in ready):  # batch-only groups wait while interactive ones have work
            ready = [(since, g) for since, g in ready if g.interactive()]
        starved = [(g.skipped, since, g) for since, g in ready if g.skipped >= self.config.max_skips]
        best = max(starved, key=lambda t: (t[0], -t[1]))[2] if starved else min(ready, key=lambda t: t[0])[1]
        for _, g in ready:
            g.skipped = 0 if g is best else g.skipped + 1
        preempted = self._preempt(best)
        moves = self._compact(best)
        admitted, resumed = self._admit(best, now)
        if not best.live:
            return None
        coefs = np.concatenate([np.broadcast_to(s.plan.coefs[s.step], (s.rows, s.plan.coefs.shape[1]))
                                for s in best.live])
        return StepPlan(best.key, moves, admitted, list(best.live), coefs, preempted=preempted, resumed=resumed)

    def update(self, plan: StepPlan) -> list[RequestState]:
        """After a successful step: advances every live row; returns the finished requests (rows freed)."""
        self.steps_run += 1
        g = self.groups[plan.key]
        finished = []
        for s in plan.live:
            s.advance()
            if s.done:
                finished.append(s)
        if finished:
            g.live = [s for s in g.live if not s.done]
            g.dirty = True
            self._release(finished)
        return finished

    def remove(self, state: RequestState) -> None:
        """Takes one live request out (its admission failed); its rows are freed at the next step."""
        g = self.groups[state.key]
        if state in g.live:
            g.live.remove(state)
            g.dirty = True
            self._release([state])

    def fail(self, plan: StepPlan) -> list[RequestState]:
        """After a failed step: every request of that batch leaves; the group starts empty."""
        g = self.groups[plan.key]
        failed, g.live = g.live, []
        for s, _ in plan.preempted:  # preempted this step but their rows were not saved: they cannot resume
            if s.saved is None and s in g.waiting:
                g.waiting.remove(s)
                failed.append(s)
        g.dirty = False
        self._release(failed)
        return failed

    def next_deadline(self) -> float | None:
        """Seconds until a waiting request becomes admissible (for the engine loop's wait), or None."""
        now = self.clock()
        waits = []
        for g in self.groups.values():
            if g.waiting and not g.live and (not self.gates or self._admissible(g)):
                waits.append(max(0.0, g.waiting[0].arrival + self.config.max_wait_ms / 1e3 - now))
        return min(waits) if waits else None

    # -- policy --------------------------------------------------------------------------------
    def _ready_since(self, g: _Group, now: float) -> float | None:
        """The arrival of the group's oldest request that could run now, or None."""
        if g.live:
            return min(s.arrival for s in g.live)
        if not g.waiting or not self._may_start(g, now) or (self.gates and not self._admissible(g)):
            return None
        return g.waiting[0].arrival

    def _may_start(self, g: _Group, now: float) -> bool:
        """Whether an empty group may admit now."""
        mode = self.config.batching
        if mode == "off" and any(o.live for o in self.groups.values()):
            return False
        if mode == "off":
            return True
        head = g.waiting[0]
        if now >= head.arrival + self.config.max_wait_ms / 1e3:
            return True
        # the batch is already full (in request mode: of requests with the head's step count): no reason to wait
        return sum(s.peak for s in g.waiting if mode != "request" or s.steps == head.steps) >= self.config.max_rows

    def _admit(self, g: _Group, now: float) -> tuple[list[RequestState], list[RequestState]]:
        """Admits waiting requests: (new ones, preempted ones resuming)."""
        mode = self.config.batching
        if (mode in ("request", "off") and g.live) or not g.waiting or (not g.live and not self._may_start(g, now)):
            return [], []
        profile = g.profile()
        # one class (no batch rows here): the queue's own order
        order = admission_order(g.waiting, g.live) if any(s.batch for s in (*g.waiting, *g.live)) else list(g.waiting)
        # step mode, a live group: denoiser rows it may add at this step (the bucket growth policy), or None; an
        # interactive request is not held back beside batch rows (they fill the bucket for it)
        held, growth = order[0].batch or not any(s.batch for s in g.live), None
        if mode == "step" and g.live and held:
            growth, holds = growth_limit(self.config, g.key, g.cost_now, order, now)
            self.growth_holds += holds
        added, cap, head_steps, admitted, resumed = 0, self.config.max_rows, order[0].steps, [], []
        backfill = None  # step mode: requests passed over, their rows reserved from their first fits (priority.py)
        for s in order:
            if mode == "off" and admitted:
                break
            if mode == "request" and s.steps != head_steps:
                continue
            need = s.demand
            if backfill is not None:  # it must fit beside the reservations of those passed over (or is passed over)
                profile, room = backfill.fits(s, need, profile)
            else:
                room = _fits(profile, need, cap) and (growth is None or added + s.cost <= growth)
            if room:  # (one that waits for what its gates give, adapter slots, lets those behind it join)
                if self._take(s) and (backfill is None or backfill.keeps_gates(s, self._keep)):
                    g.waiting.remove(s)
                    s.first_row = g.live_rows
                    g.live.append(s)
                    (resumed if s.preempted else admitted).append(s)
                    s.preempted = False
                    profile = _plus(profile, need)
                    added += s.cost
                    continue
            elif mode != "step":
                continue
            elif backfill is None:
                if growth is not None or s.preempted or (not s.batch and any(o.preempted for o in g.waiting)):
                    break  # FIFO: nothing passes the growth policy or a preempted request (its saved rows; they
                    # come before new batch requests, after interactive ones)
                backfill = Backfill(cap, self._gates_admit)
                backfill.pass_over(s, need)
            if backfill is not None and not backfill.open(profile):
                break
        return admitted, resumed

    def _preempt(self, g: _Group) -> list[tuple[RequestState, int]]:
        """Step mode: live batch requests that give their rows to the group's waiting interactive requests
        (priority.py), back in the queue; returns them with the first row they held."""
        if self.config.batching != "step" or not any(s.batch for s in g.live):
            return []
        out: list[tuple[RequestState, int]] = []
        live = list(g.live)  # the live rows once this iteration's interactive requests are in
        for s in [s for s in g.waiting if not s.batch]:  # oldest first, as admission takes them; one waiting for
            # adapter slots, not rows, or too large even without batch rows, preempts nothing (nor those behind it)
            gone = _victims(live, s.demand, self.config.max_rows) if self._gates_admit(s) else None
            if gone is None:
                break
            for v in gone:
                out.append((v, v.first_row))
                v.preempted = True
                live.remove(v)
                g.live.remove(v)
                g.waiting.appendleft(v)
                g.dirty = True
            live.append(s)
        return out

    def _drop_aborted(self, g: _Group) -> None:
        gone = [s for s in g.live if s.aborted]
        if gone:
            g.live = [s for s in g.live if not s.aborted]
            g.dirty = True
            self._aborted.extend(gone)
            self._release(gone)

    def _take(self, s: RequestState) -> bool:
        """Every gate admits `s`, or none keeps what it took (all or nothing). A preempted request kept its own."""
        if s.preempted:
            return True
        taken: dict[str, Any] = {}
        for gate in self.gates:
            got = gate.admit(s)
            if got is None:
                for earlier in self.gates:
                    if earlier.name in taken:
                        earlier.release(s, taken[earlier.name])
                return False
            taken[gate.name] = got
        s.admitted.update(taken)
        return True

    def _release(self, states: list[RequestState], leaving: bool = True) -> None:
        """Gives back what the gates gave `states`; `leaving`: they leave (their ids may be used again)."""
        for s in states:
            if leaving and self._ids.get(s.request_id) is s:
                del self._ids[s.request_id]
            for gate in self.gates:
                if gate.name in s.admitted:
                    gate.release(s, s.admitted.pop(gate.name))

    def _admissible(self, g: _Group) -> list[RequestState]:
        """The waiting requests every gate would let in now (all of them without gates)."""
        return [s for s in g.waiting if self._gates_admit(s)]

    def _gates_admit(self, s: RequestState) -> bool:
        return all(gate.can_admit(s) for gate in self.gates)

    def _compact(self, g: _Group) -> list[tuple[int, int, int]]:
        """Row moves that pack the live requests at rows [0, n) in their current order."""
        if not g.dirty:
            return []
        g.dirty = False
        moves, row = [], 0
        for s in g.live:
            if s.first_row != row:
                moves.append((s.first_row, row, s.rows))
                s.first_row = row
            row += s.rows
        return moves


def _profile(states: list[RequestState]) -> np.ndarray:
    """Denoiser rows the requests need at each future step (this one first): their schedules are known, and every
    live row advances one step per step of the group."""
    demands = [s.demand for s in states]
    out = np.zeros(max((len(d) for d in demands), default=0), dtype=np.int64)
    for d in demands:
        out[:len(d)] += d
    return out


def _fits(profile: np.ndarray, need: np.ndarray, capacity: int) -> bool:
    """Whether `need` added to `profile` (both per future step, this one first) stays within `capacity` throughout."""
    n = min(len(profile), len(need))
    return bool((profile[:n] + need[:n] <= capacity).all() and (need[n:] <= capacity).all())


def _plus(profile: np.ndarray, need: np.ndarray) -> np.ndarray:  # (priority.add_at from step 0: no crossing)
    out = np.zeros(max(len(profile), len(need)), dtype=np.int64)
    out[:len(profile)] += profile
    out[:len(need)] += need
    return out


def _victims(live: list[RequestState], need: np.ndarray, capacity: int) -> list[RequestState] | None:
    """The fewest live batch requests whose rows, taken away, let a request of per-step demand `need` fit within
    `capacity` (priority.py's order): [] when it fits already, None when it cannot even without every batch row."""
    taken: list[RequestState] = []
    for s in [None, *victims_order(live)]:
        if s is not None:
            taken.append(s)
        if _fits(_profile([o for o in live if o not in taken]), need, capacity):
            return taken
    return None
