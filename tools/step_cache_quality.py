"""Step caching's quality on the trained digits models: per setting, the digits oracle's score
(models/digits_oracle.py) and the mean and largest absolute pixel difference (uint8 levels) to the uncached images of
the same seeds, at the model's default steps and guidance. CPU is enough (the digits models are tiny).

The UNet presets' grid (BENCHMARKS.md's DeepCache table and the setting "auto" is chosen by; bench/step_cache_quality.py
measures: every interval x branch x schedule, with the full evaluations and the share of the UNet a cached one skips):

    PYTHONPATH=src python tools/step_cache_quality.py [--models digits digits-xl] [--per-digit 3] [--steps N]

Named settings on one model (BENCHMARKS.md's TaylorSeer and first-block tables; one JSON line per setting, "off"
first, and a markdown table; `full` counts the rows the transformer's second block ran over, so a first-block cache's
data-dependent full evaluations are measured):

    PYTHONPATH=src python3 tools/step_cache_quality.py --model digits-zimage --per-digit 4 \
        --settings '{"method": "taylorseer", "interval": 2, "order": 1}' '{"method": "taylorseer", "interval": 3}'
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

UNET_PRESETS = ("digits", "digits-xl")


def images(engine, model: str, per_digit: int, cache) -> tuple[np.ndarray, np.ndarray]:
    """(images [10 * per_digit, 64, 64, 3] in 0..1, the digits asked), as `engine_score` draws them."""
    from diffgraph.models.digits_oracle import SIZE, digit_prompt

    out, asked = [], []
    for d in range(10):
        result = engine.generate(digit_prompt(model, d), seed=1000 + d, num_images=per_digit, width=SIZE, height=SIZE,
                                 extras={"step_cache": cache})
        out.append(np.asarray(result.arrays))
        asked += [d] * per_digit
    return np.concatenate(out), np.array(asked)


class BlockRows:
    """Counts the rows a transformer's second block runs over (its full evaluations: a cached row skips it)."""

    def __init__(self, engine):
        self.rows = 0
        layers = getattr(engine.model.denoiser, "layers", None)
        self._handle = None if layers is None or len(layers) < 2 else layers[1].register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.rows += args[0].shape[0]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def named_settings(args: argparse.Namespace, oracle) -> None:
    """`--settings` on `--model`: one JSON line per setting and a markdown table (`full`: the rows the transformer's
    remaining blocks ran over as a share of the uncached run's, its full evaluations: a first-block cache's
    measured)."""
    from diffgraph import Engine

    rows = []
    with Engine(model=args.model, device="cpu") as engine:
        counter = BlockRows(engine)
        plain, asked = images(engine, args.model, args.per_digit, "off")
        uncached = counter.rows
        for value in ["off", *args.settings]:
            cache = value if value in ("off", "auto") else json.loads(value)
            counter.rows = 0
            got, _ = (plain, asked) if cache == "off" else images(engine, args.model, args.per_digit, cache)
            score = float((oracle.predict(got) == asked).mean())
            diff = np.abs(np.round(got * 255) - np.round(plain * 255))
            row = {"step_cache": cache, "oracle": score, "mean_levels": float(diff.mean()),
                   "max_levels": float(diff.max()), "images": len(asked),
                   "full": counter.rows / uncached if cache != "off" and uncached else 1.0}
            print(json.dumps(row), flush=True)
            rows.append(row)
        counter.close()
    print("| step_cache | full evaluations (share of uncached) | oracle score | mean abs difference (levels) | "
          "max (levels) |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{json.dumps(r['step_cache'])}` | {r['full']:.2f} | {r['oracle']:.2f} | {r['mean_levels']:.2f} | "
              f"{r['max_levels']:.0f} |")


def unet_grid(args: argparse.Namespace, oracle) -> None:
    """The DeepCache grid on each of `--models`: a markdown table each and the setting the rule picks for "auto"."""
    from diffgraph import Engine
    from diffgraph.bench.step_cache_quality import choose_auto, describe, evaluations, format_table, grid, measure
    from diffgraph.models.families.unet_cache import residual_owners

    for model in args.models:
        start = time.perf_counter()
        with Engine(model=model, device="cpu") as engine:
            sampler = engine.make_request("x").sampler
            total = evaluations(engine, model, args.steps)
            settings = grid(len(residual_owners(engine.model.denoiser)), args.intervals)
            rows = measure(engine, model, oracle, settings, 10 * args.per_digit, args.steps)
        auto = choose_auto(rows)
        print(f"\n### {model}: {total} evaluations ({sampler}), {10 * args.per_digit} images a setting, "
              f"{time.perf_counter() - start:.0f} s\n")
        print(format_table(rows, auto))
        print(f"\nauto for {model}: {describe(auto.setting) if auto else 'none keeps to the rule'}")


def main() -> None:
    from diffgraph.models.digits_oracle import train_oracle

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(UNET_PRESETS), choices=UNET_PRESETS,
                    help="the UNet presets of the DeepCache grid (default: both)")
    ap.add_argument("--per-digit", type=int, default=3, help="seeds per digit (default: 3)")
    ap.add_argument("--steps", type=int, default=None, help="the grid's steps (default: the model's)")
    ap.add_argument("--intervals", type=int, nargs="+", default=[2, 3, 4, 5], help="the grid's intervals")
    ap.add_argument("--settings", nargs="+", default=None,
                    help="named step_cache values (JSON objects or \"auto\") on --model instead of the grid")
    ap.add_argument("--model", default="digits-zimage", help="the model of --settings (default: digits-zimage)")
    args = ap.parse_args()
    oracle = train_oracle()
    if args.settings:
        named_settings(args, oracle)
    else:
        unet_grid(args, oracle)


if __name__ == "__main__":
    main()
