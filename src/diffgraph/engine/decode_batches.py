"""Finished batch rows wait a few steps for companions before their decode. CPU bookkeeping only, used by the engine
core on its loop thread; the core decodes what `due` returns.

Why: one VAE replay of 4 images costs less per image than smaller ones (`tools/probe_decode.py`; BENCHMARKS.md: a
2,000-image job). Requests admitted together finish together
and decode together. Interactive requests break a job's waves apart: each one takes a batch row's place at its own
step and gives it back 20 steps later, so without gathering the job's rows finish, and decode, one at a time. Held
rows have left the scheduler already: their latents are copied out, their buffer rows reused. No device work here:
a decode is returned as its requests and their latents' parts, which the caller joins inside its own failure handling
(a device that failed must answer the requests, never lose them).

Rules (a row is an image; `size` is the largest decode replay):
- an interactive request never waits: it decodes at once; it takes held batch rows of its group with it only when
  they fill its decode's last replay to `size` rows (1 interactive row takes 3 held ones, never 1 or 2: 2 held rows
  riding along cost more with it than they do filling a full replay later);
- batch rows are held until their group holds `size` rows (then the oldest that fill whole replays go, the rest
  wait on: a job's rows finishing 5 at once beside people went as replays of 4 + 1), or its oldest held row has
  waited `hold_steps` engine steps, or no live batch row is left in its group (nothing would join them);
- `due(None, ...)` (the engine has nothing to step) and `take_all()` (the engine stops) give back everything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..request import GroupKey
from .request_state import RequestState

Decode = tuple[GroupKey, list[RequestState], list[torch.Tensor]]  # a decode to launch: group, requests, latents' parts


@dataclass
class _Held:
    states: list[RequestState] = field(default_factory=list)
    latents: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the engine step at which each was held (oldest first)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.states)


class DecodeBatches:
    def __init__(self, size: int, hold_steps: int):
        if size < 1 or hold_steps < 0:
            raise ValueError(f"decode batches need size >= 1 and hold_steps >= 0 (got {size}, {hold_steps})")
        self.size, self.hold_steps = size, hold_steps
        self._held: dict[GroupKey, _Held] = {}
        self.holding = False  # rows are held (an attribute, kept by due and take_all: read every engine poll)

    def due(self, key: GroupKey | None, finished: list[RequestState], latents: torch.Tensor | None, step: int,
            more_coming: bool) -> list[Decode]:
        """After engine step `step` of group `key` (None: no step ran), whose `finished` requests' rows are
        `latents` (in their order); `more_coming`: live batch rows are left in that group. Returns the decodes to
        launch now: (group, requests, their latents' parts in order)."""
        out = []
        if key is not None and finished:
            people, row = [], 0
            held = self._held.setdefault(key, _Held())
            for s in finished:  # latents rows follow the requests' order
                part = latents[row:row + s.rows]
                row += s.rows
                if s.batch:
                    held.states.append(s)
                    held.latents.append(part)
                    held.steps.append(step)
                else:
                    people.append((s, part))
            if people:
                out.append(self._with_people(key, people))
        for k, held in list(self._held.items()):
            waited = bool(held.steps) and step - held.steps[0] >= self.hold_steps  # its oldest row's wait
            if not held.states or key is None or waited or (k == key and not more_coming):
                del self._held[k]
                if held.states:
                    out.append((k, held.states, held.latents))
            elif k == key and held.rows >= self.size:
                out.append(self._full(k, held))
        self.holding = bool(self._held)
        return out

    def _with_people(self, key: GroupKey, people: list[tuple[RequestState, torch.Tensor]]) -> Decode:
        """The interactive rows' decode, with the oldest held rows of their group when those fill its last replay
        to `size` rows exactly."""
        states, parts = [s for s, _ in people], [p for _, p in people]
        need = -sum(s.rows for s in states) % self.size
        held = self._held[key]
        taken, rows = 0, 0
        while need and taken < len(held.states) and rows + held.states[taken].rows <= need:
            rows += held.states[taken].rows
            taken += 1
        if need and rows == need:
            states, parts = states + held.states[:taken], parts + held.latents[:taken]
            del held.states[:taken], held.latents[:taken], held.steps[:taken]
        return key, states, parts

    def _full(self, key: GroupKey, held: _Held) -> Decode:
        """A group holding `size` rows or more: its oldest rows that fill whole replays go; the rest wait on from
        their own steps (9 held: 8 go, the newest waits for companions), unless no prefix of the held requests
        fills whole replays (a 3-row request, then a 2-row one; a 5-row request first): then all go."""
        whole, taken, rows = held.rows - held.rows % self.size, 0, 0
        while taken < len(held.states) and rows + held.states[taken].rows <= whole:
            rows += held.states[taken].rows
            taken += 1
        if rows % self.size or not taken:  # (the oldest request alone has more rows than whole replays hold)
            taken = len(held.states)
        states, latents = held.states[:taken], held.latents[:taken]
        del held.states[:taken], held.latents[:taken], held.steps[:taken]
        if not held.states:
            del self._held[key]
        return key, states, latents

    def take_all(self) -> list[Decode]:
        """Everything held (the engine is stopping, or has failed: the caller answers them)."""
        out = [(k, h.states, h.latents) for k, h in self._held.items()]
        self._held.clear()
        self.holding = False
        return out
