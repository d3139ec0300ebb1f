"""What step caching costs a trained model in quality, and what it saves (tools/step_cache_quality.py's table,
`diffgraph compare --step-cache`).

For a digits preset, each setting's images are drawn with the same prompts and seeds as the uncached ones (the
preset's digit prompts, `per_digit` seeds per digit, all submitted together): the digits oracle's score of both, the
mean absolute difference of the 8-bit images, and what the setting saves. The saving is counted, not timed: a
cached evaluation at branch m skips the share of the UNet's FLOPs (matmul, convolution and attention, counted by
torch's FlopCounterMode on one row of the model's native latent) that its deep path holds, so one image costs
`full / total + (1 - full / total) * (1 - skip)` of the uncached UNet work. `choose_auto` applies the issue's rule:
the cheapest setting whose score is within 0.02 of the uncached one and whose mean difference is at most 3 levels.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..engine.engine import Engine
from ..models.digits_oracle import DigitsOracle, digit_prompt
from ..models.families.unet_cache import (CacheStep, DeepCache, Stage, branch_shapes, cached_unet, full_evaluations,
                                          read_step_cache, residual_owners)

FIRST_SEED = 1000
MAX_SCORE_DROP = 0.02
MAX_MEAN_LEVELS = 3.0


@dataclasses.dataclass(frozen=True)
class QualityRow:
    """One setting's figures: `evaluations` per image and the `full` ones of them, the share of the UNet a cached
    one skips, the UNet work per image against uncached (`cost`), the oracle's score and the mean / max 8-bit
    difference to the uncached images of the same seeds."""
    setting: DeepCache | None  # None: uncached
    evaluations: int
    full: int
    skip: float
    score: float
    mean_levels: float
    max_levels: float

    @property
    def cost(self) -> float:
        return (self.full + (self.evaluations - self.full) * (1.0 - self.skip)) / self.evaluations

    @property
    def interval(self) -> float:
        """The interval the setting implies: evaluations per full one."""
        return self.evaluations / self.full


def grid(branches: int, intervals: Sequence[int] = (2, 3, 4, 5)) -> list[DeepCache]:
    """Every interval x branch x schedule (uniform; nonuniform at DeepCache's center and power)."""
    return [DeepCache(interval=i, branch=b, schedule=s) for s in ("uniform", "nonuniform") for i in intervals
            for b in range(branches)]


def skip_shares(engine: Engine) -> list[float]:
    """Per skip branch: the share of one UNet call's FLOPs that a row reusing its feature there does not run."""
    from torch.utils.flop_counter import FlopCounterMode

    model = engine.model
    unet = model.denoiser
    side = model.native_size // 8
    x = torch.zeros(1, unet.config.in_channels, side, side, dtype=model.dtype, device=model.device)
    ehs = torch.zeros(1, 77, unet.config.cross_attention_dim, dtype=model.dtype, device=model.device)
    added = None
    if unet.config.addition_embed_type == "text_time":
        width = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        added = {"text_embeds": x.new_zeros(1, width), "time_ids": x.new_tensor([[8.0 * side] * 2 + [0, 0] +
                                                                                 [8.0 * side] * 2])}
    store = x.new_zeros(1, max(math.prod(s) for s in branch_shapes(unet, tuple(x.shape[1:]))))
    t = x.new_tensor([500.0])

    def flops(step: CacheStep) -> int:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            cached_unet(unet, x, t, ehs, step, store, added=added)
        return counter.get_total_flops()

    whole = flops(CacheStep(()))
    return [1.0 - flops(CacheStep((Stage(m, (), (0,), (0,), (), ()),))) / whole
            for m in range(len(residual_owners(unet)))]


def digit_images(engine: Engine, model: str, per_digit: int, steps: int | None,
                 cache: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(digits asked [n], 8-bit images [n, H, W, 3]) of `model`'s digit prompts, `per_digit` seeds a digit (seed
    FIRST_SEED + 10 * k + digit), submitted together; `cache` the requests' `step_cache` (None: none sent)."""
    extras = None if cache is None else {"step_cache": _as_param(cache)}
    asked = [d for _ in range(per_digit) for d in range(10)]
    futures = [engine.submit(engine.make_request(digit_prompt(model, d), seed=FIRST_SEED + i, num_inference_steps=steps,
                                                 extras=extras)) for i, d in enumerate(asked)]
    return np.array(asked), np.stack([np.asarray(f.result().images[0].convert("RGB")) for f in futures])


def _as_param(cache: Any) -> Any:
    if isinstance(cache, DeepCache):
        return {"method": "deepcache", **dataclasses.asdict(cache)}
    return cache


def measure(engine: Engine, model: str, oracle: DigitsOracle, settings: Iterable[Any], per_digit: int = 3,
            steps: int | None = None) -> list[QualityRow]:
    """The uncached row, then one row per setting (a DeepCache, or a `step_cache` value), all of `model`'s digit
    prompts at `steps` (None: the model's default)."""
    asked, reference = digit_images(engine, model, per_digit, steps)
    total = evaluations(engine, model, steps)
    shares = skip_shares(engine)
    rows = [QualityRow(None, total, total, 0.0, oracle.score(asked, reference / 255.0), 0.0, 0.0)]
    for setting in settings:
        spec = read_step_cache(_as_param(setting))
        _, images = digit_images(engine, model, per_digit, steps, setting)
        diff = np.abs(images.astype(np.int16) - reference.astype(np.int16))
        if spec == "off":
            rows.append(QualityRow(None, total, total, 0.0, oracle.score(asked, images / 255.0), float(diff.mean()),
                                   float(diff.max())))
            continue
        full = int(full_evaluations(spec, total).sum())
        rows.append(QualityRow(spec, total, full, shares[spec.branch], oracle.score(asked, images / 255.0),
                               float(diff.mean()), float(diff.max())))
    return rows


def evaluations(engine: Engine, model: str, steps: int | None) -> int:
    """The denoiser evaluations of one of `model`'s digit requests at `steps` (None: its default)."""
    return engine.runner.request_plan(engine.make_request(digit_prompt(model, 0), num_inference_steps=steps)).num_steps


def choose_auto(rows: Sequence[QualityRow]) -> QualityRow | None:
    """The cheapest cached row within MAX_SCORE_DROP of the uncached score and MAX_MEAN_LEVELS of its images (ties:
    the smaller difference); None: no setting keeps to the rule."""
    reference = rows[0].score
    kept = [r for r in rows[1:] if r.setting is not None and r.score >= reference - MAX_SCORE_DROP
            and r.mean_levels <= MAX_MEAN_LEVELS]
    return min(kept, key=lambda r: (round(r.cost, 6), r.mean_levels)) if kept else None


def describe(setting: DeepCache | None) -> str:
    return "off" if setting is None else f"{setting.schedule} interval {setting.interval}, branch {setting.branch}"


def format_table(rows: Sequence[QualityRow], auto: QualityRow | None = None) -> str:
    """The rows as a markdown table (the chosen `auto` row marked), cheapest first after the uncached row."""
    lines = ["| setting | full / evaluations | implied interval | UNet skipped when cached | UNet work per image | "
             "speedup bound | oracle score | mean diff (levels) | max diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in [rows[0], *sorted(rows[1:], key=lambda r: (r.cost, r.mean_levels))]:
        mark = " **(auto)**" if auto is not None and r is auto else ""
        lines.append(f"| {describe(r.setting)}{mark} | {r.full} / {r.evaluations} | {r.interval:.2f} | "
                     f"{r.skip:.0%} | {r.cost:.2f} | {1 / r.cost:.2f}x | {r.score:.2f} | {r.mean_levels:.2f} | "
                     f"{r.max_levels:.0f} |")
    return "\n".join(lines)
