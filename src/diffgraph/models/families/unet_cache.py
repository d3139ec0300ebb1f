"""Step caching for UNets: DeepCache (Ma et al., 2023) per row, as a capability with a row feature.

A request's `step_cache` ("off"; "auto"; or {"method": "deepcache", "interval": N, "branch": m, "schedule":
"uniform" | "nonuniform", "center": c, "power": p}) decides, per model evaluation of the row's own plan (a
two-evaluation sampler's two halves count as two), whether the row recomputes the whole UNet ("full") or reuses
its cached deep feature. Skip branch m is the UNet's m-th skip connection, counted from the shallowest as the
residual list diffusers' UNet2DConditionModel builds (0: conv_in's output, then each down layer's, each
downsampler's): on a full evaluation the row runs the whole UNet and keeps the hidden state that enters the up
layer consuming residual m (the deep path's output); on a cached one it runs conv_in and the down path up to
residual m, then the up path from that layer with the kept feature in place of the deep path (DeepCache's
`cache_branch_id`, whose SD layout, 3 residuals a down block, makes its `cache_layer_id = m % 3`,
`cache_block_id = m // 3` this numbering). Uniform: full at evaluations 0, N, 2N, ...; non-uniform: DeepCache's
quadratic-around-`center` choice of ceil(E / N) full evaluations (`nonuniform_steps`). Evaluation 0 is always full.

The plan is host data (two coefficient columns, `cache.reuse` and `cache.branch`). Each step the host turns the live
rows' columns into the step's graph variant (`CacheKey`: per branch in use, how many rows go deeper, rounded up to
a power of two), and the step itself finds those rows on the device (`deep_order`: a stable sort of a per-row flag
read from the step's coefficient table), so every shape in the step depends on the key and the batch alone, without a device sync: a
step with cache rows replays the CUDA graph of its key (registered and captured at its key's first use, like any
other step variant, and compiled in the compile tier; `StepCacheRows.graphed` off: such a step runs eagerly). The
deep path runs over the rows that need
it, padded with rows that reuse their feature (their extra deep output is dropped). The kept features are one
per-row field (`cache.deep`, [2, F]: per CFG branch, flattened, F the largest feature of any branch), read and
written with gathers and scatters of static shape, compacted, saved and restored with the row (lazy: a group holds
it once a cache row is admitted there, `FieldSpec.lazy`). A step with per-row
denoiser state (LoRA rows, image prompts) runs every row through the deep path (its key's stages say None) and only
replaces the reused features.
"""

from __future__ import annotations

import dataclasses
import json
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

NAME = "step_cache"
METHODS = ("deepcache",)
DIT_METHODS = ("first_block", "taylorseer", "teacache", "magcache", "foca", "dbcache")
SCHEDULES = ("uniform", "nonuniform")
# "auto": chosen by BENCHMARKS.md's step-cache quality table (tools/step_cache_quality.py), the same for SD and SDXL
AUTO = {"method": "deepcache", "interval": 2, "branch": 0, "schedule": "uniform"}
_BLOCKS = {"CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnUpBlock2D", "UpBlock2D", "UNetMidBlock2DCrossAttn"}


@dataclass(frozen=True)
class DeepCache:
    """One request's DeepCache setting."""

    interval: int = 3
    branch: int = 0
    schedule: str = "uniform"
    center: int = 15
    power: float = 1.4

    def infotext(self) -> str:
        tail = f", center {self.center}, power {self.power:g}" if self.schedule == "nonuniform" else ""
        return f"deepcache interval {self.interval}, branch {self.branch}, {self.schedule}{tail}"


def read_step_cache(value: Any) -> str | DeepCache:
    """A request's `step_cache` value: "off", or its DeepCache setting ("auto": `AUTO`); ParamError naming the field."""
    if isinstance(value, str):
        if value == "off":
            return "off"
        if value == "auto":
            return DeepCache(**{k: v for k, v in AUTO.items() if k != "method"})
        raise ParamError(NAME, f"step_cache {value!r} is unknown; allowed: \"off\", \"auto\" or "
                               "{\"method\": \"deepcache\", \"interval\": N, ...}")
    if not isinstance(value, dict):
        raise ParamError(NAME, f"step_cache must be \"off\", \"auto\" or an object, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(DeepCache)}
    method = value.get("method")
    if method in DIT_METHODS:
        raise ParamError(f"{NAME}.method", f"step_cache method {method!r} is for transformer (DiT) models; this "
                                           f"UNet model takes: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ParamError(f"{NAME}.method", f"step_cache method {method!r} is unknown; allowed: {', '.join(METHODS)}")
    unknown = sorted(set(value) - set(fields) - {"method"})
    if unknown:
        raise ParamError(f"{NAME}.{unknown[0]}", f"step_cache has no field {unknown[0]!r}; allowed: method, "
                                                 f"{', '.join(fields)}")
    out = {}
    for name, v in value.items():
        if name == "method":
            continue
        kind = fields[name].type
        ok = isinstance(v, str) if kind == "str" else (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (kind != "int" or float(v).is_integer()))
        if not ok:
            what = {"int": "an integer", "float": "a finite number", "str": "a string"}[kind]
            raise ParamError(f"{NAME}.{name}", f"step_cache.{name} must be {what}, got {v!r}")
        out[name] = int(v) if kind == "int" else float(v) if kind == "float" else v
    spec = DeepCache(**out)
    _check_ranges(spec)
    return spec


def _check_ranges(spec: DeepCache) -> None:
    for name, ok, allowed in (("interval", spec.interval >= 1, "an integer >= 1 (1: every evaluation full)"),
                              ("branch", spec.branch >= 0, "a skip branch >= 0 (0: the shallowest)"),
                              ("center", spec.center >= 0, "an evaluation index >= 0"),
                              ("power", 1.0 < spec.power <= 4.0, "a number in (1, 4]")):
        if not ok:
            raise ParamError(f"{NAME}.{name}", f"step_cache.{name} {getattr(spec, name)!r} is out of range; "
                                               f"allowed: {allowed}")
    if spec.schedule not in SCHEDULES:
        raise ParamError(f"{NAME}.schedule", f"step_cache.schedule {spec.schedule!r} is unknown; allowed: "
                                             f"{', '.join(SCHEDULES)}")


def nonuniform_steps(total: int, count: int, center: int, power: float) -> list[int]:
    """DeepCache's `sample_from_quad_center`, as its code computes it: `count` full evaluations of `total`, 0 and the
    integer parts of linspace((-center) ** (1 / power), (total - center) ** (1 / power)) ** power + center (Python's
    principal powers: complex for the negative end, the real part kept), lowering `power` by 0.02 until they are
    distinct. `center` is clamped to the row's evaluations; none found: the uniform choice of as many."""
    center = min(center, total - 1)
    while power > 1:
        ends = complex(-center) ** (1 / power), complex(total - center) ** (1 / power)
        x = np.linspace(*ends, count + 1) ** power
        picked = np.unique(x.real.astype(np.int32))[1:-1] + center
        out = [0] + [int(p) for p in picked if 0 < p < total]
        if len(out) == count:
            return out
        power -= 0.02
    return list(range(0, total, max(1, math.ceil(total / count))))[:count]


def full_evaluations(spec: DeepCache, total: int) -> np.ndarray:
    """[total] 1.0 at the evaluations that run the whole UNet, 0.0 where the row reuses its feature."""
    out = np.zeros(total)
    if spec.schedule == "uniform" or spec.interval == 1:
        out[::spec.interval] = 1.0
    else:
        out[nonuniform_steps(total, math.ceil(total / spec.interval), spec.center, spec.power)] = 1.0
    out[0] = 1.0
    return out


# -- the UNet's layout -----------------------------------------------------------------------------------------------
def branch_shapes(unet: Any, latent_shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Per skip branch m: the shape of the hidden state entering the up layer that consumes residual m."""
    channels = list(unet.config.block_out_channels)
    h, w = latent_shape[1:]
    sizes = [(h, w)]
    for _ in channels[1:]:
        h, w = (h + 1) // 2, (w + 1) // 2
        sizes.append((h, w))
    out: dict[int, tuple[int, int, int]] = {}
    m = len(residual_owners(unet)) - 1  # the deepest residual is consumed first
    prev = channels[-1]  # the mid block's output
    for i, block in enumerate(unet.up_blocks):
        level = len(channels) - 1 - i
        for k, resnet in enumerate(block.resnets):
            out[m] = (prev, *sizes[level])
            prev = int(resnet.out_channels)
            m -= 1
        if block.upsamplers is not None:
            level -= 1
    return [out[k] for k in sorted(out)]


def residual_owners(unet: Any) -> list[tuple[int, int]]:
    """Per residual m: (down block, layer) that produces it: (-1, 0) conv_in, (i, k) layer k of block i, k =
    len(resnets) its downsampler."""
    out = [(-1, 0)]
    for i, block in enumerate(unet.down_blocks):
        out += [(i, k) for k in range(len(block.resnets))]
        if block.downsamplers is not None:
            out.append((i, len(block.resnets)))
    return out


def supports(unet: Any) -> bool:
    """Whether the split forward knows every block of this UNet (diffusers' SD1.x/SD2.x/SDXL UNets)."""
    blocks = [*getattr(unet, "down_blocks", ()), getattr(unet, "mid_block", None), *getattr(unet, "up_blocks", ())]
    return bool(blocks) and all(type(b).__name__ in _BLOCKS for b in blocks) and \
        getattr(unet.config, "addition_embed_type", None) in (None, "text_time") and \
        not getattr(unet.config, "class_embed_type", None) and not unet.config.center_input_sample


# -- the split forward -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheKey:
    """The step's part (a graph variant): per skip branch in use, shallowest first, (branch, deep) where `deep` is how
    many of the rows alive there go deeper (the rows that need the deep path, rounded up to a power of two: the
    step's first `deep` rows in the order of `deep_order`), or None where every row alive there does (the rows that
    reuse their feature run it too and their output is replaced)."""

    stages: tuple[tuple[int, int | None], ...]

    def __str__(self) -> str:  # the graph kind's suffix ("step_step_cache_b0k2")
        return "".join(f"_b{b}" + ("" if k is None else f"k{k}") for b, k in self.stages)


class CacheRows(NamedTuple):
    """Per denoiser row, on the device: `branch` the row's skip branch + 1 (0: no cache, or a padding row),
    `reuse` whether it reuses its kept feature at this evaluation, `slot` its row of `store` ([slots, F], the kept
    features flattened: image row * 2 + second branch; a padding row j a slot of its own, 2j, that no live row
    holds)."""

    branch: torch.Tensor
    reuse: torch.Tensor
    slot: torch.Tensor
    store: torch.Tensor


def round_up(n: int) -> int:
    """The deep rows of a stage: 0, or the power of two at or above `n` (the graph buckets' sizes)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def cache_key(branch: np.ndarray, reuse: np.ndarray, gather: bool = True) -> CacheKey | None:
    """The step's key from its denoiser rows' branches (-1: no cache) and reuse flags (host data); `gather` False:
    every row runs the deep path (None: no cache row)."""
    stages, alive = [], len(branch)
    for b in sorted(set(branch[branch >= 0].tolist())):
        need = int(np.sum(~((branch >= 0) & (branch <= b) & reuse)))  # the rows that stop at no branch up to b
        deep = round_up(need) if gather else None
        deep = None if deep is None or deep >= alive else deep
        alive = alive if deep is None else deep
        stages.append((int(b), deep))
    return CacheKey(tuple(stages)) if stages else None


def row_slots(view: StepView) -> tuple[torch.Tensor, torch.Tensor]:
    """Per denoiser row of the step: whether it is a live row (a padding row, pointing at row 0, is not), and its slot
    among its image rows' kept values (image row * 2 + second branch; a padding row j: 2j, which no live row holds,
    since j is past the live denoiser rows and so past the live image rows). Tensor ops only: capturable."""
    den_row, den_alt = view.den_row, view.den_alt
    j = torch.arange(den_row.shape[0], device=den_row.device)
    live = torch.where(den_alt > 0, view.out_alt.index_select(0, den_row),
                       view.out_main.index_select(0, den_row)) == j
    return live, torch.where(live, den_row * 2 + den_alt, j * 2)


def cache_rows(view: StepView, store: torch.Tensor) -> CacheRows:
    """The step's `CacheRows` from its coefficient columns and denoiser-row layout (tensor ops only: capturable)."""
    live, slot = row_slots(view)
    branch = view.gather(view.coefs[:, view.columns["cache.branch"]]).round().long()
    reuse = view.gather(view.coefs[:, view.columns["cache.reuse"]]) > 0.5
    return CacheRows(torch.where(live, branch, 0), reuse & live, slot, store)


def deep_order(rows: CacheRows, branch: int, alive: torch.Tensor) -> torch.Tensor:
    """Positions among the rows alive at skip branch `branch` (their denoiser rows `alive`): the rows that go on
    first, then those that reuse their feature there or at a shallower branch (alive here where that branch's stage
    kept every row: `cache_key`'s count leaves them out too). A stable order: the live rows that go on come before the
    padding rows (the rows after them in the layout, kept in order by every split), so the first `deep` hold them
    all."""
    own = rows.branch.index_select(0, alive)
    done = (own > 0) & (own <= branch + 1) & rows.reuse.index_select(0, alive)
    return torch.argsort(done.to(torch.int32), stable=True)


def cached_unet(unet: Any, x: torch.Tensor, t: torch.Tensor, ehs: torch.Tensor, key: CacheKey, rows: CacheRows,
                timestep_cond: torch.Tensor | None = None, added: dict | None = None,
                residuals: dict | None = None) -> torch.Tensor:
    """diffusers' UNet2DConditionModel forward (no masks, no cross-attention kwargs), split at the key's branches: at
    each one the first `deep` rows of `deep_order` go on down (every row where `deep` is None); on the way up the
    rows that reuse their feature there take it from `rows.store` and the rows that keep theirs write it. Shapes
    depend on the key and the batch only. With no stage it is the UNet's forward."""
    t = t.expand(x.shape[0]) if t.dim() == 0 else t
    emb = unet.time_embedding(unet.get_time_embed(sample=x, timestep=t), timestep_cond)
    aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=ehs, added_cond_kwargs=added or {})
    emb = emb + aug if aug is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    ehs = unet.process_encoder_hidden_states(encoder_hidden_states=ehs, added_cond_kwargs=added or {})
    residuals = residuals or {}
    control = [*residuals.get("down_block_additional_residuals", ())]
    mid_control = residuals.get("mid_block_additional_residual")
    stages = dict(key.stages)
    owners = residual_owners(unet)
    ctx = [emb, ehs, torch.arange(x.shape[0], device=x.device)]  # per-row inputs of the rows alive (their rows)
    h = unet.conv_in(x)
    res: list[torch.Tensor] = []
    alive_at: dict[int, tuple[list, torch.Tensor | None]] = {}
    for m, (block, layer) in enumerate(owners):
        if block >= 0 and ctx[2].shape[0]:
            h = _down_layer(unet.down_blocks[block], layer, h, ctx[0], ctx[1])
        # (no row alive: `h` is what the down path left above, never read below)
        res.append(h + control[m].index_select(0, ctx[2]) if control and ctx[2].shape[0] else h)
        if m in stages:
            deep = stages[m]
            keep = None if deep is None or deep >= ctx[2].shape[0] else deep_order(rows, m, ctx[2])[:deep]
            alive_at[m] = (ctx, keep)
            if keep is not None:  # the rows that reuse their feature here leave the down path
                h = h.index_select(0, keep)
                ctx = [c.index_select(0, keep) for c in ctx]
    if ctx[2].shape[0]:
        h = unet.mid_block(h, ctx[0], encoder_hidden_states=ctx[1]) if unet.mid_block.has_cross_attention \
            else unet.mid_block(h, ctx[0])
        if mid_control is not None:
            h = h + mid_control.index_select(0, ctx[2])
    shapes = branch_shapes(unet, tuple(x.shape[1:]))
    m = len(owners) - 1
    for i, block in enumerate(unet.up_blocks):
        for k in range(len(block.resnets)):
            if m in alive_at:
                h, ctx = _rejoin(m, h, *alive_at[m], rows, shapes[m])
            if ctx[2].shape[0]:  # (no row alive: every row stopped at a shallower branch)
                h = _up_layer(block, k, h, res[m], ctx[0], ctx[1])
            m -= 1
        if block.upsamplers is not None and ctx[2].shape[0]:
            size = res[m].shape[2:] if i < len(unet.up_blocks) - 1 and _odd(x, unet) else None
            for up in block.upsamplers:
                h = up(h, size)
    if unet.conv_norm_out:
        h = unet.conv_act(unet.conv_norm_out(h))
    return unet.conv_out(h)


def _odd(x: torch.Tensor, unet: Any) -> bool:
    factor = 2 ** unet.num_upsamplers
    return any(dim % factor for dim in x.shape[-2:])


def _rejoin(branch: int, h: torch.Tensor, before: list, keep: torch.Tensor | None, rows: CacheRows,
            shape: tuple[int, ...]) -> tuple:
    """At the up layer consuming skip branch `branch`'s residual (its input `shape`): the rows alive before the
    split (`before`; `keep`: the positions among them that went on, None: all) are back, those that reuse their
    feature here with it, and those that keep theirs write it (every slot of the rows alive is written, unchanged
    where nothing is kept: no row's slot is written twice). (The residuals of a layer are over the rows alive where
    they were made: the same rows, since each stage restores its rows on the way up.)"""
    alive = before[2]
    size = math.prod(shape)
    slots = rows.slot.index_select(0, alive)
    kept = rows.store.index_select(0, slots)[:, :size]
    stored = kept.reshape(-1, *shape).to(h.dtype)
    if keep is not None:  # (none went on: `h` is what the down path left, of no use)
        h = stored.index_copy(0, keep, h) if keep.shape[0] else stored
    mine = rows.branch.index_select(0, alive) == branch + 1
    reuse = rows.reuse.index_select(0, alive)
    h = torch.where((mine & reuse).view(-1, *(1,) * len(shape)), stored, h)
    fresh = torch.where((mine & ~reuse).view(-1, 1), h.flatten(1).to(rows.store.dtype), kept)
    rows.store[:, :size].index_copy_(0, slots, fresh)
    return h, before


def _down_layer(block: Any, layer: int, h: torch.Tensor, emb: torch.Tensor, ehs: torch.Tensor) -> torch.Tensor:
    """Layer `layer` of a down block (its resnet and attention; len(resnets): its downsampler), as its forward."""
    if layer == len(block.resnets):
        for down in block.downsamplers:
            h = down(h)
        return h
    h = block.resnets[layer](h, emb)
    if getattr(block, "has_cross_attention", False):
        h = block.attentions[layer](h, encoder_hidden_states=ehs, return_dict=False)[0]
    return h


def _up_layer(block: Any, layer: int, h: torch.Tensor, res: torch.Tensor, emb: torch.Tensor,
              ehs: torch.Tensor) -> torch.Tensor:
    """Layer `layer` of an up block: the residual concatenated, its resnet and attention, as its forward."""
    h = block.resnets[layer](torch.cat([h, res], dim=1), emb)
    if getattr(block, "has_cross_attention", False):
        h = block.attentions[layer](h, encoder_hidden_states=ehs, return_dict=False)[0]
    return h


# -- the capability and its row feature ------------------------------------------------------------------------------
def read_default(value: str, read: Callable[[Any], Any] = read_step_cache) -> Any:
    """The server's `step_cache` setting (a JSON object as a string) as `read` reads a request's; ValueError naming
    it otherwise."""
    try:
        return read(json.loads(value) if value.lstrip().startswith("{") else value)
    except (ParamError, json.JSONDecodeError) as e:
        raise ValueError(f"setting step-cache: {e}") from None


def default_values(settings: StepCacheSettings) -> dict[str, Any]:
    """The server's `step_cache` setting as a request's value (none when it is off), for `Capability.defaults`."""
    value = settings.step_cache
    if value == "off":
        return {}
    return {NAME: json.loads(value) if value.lstrip().startswith("{") else value}


def request_cache(request: GenerationRequest, default: Any, read: Callable[[Any], Any] = read_step_cache) -> Any:
    """A request's setting as `read` reads it (its `step_cache`, else the server's default); None: off."""
    value = dict(request.extras).get(NAME)
    spec = default if value is None else read(value)
    return None if spec == "off" else spec


class StepCache(Capability):
    """`step_cache` on the UNets whose blocks the split forward knows (`supports`)."""

    name = NAME
    params = (Param(NAME, None, read_step_cache, "per-row step caching: \"off\", \"auto\" or {\"method\": "
                                                 "\"deepcache\", \"interval\": N, \"branch\": m, \"schedule\": "
                                                 "\"uniform\" | \"nonuniform\"}"),)
    settings = StepCacheSettings

    def __init__(self) -> None:
        self._branches = 0  # the skip branches of the model `applies` saw (each engine gets its own capability)

    def applies(self, model: Any) -> bool:
        if not supports(model.denoiser):
            return False
        self._branches = len(residual_owners(model.denoiser))
        return True

    def check(self, values: dict[str, Any], settings: Any) -> None:
        spec = values[NAME]
        if isinstance(spec, DeepCache) and self._branches and spec.branch >= self._branches:
            raise ParamError(f"{NAME}.branch", f"step_cache.branch {spec.branch} is out of range; this UNet has skip "
                                               f"branches 0..{self._branches - 1}")

    def feature(self, model: Any, settings: Any) -> RowFeature:
        return StepCacheRows(model.denoiser, model.dtype, read_default(settings.step_cache))

    def defaults(self, settings: Any) -> dict[str, Any]:
        return default_values(settings)


class StepCacheRows(RowFeature):
    """The row feature: columns `cache.branch` (the row's branch + 1; 0: no cache) and `cache.reuse` (1 where the
    evaluation reuses the feature), field `cache.deep` (the kept features, per CFG branch, flattened)."""

    name = NAME
    # whether a step with cache rows replays its key's CUDA graph (off: it runs eagerly, the same function); on a GPU
    # each replay equals the eager step on the same buffers (tools/diag_deepcache_graph.py --shadow)
    graphed: bool = True

    def __init__(self, unet: Any, dtype: torch.dtype, default: str | DeepCache):
        self._unet, self._dtype, self._default = unet, dtype, default
        # with the server's default off, a request that sends no step_cache (or "off") asks nothing of it
        self.asked_by = (NAME, (None, "off")) if default == "off" else None

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        size = max(math.prod(s) for s in branch_shapes(self._unet, latent_shape))
        return {"cache.deep": FieldSpec((2, size), self._dtype, lazy=True)}

    def columns(self) -> tuple[str, ...]:
        return ("cache.branch", "cache.reuse")

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        spec = request_cache(request, self._default)
        if spec is None:
            return {}
        return {"cache.branch": np.full(len(index), spec.branch + 1.0),
                "cache.reuse": 1.0 - full_evaluations(spec, len(index))}

    def after_plan(self, table: np.ndarray, columns: dict[str, int], branches: np.ndarray) -> None:
        """An evaluation that runs a CFG branch the last full one did not (a guidance interval opening) is full:
        that branch has no feature kept."""
        reuse = table[:, columns["cache.reuse"]]
        last = 0
        for e in range(len(reuse)):
            if reuse[e] and branches[e] > branches[last]:
                reuse[e] = 0.0
            if not reuse[e]:
                last = e

    def variants(self) -> Sequence[Any]:
        return (None,)  # a step's `CacheKey` is its graph variant, registered and captured at its first use

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        """A cache row's field, written (zero) so that a preemption saves and restores it with the row."""
        return {"cache.deep": 0.0} if request_cache(admission.request, self._default) is not None else {}

    def part(self, admission: Admission) -> Any:
        return "on" if request_cache(admission.request, self._default) is not None else None

    def variant(self, parts: Sequence[Any]) -> Any:
        return "on" if any(parts) else None

    def step_part(self, part: Any, coefs: np.ndarray, columns: dict[str, int], index: np.ndarray, d: int,
                  gather: bool = True) -> Any:
        """The step's `CacheKey` from the host's coefficient table: per branch in use, how many rows go deeper;
        `gather` False (a feature sets per-row denoiser state: the deep path must see every row) keeps every row in
        the deep path and only replaces the reused features. None: no cache row runs this step."""
        if part is None:
            return None
        rows = index[:d, 0]
        branch = coefs[rows, columns["cache.branch"]].astype(np.int64) - 1
        return cache_key(branch, coefs[rows, columns["cache.reuse"]] > 0.5, gather)

    def eager(self, part: Any) -> bool:
        return isinstance(part, CacheKey) and not self.graphed

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, Any]:
        if not isinstance(part, CacheKey):
            return {}
        return {"cache.key": part, "cache.rows": cache_rows(view, view.lazy("cache.deep").flatten(0, 1))}


def family_denoise(model: Any, x: torch.Tensor, t: torch.Tensor, ehs: torch.Tensor, rows: dict[str, Any],
                   added: dict | None, residuals: dict) -> torch.Tensor:
    """The SD families' denoiser call when the step has cache rows (`rows["cache.key"]`: the family asks first)."""
    return cached_unet(model.denoiser, x, t, ehs, rows["cache.key"], rows["cache.rows"], rows.get("timestep_cond"),
                       added, residuals)
