"""Step caching for transformer (DiT) families over tokens: TaylorSeer's fixed-interval prediction per row (Liu et al.,
2025, "From Reusing to Forecasting"), as a capability with a row feature.

A request's `step_cache` ("off"; "auto"; or {"method": "taylorseer", "interval": N, "order": 1 | 2}) decides, per
model evaluation of the row's own plan (the evaluation index e is the Taylor variable: a two-evaluation sampler's
two halves count as two), whether the transformer runs for the row ("full": evaluations 0, N, 2N, ...) or its
output is forecast from the last full ones. At a full evaluation e the row keeps its output F and its finite
differences over the evaluation distance to the last full one, dist: D1 = (F - F_last) / dist and, with order 2,
D2 = (D1 - D1_last) / dist (each only once the full evaluations before it exist, else 0, as TaylorSeer builds its
factors); at a cached evaluation k evaluations after the last full one, the output is F + D1 k + D2 k^2 / 2, and the
transformer does not run for the row. An evaluation that runs a different number of CFG branches than the last full
one (a guidance interval opening or closing) is full and starts the differences again.

The plan is host data (coefficient columns `taylor.order`, `taylor.reuse`, `taylor.c1`, `taylor.c2`: at a cached
evaluation the forecast's coefficients k and k^2 / 2, at a full one 1 / dist for D1 and D2, 0 where a difference
does not exist yet); each step the host turns the live rows' columns into the step's graph variant (`TaylorKey`: how
many rows the transformer runs over, rounded up to a power of two), and the step finds those rows on the device (a
stable sort of the forecast flag read from the step's coefficient table), so the transformer runs only over the rows
that need it (padded with forecast ones, whose outputs are replaced), every shape depends on the key and the batch
alone, and a step with cache rows replays the CUDA graph of its key (registered and captured at its first use), with
no device sync. The kept terms are one per-row field (`taylor.terms`, [2, 3, tokens, C] fp32: per CFG branch F, D1,
D2), read and written for every row of the step with static-shaped gathers and scatters, compacted, saved and
restored with the row.

{"method": "first_block", "threshold": t} is the data-dependent method (first_block_cache.py); the capability's row
feature holds both (`first_block_cache.StepCacheRows`), and a request uses one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ...capabilities.step_cache import StepCacheSettings
from ...errors import ParamError
from ...features.base import Admission, FieldSpec, RowFeature, StepView
from ...features.capability import Capability, Param
from ...request import GenerationRequest
from . import first_block_cache, unet_cache

NAME = "step_cache"
METHODS = ("taylorseer", first_block_cache.METHOD)
UNET_METHODS = ("deepcache",)
# "auto" until the quality table chooses it: TaylorSeer's first order at interval 2
AUTO = {"method": "taylorseer", "interval": 2, "order": 1}
COLUMNS = ("taylor.order", "taylor.reuse", "taylor.c1", "taylor.c2")
ORDERS = (1, 2)


@dataclass(frozen=True)
class TaylorSeer:
    """One request's TaylorSeer setting."""

    interval: int = 2
    order: int = 1

    def infotext(self) -> str:
        return f"taylorseer interval {self.interval}, order {self.order}"


def read_token_cache(value: Any) -> str | TaylorSeer | first_block_cache.FirstBlock:
    """A request's `step_cache` value on a transformer model: "off", or its TaylorSeer setting ("auto": `AUTO`) or
    first-block one (first_block_cache.py); ParamError naming the field."""
    if isinstance(value, str) and value in ("off", "auto"):
        return "off" if value == "off" else TaylorSeer(AUTO["interval"], AUTO["order"])
    if not isinstance(value, dict):
        got = repr(value) if isinstance(value, str) else type(value).__name__
        raise ParamError(NAME, f"step_cache {got} is unknown; allowed: \"off\", \"auto\" or "
                               "{\"method\": \"taylorseer\", \"interval\": N, \"order\": 1 | 2} or "
                               "{\"method\": \"first_block\", \"threshold\": t}")
    method = value.get("method")
    if method in UNET_METHODS:
        raise ParamError(f"{NAME}.method", f"step_cache method {method!r} is for UNet models; this transformer "
                                           f"model takes: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ParamError(f"{NAME}.method", f"step_cache method {method!r} is unknown here; allowed: "
                                           f"{', '.join(METHODS)}")
    if method == first_block_cache.METHOD:
        return first_block_cache.read_first_block(value)
    extra = sorted(set(value) - {"method", "interval", "order"})
    if extra:
        raise ParamError(f"{NAME}.{extra[0]}", f"step_cache has no field {extra[0]!r}; allowed: method, interval, "
                                               "order")
    got = {}
    for name, default in (("interval", TaylorSeer.interval), ("order", TaylorSeer.order)):
        v = value.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            raise ParamError(f"{NAME}.{name}", f"step_cache.{name} must be an integer, got {v!r}")
        got[name] = int(v)
    if got["interval"] < 1:
        raise ParamError(f"{NAME}.interval", f"step_cache.interval {got['interval']} is out of range; allowed: an "
                                             "integer >= 1 (1: every evaluation full)")
    if got["order"] not in ORDERS:
        raise ParamError(f"{NAME}.order", f"step_cache.order {got['order']} is out of range; allowed: 1 or 2")
    return TaylorSeer(**got)


def forecast_plan(reuse: np.ndarray, branches: np.ndarray, order: int) -> tuple[np.ndarray, ...]:
    """The host plan of one row's evaluations: (reuse, c1, c2) from the wanted reuse flags and the CFG branches per
    evaluation; see the module's docstring (evaluation 0 and a change of branches run full)."""
    reuse = np.asarray(reuse, dtype=bool).copy()
    c1, c2 = np.zeros(len(reuse)), np.zeros(len(reuse))
    last, kept = -1, 0  # the last full evaluation; the differences kept after it (0: F only, 1: D1, 2: D2)
    for e in range(len(reuse)):
        if last < 0 or branches[e] != branches[last]:
            reuse[e], kept, last = False, 0, e
            continue
        dist = e - last
        if reuse[e]:
            c1[e] = dist if kept >= 1 else 0.0
            c2[e] = dist * dist / 2.0 if kept >= 2 else 0.0
            continue
        c1[e] = 1.0 / dist
        c2[e] = 1.0 / dist if kept >= 1 and order >= 2 else 0.0
        kept = min(kept + 1, order)
        last = e
    return reuse, c1, c2


@dataclass(frozen=True)
class TaylorKey:
    """The step's part (a graph variant): how many denoiser rows the transformer runs over, the rows not forecast
    rounded up to a power of two (the step's first `run` rows, those that run first, in row order), or None: every
    row (the forecast rows' outputs replaced)."""

    run: int | None

    def __str__(self) -> str:  # the graph kind's suffix ("step_step_cache_run2")
        return "_all" if self.run is None else f"_run{self.run}"


class TaylorState(NamedTuple):
    """Per denoiser row, on the device: `keep` whether it keeps its output (a live cache row at a full evaluation),
    `reuse` whether it is forecast, `c1`, `c2` its coefficients (1 / dist at a full evaluation, k and k^2 / 2 at a
    forecast one, 0 where the difference does not exist), `slot` its row of `terms` ([slots, 3, tokens, C] fp32;
    `unet_cache.row_slots`)."""

    keep: torch.Tensor
    reuse: torch.Tensor
    c1: torch.Tensor
    c2: torch.Tensor
    slot: torch.Tensor
    terms: torch.Tensor


def taylor_key(on: np.ndarray, reuse: np.ndarray, gather: bool = True) -> TaylorKey | None:
    """The step's key from its denoiser rows' cache flags and forecast flags (host data); None: no cache row."""
    if not on.any():
        return None
    run = unet_cache.round_up(int(np.sum(~reuse))) if gather else None
    return TaylorKey(None if run is None or run >= len(on) else run)


def taylor_state(view: StepView, terms: torch.Tensor) -> TaylorState:
    """The step's `TaylorState` from its coefficient columns and denoiser-row layout (tensor ops only: capturable)."""
    live, slot = unet_cache.row_slots(view)
    order, reuse, c1, c2 = (view.gather(view.coefs[:, view.columns[c]]) for c in COLUMNS)
    forecast = live & (order > 0) & (reuse > 0.5)
    return TaylorState(live & (order > 0) & ~forecast, forecast, c1, c2, slot, terms)


def cached_denoise(denoise: Callable[..., torch.Tensor], x: torch.Tensor, t: torch.Tensor,
                   cond: dict[str, torch.Tensor], rows: dict[str, Any]) -> torch.Tensor | None:
    """A token family's denoiser call when the step has cache rows (None: it has none): `denoise(x, t, cond, rows)`
    over the key's first `run` rows in the order that puts the rows that run first (their inputs gathered: the
    tensors of `cond` and `rows` with one entry per denoiser row; every row where `run` is None), the kept terms of
    the rows that keep theirs updated, the forecast rows' outputs (shaped as x, as a token family's velocity is)
    forecast from theirs. Shapes depend on the key and the batch alone."""
    key = rows.get("taylor.key")
    if key is None:
        return None
    state: TaylorState = rows["taylor.state"]
    plain = {k: v for k, v in rows.items() if not k.startswith("taylor.")}
    d = x.shape[0]
    if key.run is None or key.run >= d:
        out = denoise(x, t, cond, plain)
    elif key.run == 0:
        out = x.new_zeros(x.shape)
    else:
        idx = torch.argsort(state.reuse.to(torch.int32), stable=True)[:key.run]
        pick = lambda v: v.index_select(0, idx) if isinstance(v, torch.Tensor) and v.shape[:1] == (d,) else v
        sub = denoise(x.index_select(0, idx), t.index_select(0, idx), {k: pick(v) for k, v in cond.items()},
                      {k: pick(v) for k, v in plain.items()})
        out = sub.new_zeros((d, *sub.shape[1:])).index_copy(0, idx, sub)
    per_row = (-1, *(1,) * (x.dim() - 1))
    old = state.terms.index_select(0, state.slot)  # every row's kept terms (a slot each: written once below)
    fresh = out.float()
    inv1, inv2 = state.c1.view(per_row), state.c2.view(per_row)
    d1 = torch.where(inv1 > 0, (fresh - old[:, 0]) * inv1, 0.0)
    d2 = torch.where(inv2 > 0, (d1 - old[:, 1]) * inv2, 0.0)
    new = torch.where(state.keep.view(-1, 1, *per_row[1:]), torch.stack([fresh, d1, d2], dim=1), old)
    state.terms.index_copy_(0, state.slot, new)
    guess = old[:, 0] + torch.where(inv1 > 0, inv1 * old[:, 1], 0.0) + torch.where(inv2 > 0, inv2 * old[:, 2], 0.0)
    return torch.where(state.reuse.view(per_row), guess.to(out.dtype), out)


# -- the capability and its row feature ------------------------------------------------------------------------------
def read_default(value: str) -> str | TaylorSeer:
    """The server's `step_cache` setting (a JSON object as a string); ValueError naming it otherwise."""
    return unet_cache.read_default(value, read_token_cache)


def request_cache(request: GenerationRequest, default: str | TaylorSeer) -> TaylorSeer | None:
    """A request's TaylorSeer setting (its `step_cache`, else the server's default); None: off."""
    return unet_cache.request_cache(request, default, read_token_cache)


class TokenStepCache(Capability):
    """`step_cache` on a token family whose denoiser calls `cached_denoise` (the family registers it)."""

    name = NAME
    params = (Param(NAME, None, read_token_cache, "per-row step caching: \"off\", \"auto\" or {\"method\": "
                                                  "\"taylorseer\", \"interval\": N, \"order\": 1 | 2} or "
                                                  "{\"method\": \"first_block\", \"threshold\": t}"),)
    settings = StepCacheSettings

    def feature(self, model: Any, settings: Any) -> RowFeature:
        default = read_default(settings.step_cache)
        taylor = TaylorRows(default)
        first = first_block_cache.FirstBlockRows(lambda request: request_cache(request, default),
                                                 int(model.denoiser.config.dim), model.dtype)
        return first_block_cache.StepCacheRows(NAME, taylor, first, taylor.asked_by)

    def defaults(self, settings: Any) -> dict[str, Any]:
        return unet_cache.default_values(settings)


class TaylorRows(RowFeature):
    """The row feature: the plan's columns (`COLUMNS`) and field `taylor.terms` (see the module's docstring)."""

    name = NAME

    def __init__(self, default: str | TaylorSeer):
        self._default = default
        # with the server's default off, a request that sends no step_cache (or "off") asks nothing of it
        self.asked_by = (NAME, (None, "off")) if default == "off" else None

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {"taylor.terms": FieldSpec((2, 3, *latent_shape), torch.float32)}

    def columns(self) -> tuple[str, ...]:
        return COLUMNS

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        spec = request_cache(request, self._default)
        if not isinstance(spec, TaylorSeer):
            return {}
        reuse = np.ones(len(index))
        reuse[::spec.interval] = 0.0
        return {"taylor.order": np.full(len(index), float(spec.order)), "taylor.reuse": reuse}

    def after_plan(self, table: np.ndarray, columns: dict[str, int], branches: np.ndarray) -> None:
        """The forecast's coefficients, once the evaluations' CFG branches are known (`forecast_plan`)."""
        order = int(table[0, columns["taylor.order"]]) if len(table) else 0
        if order:
            reuse, c1, c2 = forecast_plan(table[:, columns["taylor.reuse"]] > 0.5, branches, order)
            table[:, columns["taylor.reuse"]] = reuse
            table[:, columns["taylor.c1"]], table[:, columns["taylor.c2"]] = c1, c2

    def variants(self) -> Sequence[Any]:
        return (None,)  # a step's `TaylorKey` is its graph variant, registered and captured at its first use

    def _caches(self, admission: Admission) -> bool:
        return isinstance(request_cache(admission.request, self._default), TaylorSeer)

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        """A cache row's field, written (zero) so that a preemption saves and restores it with the row."""
        return {"taylor.terms": 0.0} if self._caches(admission) else {}

    def part(self, admission: Admission) -> Any:
        return "on" if self._caches(admission) else None

    def variant(self, parts: Sequence[Any]) -> Any:
        return next((p for p in parts if p), None)  # "on" where a live request caches

    def step_part(self, part: Any, coefs: np.ndarray, columns: dict[str, int], index: np.ndarray, d: int,
                  gather: bool = True) -> Any:
        """The step's `TaylorKey` from the host's coefficient table; `gather` False (a feature sets per-row
        denoiser state) runs the transformer over every row and only replaces the forecast rows' outputs."""
        if part is None:
            return None
        rows = index[:d, 0]
        on = coefs[rows, columns["taylor.order"]] > 0
        return taylor_key(on, on & (coefs[rows, columns["taylor.reuse"]] > 0.5), gather)

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, Any]:
        if not isinstance(part, TaylorKey):
            return {}
        return {"taylor.key": part, "taylor.state": taylor_state(view, view.fields["taylor.terms"].flatten(0, 1))}
