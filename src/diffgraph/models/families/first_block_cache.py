"""First-block cache per row for transformer (DiT) families: ParaAttention's "First Block Cache"
(chengzeyi/ParaAttention, README "First Block Cache (Our Dynamic Caching)"; diffusers' `FirstBlockCacheConfig`,
cache-dit's FBCache and WaveSpeed's `residual_diff_threshold`), decided per row inside the batched step.

A request's `step_cache` {"method": "first_block", "threshold": t} decides, per model evaluation of the row's own
plan: the transformer's input embedding, refiners and first block run for the row (a family hands its blocks over as
`Blocks`: a single-stream stack, or a double-stream one whose first double block's image stream is compared, as
ParaAttention's Flux adapter does); the first block's output residual r (its output minus its input, over the row's
real image tokens and every CFG branch it runs) is compared with the one kept from the row's last full evaluation, r_prev: mean|r - r_prev| / mean|r_prev|. Below t (strictly, as
ParaAttention's `diff < threshold`), the row skips the remaining blocks and adds its kept remaining-blocks residual
(the last block's output minus the first block's, from its last full evaluation) to the first block's output; else
it runs the remaining blocks and keeps both residuals anew. The first evaluation, and one that runs a different
number of CFG branches than the evaluation before it (a guidance interval opening or closing), always run in full
(host data: the plan's column `fbc.force`). ParaAttention and diffusers have no cap on consecutive reuses, so
neither has this (WaveSpeed's optional `max_consecutive_cache_hits` defaults to none).

The cost: the decision reads device values, so a step with first-block rows is two-phase: phase one runs the
embedding, refiners and first block over every denoiser row and reduces the rows' differences on the device; then
one device-to-host copy of the per-row decisions (a few bytes), which waits for the stream to finish phase one (a
stream sync: the host cannot queue phase two's kernels ahead, so the GPU idles for the host's launch latency of
phase two); phase two runs the remaining blocks over the gathered rows that compute. Such a step cannot be one
CUDA graph replay: it runs eagerly. No sync happens in a step where no row uses this method, nor where every
first-block row is forced full or has threshold 0 (the host knows those compute). The kept residuals are one
per-row field (`fbc.kept`, [2 branches, 2, image tokens, model width] in the model's dtype: per branch the first
block's residual and the remaining blocks'), compacted, saved and restored with the row; lazy: a group holds it
once a first-block row is admitted there (`FieldSpec.lazy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ...errors import ParamError
from ...features.base import Admission, FieldSpec, RowFeature, StepView
from ...request import GenerationRequest

NAME = "step_cache"
METHOD = "first_block"
COLUMNS = ("fbc.on", "fbc.threshold", "fbc.force")
# (hidden states [n, L, width], per-row arguments [n, ...] each) -> hidden states: one transformer block
Block = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class FirstBlock:
    """One request's first-block cache setting."""

    threshold: float

    def infotext(self) -> str:
        return f"first_block threshold {self.threshold:g}"


def read_first_block(value: dict[str, Any]) -> FirstBlock:
    """A `step_cache` object whose method is "first_block"; ParamError naming the field."""
    extra = sorted(set(value) - {"method", "threshold"})
    if extra:
        raise ParamError(f"{NAME}.{extra[0]}", f"step_cache has no field {extra[0]!r} with method \"first_block\"; "
                                               "allowed: method, threshold")
    if "threshold" not in value:
        raise ParamError(f"{NAME}.threshold", "step_cache.threshold is missing; first_block needs a number >= 0 "
                                              "(the relative first-block residual change below which a row reuses)")
    v = value["threshold"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ParamError(f"{NAME}.threshold", f"step_cache.threshold must be a finite number >= 0, got {v!r} (0: "
                                              "every evaluation full)")
    return FirstBlock(float(v))


def forced(branches: np.ndarray) -> np.ndarray:
    """The evaluations that run in full whatever their residual: the first, and each that runs a different number of
    CFG branches than the one before it."""
    b = np.asarray(branches)
    out = np.ones(len(b), dtype=bool)
    out[1:] = b[1:] != b[:-1]
    return out


@dataclass(frozen=True)
class FirstBlockStep:
    """The step's part: `rows` the denoiser rows (local to the denoiser call) of first-block rows, `slots` their kept
    residuals' rows (image row * 2 + branch), `group` each one's image row among the step's first-block image rows;
    per group its `threshold` and whether it is `force`d full; `gather` False: the remaining blocks run over every
    row (another feature sets per-row denoiser state) and only the reusing rows' outputs are replaced."""

    rows: tuple[int, ...]
    slots: tuple[int, ...]
    group: tuple[int, ...]
    threshold: tuple[float, ...]
    force: tuple[bool, ...]
    gather: bool = True

    def decided(self) -> bool:
        """Whether the host knows every group computes (forced, or threshold 0): no residual is compared."""
        return all(f or t <= 0 for f, t in zip(self.force, self.threshold))


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


class Blocks(NamedTuple):
    """A transformer's blocks as the first-block cache splits them: `first(state, *args)` the first block's output
    state, `rest(state, *args)` the remaining blocks from it up to the output's image tokens [n, tokens, width], and
    `image(state)` a state's image tokens [n, tokens, width]. A state is the blocks' hidden states, rows first: one
    tensor (a single-stream stack) or a tuple (the image and text streams of a double-stream one)."""

    first: Callable[..., Any]
    rest: Callable[..., torch.Tensor]
    image: Callable[[Any], torch.Tensor]


def sequential(layers: Sequence[Block], tokens: int) -> Blocks:
    """`Blocks` of a single-stream stack over hidden states [n, image tokens + text tokens, width], image tokens
    first (`tokens` of them)."""
    def rest(u: torch.Tensor, *args: Any) -> torch.Tensor:
        for layer in layers[1:]:
            u = layer(u, *args)
        return u[:, :tokens]
    return Blocks(layers[0], rest, lambda u: u[:, :tokens])


def _pick(args: Sequence[Any], idx: torch.Tensor, n: int) -> list[Any]:
    return [a.index_select(0, idx) if isinstance(a, torch.Tensor) and a.shape[:1] == (n,) else a for a in args]


def _reuse(step: FirstBlockStep, first: torch.Tensor, kept: torch.Tensor, slots: torch.Tensor,
           real: torch.Tensor) -> list[bool]:
    """Per group, whether it reuses: the relative mean absolute difference of its first-block residuals `first` and
    kept ones (over its real image tokens and branches) below its threshold, unless forced. One device-to-host copy
    (the step's sync)."""
    if step.decided():
        return [False] * len(step.force)
    prev = kept[:, 0].index_select(0, slots)
    w = real.unsqueeze(-1).float()
    num = ((first.float() - prev.float()).abs() * w).sum(dim=(1, 2))
    den = (prev.float().abs() * w).sum(dim=(1, 2))
    g = _index(step.group, first.device)
    groups = len(step.force)
    num = first.new_zeros(groups, dtype=torch.float32).index_add_(0, g, num)
    den = first.new_zeros(groups, dtype=torch.float32).index_add_(0, g, den)
    threshold = torch.tensor(step.threshold, dtype=torch.float32, device=first.device)
    below = (num / den < threshold).cpu().tolist()  # NaN (nothing kept) compares False: the group computes
    return [b and not f for b, f in zip(below, step.force)]


def run_blocks(blocks: Blocks, state: Any, args: Sequence[Any], image_mask: torch.Tensor,
               fbc: tuple[FirstBlockStep, torch.Tensor] | None) -> torch.Tensor:
    """The transformer's blocks from hidden states `state` with per-row `args` (tensors with a row each are
    gathered with the rows), to the output's image tokens [n, tokens, width] (their real ones marked by `image_mask`
    [n, tokens]); `fbc` (the step's part and the kept residuals [slots, 2, tokens, width]) None: every block over
    every row. Else two-phase (module docstring): a reusing row's image tokens are its first block's plus its kept
    remaining residual."""
    if fbc is None:
        return blocks.rest(blocks.first(state, *args), *args)
    step, kept = fbc
    n = image_mask.shape[0]
    s1 = blocks.first(state, *args)
    out = i1 = blocks.image(s1)
    rows = _index(step.rows, i1.device)
    first = i1.index_select(0, rows) - blocks.image(state).index_select(0, rows)
    slots = _index(step.slots, i1.device)
    reuse = _reuse(step, first, kept, slots, image_mask.index_select(0, rows))
    reusing = [i for i, g in enumerate(step.group) if reuse[g]]
    skip = {step.rows[i] for i in reusing}
    run = [j for j in range(n) if j not in skip] if step.gather else list(range(n))
    if len(run) == n:
        out = blocks.rest(s1, *args)
    elif run:
        idx = _index(run, i1.device)
        part = s1.index_select(0, idx) if isinstance(s1, torch.Tensor) else tuple(s.index_select(0, idx) for s in s1)
        out = i1.index_copy(0, idx, blocks.rest(part, *_pick(args, idx, n)))
    computing = [i for i, g in enumerate(step.group) if not reuse[g]]
    if computing:
        at = _index(computing, i1.device)
        local = rows.index_select(0, at)
        rest = (out - i1).index_select(0, local)
        fresh = torch.stack([first.index_select(0, at), rest], dim=1).to(kept.dtype)
        kept.index_copy_(0, slots.index_select(0, at), fresh)
    if reusing:
        at = _index(reusing, i1.device)
        local = rows.index_select(0, at)
        rest = kept[:, 1].index_select(0, slots.index_select(0, at)).to(i1.dtype)
        out = out.index_copy(0, local, i1.index_select(0, local) + rest)
    return out


# -- the row feature ------------------------------------------------------------------------------------------------
class FirstBlockRows(RowFeature):
    """The first-block cache's row feature (columns `COLUMNS`, field `fbc.kept`); `spec_of` reads a request's step
    cache setting (a `FirstBlock` where it uses this method), `width` and `dtype` the transformer's."""

    name = "first_block"

    def __init__(self, spec_of: Callable[[GenerationRequest], Any], width: int, dtype: torch.dtype):
        self._spec_of, self._width, self._dtype = spec_of, width, dtype

    def _spec(self, request: GenerationRequest) -> FirstBlock | None:
        spec = self._spec_of(request)
        return spec if isinstance(spec, FirstBlock) else None

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {"fbc.kept": FieldSpec((2, 2, latent_shape[0], self._width), self._dtype, lazy=True)}

    def columns(self) -> tuple[str, ...]:
        return COLUMNS

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        spec = self._spec(request)
        if spec is None:
            return {}
        return {"fbc.on": np.ones(len(index)), "fbc.threshold": np.full(len(index), spec.threshold)}

    def after_plan(self, table: np.ndarray, columns: dict[str, int], branches: np.ndarray) -> None:
        if len(table) and table[0, columns["fbc.on"]] > 0:
            table[:, columns["fbc.force"]] = forced(branches)

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        return {"fbc.kept": 0.0} if self._spec(admission.request) is not None else {}

    def part(self, admission: Admission) -> Any:
        return "on" if self._spec(admission.request) is not None else None

    def variant(self, parts: Sequence[Any]) -> Any:
        return next((p for p in parts if p), None)

    def step_part(self, part: Any, coefs: np.ndarray, columns: dict[str, int], index: np.ndarray, d: int,
                  gather: bool = True) -> Any:
        if part is None:
            return None
        image = index[:d, 0]
        on = coefs[image, columns["fbc.on"]] > 0
        rows = [j for j in range(d) if on[j]]
        groups = sorted({int(image[j]) for j in rows})
        where = {r: g for g, r in enumerate(groups)}
        return FirstBlockStep(tuple(rows), tuple(int(image[j] * 2 + index[j, 1]) for j in rows),
                              tuple(where[int(image[j])] for j in rows),
                              tuple(float(coefs[r, columns["fbc.threshold"]]) for r in groups),
                              tuple(bool(coefs[r, columns["fbc.force"]] > 0.5) for r in groups), gather)

    def eager(self, part: Any) -> bool:
        return part is not None

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, Any]:
        if not isinstance(part, FirstBlockStep) or not part.rows:
            return {}
        return {"fbc.step": (part, view.lazy("fbc.kept").flatten(0, 1))}


class BothSteps(NamedTuple):
    """The step's part of `StepCacheRows`: the fixed-interval method's and the first-block one's (None: no such row)."""

    fixed: Any
    first: FirstBlockStep | None

    def __str__(self) -> str:  # the graph kind's suffix: a fixed-interval step's own ("_run2"); a first-block step
        return (str(self.fixed) if self.fixed is not None else "") + ("" if self.first is None else "_first_block")


class StepCacheRows(RowFeature):
    """The step cache of a token family that offers two methods: one row feature over a fixed-interval one (`fixed`,
    whose step part names the rows the denoiser runs over as `run`) and the first-block one (`first`); a request uses
    at most one of them."""

    def __init__(self, name: str, fixed: RowFeature, first: FirstBlockRows, asked_by: Any):
        self.name, self.asked_by = name, asked_by
        self._both = (fixed, first)

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {k: v for f in self._both for k, v in f.fields(latent_shape).items()}

    def columns(self) -> tuple[str, ...]:
        return tuple(c for f in self._both for c in f.columns())

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v for f in self._both for k, v in f.plan_columns(request, index).items()}

    def after_plan(self, table: np.ndarray, columns: dict[str, int], branches: np.ndarray) -> None:
        for f in self._both:
            f.after_plan(table, columns, branches)

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        return {k: v for f in self._both for k, v in f.rows(admission).items()}

    def part(self, admission: Admission) -> Any:
        parts = tuple(f.part(admission) for f in self._both)
        return parts if any(parts) else None

    def variant(self, parts: Sequence[Any]) -> Any:
        live = [p for p in parts if p]
        if not live:
            return None
        return tuple(f.variant([p[i] for p in live]) for i, f in enumerate(self._both))

    def step_part(self, part: Any, coefs: np.ndarray, columns: dict[str, int], index: np.ndarray, d: int,
                  gather: bool = True) -> Any:
        if part is None:
            return None
        taylor, first_block = self._both
        first = first_block.step_part(part[1], coefs, columns, index, d, gather) if part[1] else None
        # beside first-block rows (a two-phase, eager step) TaylorSeer gathers nothing: the transformer runs over the
        # step's rows as they are (the forecast rows' outputs replaced), so the first-block part indexes them as is
        fixed = taylor.step_part(part[0], coefs, columns, index, d, gather and first is None) if part[0] else None
        return BothSteps(fixed, first)

    def eager(self, part: Any) -> bool:
        return part is not None and any(f.eager(p) for f, p in zip(self._both, part) if p is not None)

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, Any]:
        if part is None:
            return {}
        return {k: v for f, p in zip(self._both, part) for k, v in f.denoiser_inputs(view, p).items()}
