"""`diffgraph bench throughput --sampler-mix N`: images/s at saturation with every sampler mixed in one running batch,
against an all-euler trace of the same denoiser evaluations (targets below).

Each scenario submits a burst of N requests at once to one engine (every graph warm) and times it to the last image
(decode included); best of `repeats`. Evaluations are what a step costs: a one-evaluation sampler's request of n
steps is n evaluations, a two-evaluation sampler's (heun, dpm2, dpm2_a) 2n - 1.

    every sampler mixed, 19 evaluations each  vs  all euler, 19 steps        images/s (target >= 0.97x)
    heun, 20 steps (39 evaluations)           vs  euler, 39 steps             images/s (target >= 0.97x: within 3%)
"""

from __future__ import annotations

from typing import Any

from ..sampling.names import SAMPLER_SCHEDULES, SAMPLERS, SCHEDULES
from .guidance_mix import burst

TWO_EVALUATIONS = ("heun", "dpm2", "dpm2_a", "dpmpp_sde")
EVALUATIONS = 19  # per request in the mixed trace: 19 steps, or 10 steps of a two-evaluation sampler


def _mixed(i: int) -> dict[str, Any]:
    sampler = SAMPLERS[i % len(SAMPLERS)]
    allowed = SAMPLER_SCHEDULES.get(sampler, SCHEDULES)
    steps = (EVALUATIONS + 1) // 2 if sampler in TWO_EVALUATIONS else EVALUATIONS
    return {"sampler": sampler, "schedule": allowed[(i // len(SAMPLERS)) % len(allowed)], "num_inference_steps": steps}


SCENARIOS: tuple[tuple[str, Any], ...] = (
    ("all euler, 19 steps", lambda i: {"sampler": "euler", "num_inference_steps": EVALUATIONS}),
    ("every sampler mixed, 19 evaluations", _mixed),
    ("euler, 39 steps", lambda i: {"sampler": "euler", "num_inference_steps": 39}),
    ("heun, 20 steps (39 evaluations)", lambda i: {"sampler": "heun", "num_inference_steps": 20}),
)
TARGETS = (("every sampler mixed, 19 evaluations", "all euler, 19 steps", 0.97),
           ("heun, 20 steps (39 evaluations)", "euler, 39 steps", 0.97))


def run(engine: Any, n: int, size: tuple[int, int], repeats: int = 2) -> dict[str, Any]:
    """Every scenario on `engine` (same prompts and seeds, CFG 7.5), best of `repeats`; returns figures and ratios."""
    h, w = size
    out: dict[str, Any] = {"requests": n, "size": f"{w}x{h}", "scenarios": {}, "ratios": {}}
    for name, kind in SCENARIOS:
        def requests():
            return [engine.make_request(f"a photo of a fox, number {i}", seed=i, width=w, height=h, guidance_scale=7.5,
                                        **kind(i)) for i in range(n)]
        burst(engine, requests()[:max(2, n // 8)])  # warm: the buckets this scenario walks
        runs = [burst(engine, requests()) for _ in range(repeats)]
        best = max(runs, key=lambda r: r["images_per_s"])
        best["evaluations"] = sum(rows for rows, _ in best.pop("steps"))
        out["scenarios"][name] = best
    for new, base, target in TARGETS:
        ratio = out["scenarios"][new]["images_per_s"] / out["scenarios"][base]["images_per_s"]
        out["ratios"][f"{new} / {base} (images/s)"] = {"ratio": ratio, "target": target, "holds": ratio >= target}
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"sampler mix at saturation: bursts of {report['requests']} requests at {report['size']}")
    for name, r in report["scenarios"].items():
        print(f"  {name:38s} {r['images_per_s']:7.2f} images/s  ({r['seconds']:.2f} s, {r['evaluations']} image-row "
              "evaluations)")
    for name, r in report["ratios"].items():
        print(f"  {name:80s} {r['ratio']:.3f}x (target >= {r['target']}x: {'holds' if r['holds'] else 'MISSED'})")
