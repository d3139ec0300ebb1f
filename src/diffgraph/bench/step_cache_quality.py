"""What step caching costs a trained model in quality, and what it saves (tools/step_cache_quality.py's table,
`diffgraph compare --step-cache`).

For a digits preset, each setting's images are drawn with the same prompts and seeds as the uncached ones (the
preset's digit prompts, seed i asking for digit i % 10, all admitted together): the digits oracle's score of both, the
mean absolute difference of the 8-bit images, and what the setting saves. The saving is counted, not timed: a
cached evaluation at branch m skips the share of the UNet's FLOPs (matmul, convolution and attention, counted by
torch's FlopCounterMode on one row of the model's native latent) that its deep path holds, so one image costs
`full / total + (1 - full / total) * (1 - skip)` of the uncached UNet work. `choose_auto` applies "auto"'s rule:
the cheapest setting whose score is within 0.02 of the uncached one and whose mean difference is at most 3 levels.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..engine.engine import Engine
from ..models.digits_oracle import DigitsOracle, digit_prompt
from .fp8_compare import digit_scores, oracle_lines, seed_prompts
from ..models.families.unet_cache import (CacheKey, CacheRows, DeepCache, branch_shapes, cached_unet, full_evaluations,
                                          read_step_cache, residual_owners, supports)

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


def skip_shares(engine: Engine, branches: Iterable[int] | None = None) -> dict[int, float]:
    """Per skip branch in `branches` (None: every one): the share of one UNet call's FLOPs that a row reusing its
    feature there does not run."""
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

    def flops(key: CacheKey, branch: int = -1) -> int:  # one row, reusing its feature at `branch`
        rows = CacheRows(torch.tensor([branch + 1], device=x.device), torch.tensor([branch >= 0], device=x.device),
                         torch.zeros(1, dtype=torch.int64, device=x.device), store)
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            cached_unet(unet, x, t, ehs, key, rows, added=added)
        return counter.get_total_flops()

    whole = flops(CacheKey(()))
    return {m: 1.0 - flops(CacheKey(((m, 0),)), m) / whole
            for m in (range(len(residual_owners(unet))) if branches is None else sorted(set(branches)))}


def render(engine: Engine, prompts: Sequence[tuple[str, int | None]], steps: int | None, cache: Any = None,
           size: tuple[int, int] | None = None, guidance: float | None = None) -> np.ndarray:
    """The 8-bit images [n, H, W, 3] of one request per prompt (seed FIRST_SEED + i), submitted together; `cache`
    the requests' `step_cache` (None: none sent); `size` (width, height) and `guidance` None: the model's. All are
    admitted between the same two steps, so two calls batch their rows alike (a row's image is its own within one
    level whatever its companions; alike, the same requests give the same bytes)."""
    extras = None if cache is None else {"step_cache": _as_param(cache)}
    width, height = size or (None, None)
    requests = [engine.make_request(text, seed=FIRST_SEED + i, num_inference_steps=steps, width=width, height=height,
                                    guidance_scale=guidance, extras=extras) for i, (text, _) in enumerate(prompts)]
    futures: list = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in requests)).result()
    return np.stack([np.asarray(f.result().images[0].convert("RGB")) for f in futures])


def _as_param(cache: Any) -> Any:
    if isinstance(cache, DeepCache):
        return {"method": "deepcache", **dataclasses.asdict(cache)}
    return cache


def measure(engine: Engine, model: str, oracle: DigitsOracle, settings: Iterable[Any], seeds: int = 30,
            steps: int | None = None) -> list[QualityRow]:
    """The uncached row, then one row per setting (a DeepCache, or a `step_cache` value), each over the same `seeds`
    images of `model`'s digit prompts (seed i asks for digit i % 10) at `steps` (None: the model's default)."""
    prompts = seed_prompts(model, seeds)
    asked = np.array([d for _, d in prompts])
    reference = render(engine, prompts, steps)
    total = evaluations(engine, model, steps)
    settings = list(settings)
    specs = [read_step_cache(_as_param(setting)) for setting in settings]
    shares = skip_shares(engine, [spec.branch for spec in specs if spec != "off"])
    rows = [QualityRow(None, total, total, 0.0, oracle.score(asked, reference / 255.0), 0.0, 0.0)]
    for setting, spec in zip(settings, specs):
        images = render(engine, prompts, steps, setting)
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


@dataclasses.dataclass(frozen=True)
class CacheCompare:
    """What `compare_step_cache` measured: the setting's row of the table (its setting None where it is not a
    DeepCache on a UNet: no FLOPs counted; score NaN and `reference_score` None where not scored, `oracle_note` says
    why when it was a digits preset) and the side-by-side image."""
    model: str
    device: str
    seeds: int
    size: tuple[int, int]
    label: str  # the setting as the report names it
    row: QualityRow
    reference_score: float | None
    image: Any  # PIL image: per seed, uncached left of cached
    oracle_note: str | None = None

    def format(self) -> str:
        r = self.row
        lines = [f"{self.model}: step cache {self.label} against uncached on {self.device}, "
                 f"{self.seeds} seed(s), {r.evaluations} evaluations, {self.size[0]}x{self.size[1]}"]
        if r.setting is not None:
            lines.append(f"  full evaluations: {r.full} / {r.evaluations} (interval {r.interval:.2f}); a cached one "
                         f"skips {r.skip:.0%} of the UNet's FLOPs; UNet work per image {r.cost:.2f} (speedup bound "
                         f"{1 / r.cost:.2f}x)")
        lines.append(f"  final images, pixel difference (0-255 levels): mean {r.mean_levels:.2f}, max "
                     f"{r.max_levels:.0f}")
        scores = None if self.reference_score is None else [("uncached", self.reference_score), ("cached", r.score)]
        return "\n".join(lines + oracle_lines(scores, self.oracle_note))


def side_by_side(reference: np.ndarray, cached: np.ndarray, per_row: int = 5) -> Any:
    """One PIL image: per seed the uncached image left of the cached one (a 4-pixel gap between), `per_row` pairs a
    row."""
    from PIL import Image

    n, h, w, _ = reference.shape
    gap = 4
    cols = min(per_row, n)
    rows = -(-n // cols)
    sheet = np.full((rows * (h + gap) - gap, cols * (2 * w + 3 * gap) - 2 * gap, 3), 128, np.uint8)
    for i in range(n):
        y, x = (i // cols) * (h + gap), (i % cols) * (2 * w + 3 * gap)
        sheet[y:y + h, x:x + w] = reference[i]
        sheet[y:y + h, x + w + gap:x + 2 * w + gap] = cached[i]
    return Image.fromarray(sheet)


def compare_step_cache(model: str, setting: Any, *, seeds: int = 20, steps: int | None = None,
                       size: tuple[int, int] | None = None, device: str | None = None, dtype: str | None = None,
                       guidance: float | None = None, prompt: str | None = None, load: Any = None) -> CacheCompare:
    """`model`'s images with the `step_cache` value `setting` ("auto", "off" or a setting object) against the same
    requests uncached, in one engine; `device`, `dtype` and `load` as Engine's. ValueError (ParamError) for a bad
    setting, model or size."""
    if seeds < 1:
        raise ValueError(f"seeds {seeds} must be >= 1")
    prompts = seed_prompts(model, seeds, prompt)
    with Engine(model, device=device, dtype=dtype, mode="eager", load=load) as engine:
        check = engine.make_request(prompts[0][0], num_inference_steps=steps, extras={"step_cache": setting})
        spec = read_step_cache(setting) if supports(engine.model.denoiser) else None  # None: not DeepCache
        total = engine.runner.request_plan(check).num_steps
        reference = render(engine, prompts, steps, None, size, guidance)
        cached = render(engine, prompts, steps, setting, size, guidance)
        shares = skip_shares(engine, [spec.branch]) if isinstance(spec, DeepCache) else {}
        place = str(engine.model.device)
    diff = np.abs(cached.astype(np.int16) - reference.astype(np.int16))
    scored, note = digit_scores(prompts, reference / 255.0, cached / 255.0)
    reference_score, score = scored or (None, float("nan"))
    cache = spec if isinstance(spec, DeepCache) else None
    full = total if cache is None else int(full_evaluations(cache, total).sum())
    row = QualityRow(cache, total, full, shares[cache.branch] if cache else 0.0, score, float(diff.mean()),
                     float(diff.max()))
    label = describe(cache) if cache is not None or spec == "off" else json.dumps(setting)
    return CacheCompare(model, place, seeds, (reference.shape[2], reference.shape[1]), label, row, reference_score,
                        side_by_side(reference, cached), note)
