"""The step-cache quality table (BENCHMARKS.md): per digits preset, every DeepCache setting of the grid against the
uncached images of the same prompts and seeds (bench/step_cache_quality.py measures), and the setting the rule picks
for "auto" (the cheapest within 0.02 of the uncached oracle score and at most 3 levels mean difference).

    PYTHONPATH=src python tools/step_cache_quality.py [--models digits digits-xl] [--per-digit 3] [--steps N]

CPU, a few minutes on two cores (the models' default steps, 10 digits x `--per-digit` seeds per setting).
"""

from __future__ import annotations

import argparse
import time

from diffgraph import Engine
from diffgraph.bench.step_cache_quality import choose_auto, describe, evaluations, format_table, grid, measure
from diffgraph.models.digits_oracle import DIGITS_PRESETS, train_oracle
from diffgraph.models.families.unet_cache import residual_owners


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(DIGITS_PRESETS), choices=DIGITS_PRESETS)
    p.add_argument("--per-digit", type=int, default=3, help="seeds per digit (default: 3, 30 images a setting)")
    p.add_argument("--steps", type=int, default=None, help="steps (default: the model's)")
    p.add_argument("--intervals", type=int, nargs="+", default=[2, 3, 4, 5])
    args = p.parse_args()
    oracle = train_oracle()
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


if __name__ == "__main__":
    main()
