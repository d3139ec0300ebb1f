"""Step caching's quality on a trained digits model: per setting, the digits oracle's score (models/digits_oracle.py)
and the mean and largest absolute pixel difference (uint8 levels) to the uncached images of the same seeds, at the
model's default steps and guidance. CPU is enough (the digits models are tiny).

    python3 tools/step_cache_quality.py --model digits-zimage --per-digit 4 \
        --settings '{"method": "taylorseer", "interval": 2, "order": 1}' '{"method": "taylorseer", "interval": 3}'

Prints one JSON line per setting ("off" first) and a markdown table.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


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


def main() -> None:
    from diffgraph import Engine
    from diffgraph.models.digits_oracle import train_oracle

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="digits-zimage")
    ap.add_argument("--per-digit", type=int, default=4)
    ap.add_argument("--settings", nargs="+", required=True, help="step_cache values (JSON objects or \"auto\")")
    args = ap.parse_args()
    oracle = train_oracle()
    rows = []
    with Engine(model=args.model, device="cpu") as engine:
        plain, asked = images(engine, args.model, args.per_digit, "off")
        for value in ["off", *args.settings]:
            cache = value if value in ("off", "auto") else json.loads(value)
            got, _ = (plain, asked) if cache == "off" else images(engine, args.model, args.per_digit, cache)
            score = float((oracle.predict(got) == asked).mean())
            diff = np.abs(np.round(got * 255) - np.round(plain * 255))
            row = {"step_cache": cache, "oracle": score, "mean_levels": float(diff.mean()),
                   "max_levels": float(diff.max()), "images": len(asked)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("| step_cache | oracle score | mean abs difference (levels) | max (levels) |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{json.dumps(r['step_cache'])}` | {r['oracle']:.2f} | {r['mean_levels']:.2f} | "
              f"{r['max_levels']:.0f} |")


if __name__ == "__main__":
    main()
