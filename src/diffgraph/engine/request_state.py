"""`RequestState`: one request inside the engine, as the scheduler sees it (CPU data only, no torch).

The scheduler's bookkeeping around the user's `GenerationRequest` (its rows, plan, step, first row, its denoiser
rows per image row at each step: one, or two where classifier-free guidance runs) and the engine's opaque handles
for it (where its answer goes, its noise generator once admitted, its adapters and their slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ..request import GenerationRequest, GenerationResult, GroupKey, ProgressEvent, Size
from ..sampling.samplers import SamplerPlan

logger = logging.getLogger(__name__)


class RequestSink(Protocol):
    """Where one request's answer goes (the engine core calls it). Called from the engine's threads: keep both
    calls short."""

    def progress(self, event: ProgressEvent) -> None: ...

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        """Exactly one of the two; later calls (after the first) are ignored by the sink."""


@dataclass(eq=False)
class RequestState:
    """One request inside the engine: the scheduler's bookkeeping around the user's `GenerationRequest`, and
    the engine's opaque handles for it (where its answer goes, its noise generator once admitted)."""

    request_id: str
    key: GroupKey              # the group its rows run in (the family's key for its size)
    rows: int
    plan: SamplerPlan
    arrival: float
    step: int = 0
    first_row: int = -1
    aborted: bool = False
    request: GenerationRequest | None = None
    sink: RequestSink | None = None  # the engine core's answer channel (progress, result, error)
    generator: Any = None      # the request's own noise generator, made at admission
    noise: Any = None          # its Brownian-tree noise (sampling.sde.BrownianNoise) where its plan draws that
    admitted_at: float = 0.0
    text_adapters: tuple = ()  # what the text encoders run with for its prompts (its capabilities', at admission)
    controls: tuple = ()       # its resolved ControlNet controls (controlnets.ResolvedControl), if any
    image_prompts: dict = field(default_factory=dict)  # its image prompt's row fields (ip_adapters.py), if any
    admitted: dict[str, Any] = field(default_factory=dict)  # what each admission gate took for it (by gate name)
    variant_parts: tuple = ()  # the request's parts of the step variant key (the row features', at admission)
    prompts: tuple = ()        # (prompt, negative prompt) as text/prepared.PromptText, prepared at submit
    empty_prompt: Any = None   # the empty prompt that pads the shorter of the two (their windows differ)
    # a prompt schedule's conditioning by the evaluation (its `step`) it starts at (engine/prompt_schedule.py)
    switches: dict = field(default_factory=dict)
    preview_future: Any = None  # its last live preview's send (engine/previews.py), awaited before its result
    batch: bool = False        # its scheduling class (priority.py): a job's item (batch) or interactive
    job: str | None = None     # its job (batch rows share the class fairly by share, then by job)
    share: str | None = None   # its job's API key
    size: Size | None = None   # its image (height, width); None: the key (a UNet family's group is its size)
    prepared: dict = field(default_factory=dict)  # its registered capabilities' preparations (features/capability.py)
    preempted: bool = False    # it gave its rows to an interactive request and waits to resume (priority.py)
    saved: Any = None          # its rows' whole state while preempted (the engine core's copy, opaque here)
    edit_pixels: Any = None    # an edit's preprocessed image and mask (engine/edits.py, at submit)
    final_latents: Any = None  # its last step's image latents on the host, where it asked (`return_latents`)
    # its plan's (plain attributes: the scheduler reads them per request): steps, and denoiser rows per image row at
    # each step (SamplerPlan.branches: 2 where classifier-free guidance runs both branches; None: 1 everywhere)
    steps: int = field(init=False)
    branches: np.ndarray | None = field(init=False)
    # what follows from `step` (plain attributes as well; `advance` is the one way `step` moves): denoiser rows per
    # image row at this step, what the request costs now, the most it costs at any step from now on (what admission
    # reserves, so a row that starts guiding mid-schedule never overflows its group), the denoiser rows it needs at
    # each of its remaining steps, this one first (admission checks them against the group's capacity at every
    # future step; a view, never written), and whether it is done
    branches_now: int = field(init=False)
    cost: int = field(init=False)
    peak: int = field(init=False)
    demand: np.ndarray = field(init=False)
    done: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.size is None:
            self.size = self.key
        self.steps, self.branches = self.plan.num_steps, self.plan.branches
        per_row = np.ones(self.steps, dtype=np.int64) if self.branches is None else \
            np.asarray(self.branches, dtype=np.int64)
        self._demands = self.rows * per_row  # its denoiser rows at each step
        self._demands.flags.writeable = False  # `demand` is a view of it, shared with whoever reads it
        # the most from each step on (its last step's once done; one row's worth for a plan of no steps)
        self._peaks = np.maximum.accumulate(self._demands[::-1])[::-1] if self.steps else np.full(1, self.rows)
        self._derive()

    def advance(self) -> None:
        """One step done: its step, and what follows from it."""
        self.step += 1
        self._derive()

    def _derive(self) -> None:
        i = min(self.step, len(self._peaks) - 1)
        self.cost = int(self._demands[i]) if self.steps else self.rows
        self.branches_now, self.peak = self.cost // self.rows, int(self._peaks[i])
        self.demand = self._demands[self.step:]
        self.done = self.step >= self.steps

    @classmethod
    def of(cls, request: GenerationRequest, plan: SamplerPlan, arrival: float, sink: Any = None,
           prompts: tuple = (), key: GroupKey | None = None) -> "RequestState":
        """`key`: the group its rows run in (the model family's for its size; None: the size itself)."""
        return cls(request_id=request.request_id, key=request.key if key is None else key, size=request.key,
                   rows=request.num_images, plan=plan,
                   arrival=arrival, request=request, sink=sink,
                   batch=request.priority == "batch", job=request.job, share=request.share,
                   prompts=prompts)

    def take_edit_pixels(self) -> Any:
        """Its edit's preprocessed pixels, once (admission encodes them; the request does not keep them after)."""
        pixels, self.edit_pixels = self.edit_pixels, None
        return pixels


def call_safely(fn: Callable[..., Any], *args: Any) -> None:
    """Calls a caller's callback (a sink, a listener): its failure is logged, never the engine's."""
    try:
        fn(*args)
    except Exception:  # a caller's callback must not stop the engine
        logger.exception("callback %r failed", fn)


def fail_request(state: RequestState, error: BaseException) -> None:
    """Answers the request with `error`."""
    call_safely(state.sink.finish, None, error)


def schedule_length(plan: SamplerPlan, hires_of: int | None = None) -> tuple[int, int | None]:
    """AUTOMATIC1111's prompt-schedule length for a request's plan (engine/prompt_schedule.py), its steps times its
    denoiser evaluations per step, and for a hires fix's second pass (`hires_of`: the first pass's steps) the first
    pass's (the second pass's length is then the steps it runs, as AUTOMATIC1111's hr pass counts its own)."""
    index = np.asarray(plan.step_index, dtype=np.int64)
    per_step = int(np.bincount(index - index.min()).max()) if index.size else 1
    if hires_of is None:
        return max(1, plan.steps) * per_step, None
    return max(1, len(np.unique(index))) * per_step, hires_of * per_step
