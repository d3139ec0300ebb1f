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
does not exist yet); each step the host turns the live rows' columns into the step's part (`TaylorStep`: the
denoiser rows the transformer runs over, those that keep their output, those forecast), so the transformer runs
only over the rows that need it, gathered, without a device sync. The kept terms are one per-row field
(`taylor.terms`, [2, 3, tokens, C] fp32: per CFG branch F, D1, D2), compacted, saved and restored with the row. A
step with cache rows runs eagerly (its part holds the gathered rows: no CUDA graph is captured for it).

{"method": "first_block", "threshold": t} is the data-dependent method (first_block_cache.py); the capability's row
feature holds both (`first_block_cache.StepCacheRows`), and a request uses one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...capability_settings import StepCacheSettings
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
class TaylorStep:
    """The step's part (denoiser rows local to the step; slots = image row * 2 + branch): `run` the rows the
    transformer runs over; `save` (of `run`) those that keep their output (slots, 1 / dist for D1 and D2); `cached`
    those forecast (slots, the coefficients of D1 and D2)."""

    run: tuple[int, ...]
    save: tuple[int, ...]
    save_slots: tuple[int, ...]
    save_inv: tuple[tuple[float, float], ...]
    cached: tuple[int, ...]
    cached_slots: tuple[int, ...]
    cached_coef: tuple[tuple[float, float], ...]


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _coefs(values: Sequence[tuple[float, float]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(values, dtype=torch.float32, device=like.device).view(-1, 2, *(1,) * (like.dim() - 1))
    return t[:, 0], t[:, 1]


def cached_denoise(denoise: Callable[..., torch.Tensor], x: torch.Tensor, t: torch.Tensor,
                   cond: dict[str, torch.Tensor], rows: dict[str, Any]) -> torch.Tensor | None:
    """A token family's denoiser call when the step has cache rows (None: it has none): `denoise(x, t, cond, rows)`
    over the step's `run` rows only (their inputs gathered: the tensors of `cond` and `rows` with one entry per
    denoiser row), the kept terms of its `save` rows updated, its `cached` rows' outputs (shaped as x, as a token
    family's velocity is) forecast from theirs."""
    step = rows.get("taylor.step")
    if step is None:
        return None
    terms = rows["taylor.terms"]  # [slots, 3, tokens, C] fp32
    plain = {k: v for k, v in rows.items() if not k.startswith("taylor.")}
    d = x.shape[0]
    if len(step.run) == d:
        out = denoise(x, t, cond, plain)
    else:
        out = x.new_zeros(x.shape)
        if step.run:
            idx = _index(step.run, x.device)
            pick = lambda v: v.index_select(0, idx) if isinstance(v, torch.Tensor) and v.shape[:1] == (d,) else v
            sub = denoise(x.index_select(0, idx), t.index_select(0, idx), {k: pick(v) for k, v in cond.items()},
                          {k: pick(v) for k, v in plain.items()})
            out = out.to(sub.dtype).index_copy_(0, idx, sub)
    if step.save:
        slots = _index(step.save_slots, x.device)
        fresh = out.index_select(0, _index(step.save, x.device)).float()
        old = terms.index_select(0, slots)
        inv1, inv2 = _coefs(step.save_inv, fresh)
        d1 = torch.where(inv1 > 0, (fresh - old[:, 0]) * inv1, 0.0)
        d2 = torch.where(inv2 > 0, (d1 - old[:, 1]) * inv2, 0.0)
        terms.index_copy_(0, slots, torch.stack([fresh, d1, d2], dim=1))
    if step.cached:
        kept = terms.index_select(0, _index(step.cached_slots, x.device))
        c1, c2 = _coefs(step.cached_coef, kept[:, 0])
        guess = kept[:, 0] + torch.where(c1 > 0, c1 * kept[:, 1], 0.0) + torch.where(c2 > 0, c2 * kept[:, 2], 0.0)
        out = out.index_copy(0, _index(step.cached, x.device), guess.to(out.dtype))
    return out


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
        return (None,)  # a step with cache rows runs eagerly (`eager`): no graphs to capture

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
        """The step's `TaylorStep` from the host's coefficient table; `gather` False (a feature sets per-row
        denoiser state) runs the transformer over every row and only replaces the cached rows' outputs."""
        if part is None:
            return None
        rows = index[:d, 0]
        cols = [coefs[rows, columns[c]] for c in COLUMNS]
        on, reuse, c1, c2 = cols[0] > 0, (cols[0] > 0) & (cols[1] > 0.5), cols[2], cols[3]
        slots = rows * 2 + index[:d, 1]
        save = [j for j in range(d) if on[j] and not reuse[j]]
        cached = [j for j in range(d) if reuse[j]]
        return TaylorStep(tuple(j for j in range(d) if not (gather and reuse[j])), tuple(save),
                          tuple(int(slots[j]) for j in save), tuple((float(c1[j]), float(c2[j])) for j in save),
                          tuple(cached), tuple(int(slots[j]) for j in cached),
                          tuple((float(c1[j]), float(c2[j])) for j in cached))

    def eager(self, part: Any) -> bool:
        return part is not None

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, Any]:
        if not isinstance(part, TaylorStep):
            return {}
        return {"taylor.step": part, "taylor.terms": view.fields["taylor.terms"].flatten(0, 1)}
