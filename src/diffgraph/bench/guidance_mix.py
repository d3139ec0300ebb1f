"""`diffgraph bench throughput --guidance-mix N`: images/s at saturation for guidance settings, side by side.

Each scenario submits a burst of N requests at once to one engine (every graph warm, nothing compiles while timing)
and times it to the last image (decode included); each runs `repeats` times and the best is kept. The ratios are
the row-features issue's targets: guidance-free rows cost one denoiser row instead of two, and so do CFG rows outside
their `guidance_interval`.

    4-step requests, guidance 0 vs 7.5          request-steps/s and images/s (targets >= 1.8x and >= 1.5x)
    20-step, half guidance-free vs all CFG      images/s (target >= 1.3x)
    20-step CFG, guidance_interval [0.2, 0.8]   images/s vs without it (target >= 1.15x)
"""

from __future__ import annotations

import time
from typing import Any

SCENARIOS: tuple[tuple[str, int, tuple[dict[str, Any], ...]], ...] = (
    ("4 steps, CFG 7.5", 4, ({"guidance_scale": 7.5},)),
    ("4 steps, guidance 0", 4, ({"guidance_scale": 0.0},)),
    ("20 steps, CFG 7.5", 20, ({"guidance_scale": 7.5},)),
    ("20 steps, half guidance-free", 20, ({"guidance_scale": 7.5}, {"guidance_scale": 1.0})),
    ("20 steps, CFG 7.5 in [0.2, 0.8]", 20, ({"guidance_scale": 7.5, "guidance_interval": (0.2, 0.8)},)),
)
TARGETS = (("4 steps, guidance 0", "4 steps, CFG 7.5", "request_steps_per_s", 1.8),
           ("4 steps, guidance 0", "4 steps, CFG 7.5", "images_per_s", 1.5),
           ("20 steps, half guidance-free", "20 steps, CFG 7.5", "images_per_s", 1.3),
           ("20 steps, CFG 7.5 in [0.2, 0.8]", "20 steps, CFG 7.5", "images_per_s", 1.15))


def burst(engine: Any, requests: list) -> dict[str, float]:
    t0 = time.perf_counter()
    results = [f.result() for f in [engine.submit(r) for r in requests]]
    seconds = time.perf_counter() - t0
    images = sum(len(r) for r in results)
    steps = sum(r.request.num_inference_steps for r in results)
    return {"seconds": seconds, "images_per_s": images / seconds, "request_steps_per_s": steps / seconds}


def run(engine: Any, n: int, size: tuple[int, int], repeats: int = 2) -> dict[str, Any]:
    """Every scenario on `engine` (same prompts and seeds), best of `repeats`; returns figures and ratios."""
    h, w = size
    out: dict[str, Any] = {"requests": n, "size": f"{w}x{h}", "scenarios": {}, "ratios": {}}
    for name, steps, kinds in SCENARIOS:
        def requests():
            return [engine.make_request(f"a photo of a fox, number {i}", num_inference_steps=steps, seed=i,
                                        width=w, height=h, sampler="dpmpp_2m", **kinds[i % len(kinds)])
                    for i in range(n)]
        burst(engine, requests()[:max(2, n // 8)])  # warm: the buckets this scenario walks
        runs = [burst(engine, requests()) for _ in range(repeats)]
        out["scenarios"][name] = max(runs, key=lambda r: r["images_per_s"])
    for new, base, metric, target in TARGETS:
        ratio = out["scenarios"][new][metric] / out["scenarios"][base][metric]
        out["ratios"][f"{new} / {base} ({metric})"] = {"ratio": ratio, "target": target, "holds": ratio >= target}
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"guidance mix at saturation: bursts of {report['requests']} requests at {report['size']}")
    for name, r in report["scenarios"].items():
        print(f"  {name:34s} {r['images_per_s']:7.2f} images/s  {r['request_steps_per_s']:8.1f} request-steps/s  "
              f"({r['seconds']:.2f} s)")
    for name, r in report["ratios"].items():
        print(f"  {name:80s} {r['ratio']:.3f}x (target >= {r['target']}x: {'holds' if r['holds'] else 'MISSED'})")
