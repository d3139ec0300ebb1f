"""`diffgraph bench throughput --guidance-mix N`: images/s at saturation for guidance settings, side by side.

Each scenario submits a burst of N requests at once to one engine (every graph warm, nothing compiles while timing)
and times it to the last image (decode included); each runs `repeats` times and the best is kept. Its steps-only
rate divides the image rows its steps advanced by the GPU time of those steps' replays (each step's bucket, timed
alone after the bursts: the denoising's own rate, without admission and decode). What the
ratios test: guidance-free rows cost one denoiser row instead of two, and so do CFG rows outside
their `guidance_interval`.

    4-step requests, guidance 0 vs 7.5          request-steps/s and images/s (targets >= 1.8x and >= 1.5x)
    20-step, half guidance-free vs all CFG      images/s (target >= 1.3x)
    20-step CFG, guidance_interval [0.2, 0.8]   images/s vs without it (target >= 1.15x)

On CUDA each images/s ratio is also given over the bursts' GPU spans (`span_rate`), as a diagnostic beside the
targets (which the bursts' own images/s decide): a burst starts with the GPU idle while its requests are submitted and
ends with the host delivering its last images. How much of that a saturated engine hides behind other requests' steps
is not measured here (its submissions and deliveries share the CPU with the loop thread); a longer burst (N) shrinks
both.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .latency import step_replay_ms

SCENARIOS: tuple[tuple[str, int, tuple[dict[str, Any], ...]], ...] = (
    ("4 steps, CFG 7.5", 4, ({"guidance_scale": 7.5},)),
    ("4 steps, guidance 0", 4, ({"guidance_scale": 0.0},)),
    ("20 steps, CFG 7.5", 20, ({"guidance_scale": 7.5},)),
    ("20 steps, half guidance-free", 20, ({"guidance_scale": 7.5}, {"guidance_scale": 1.0})),
    ("20 steps, CFG 7.5 in [0.2, 0.8]", 20, ({"guidance_scale": 7.5, "guidance_interval": (0.2, 0.8)},)),
)
TARGETS = (("4 steps, guidance 0", "4 steps, CFG 7.5", "steps_only_request_steps_per_s", 1.8),
           ("4 steps, guidance 0", "4 steps, CFG 7.5", "request_steps_per_s", 1.8),
           ("4 steps, guidance 0", "4 steps, CFG 7.5", "images_per_s", 1.5),
           ("20 steps, half guidance-free", "20 steps, CFG 7.5", "images_per_s", 1.3),
           ("20 steps, CFG 7.5 in [0.2, 0.8]", "20 steps, CFG 7.5", "images_per_s", 1.15))
# the images/s ratios again over each burst's GPU span (CUDA only: `span_rate`), a diagnostic without a verdict
SPAN_RATIOS = tuple((new, base) for new, base, metric, _ in TARGETS if metric == "images_per_s")


def burst(engine: Any, requests: list) -> dict[str, Any]:
    """Submits every request at once (between two steps) and waits for the last image. On CUDA it also splits the
    burst's time on the GPU's stream (`split`): see `_split`."""
    steps_run: list[tuple[int, int]] = []
    engine.step_listeners.append(lambda plan, seconds: steps_run.append((plan.n_rows, plan.cost_rows)))
    core, cuda = engine.core, engine.runner.cuda
    marks: list = []
    if cuda:
        core.step_events, core.retirement.decode_log = [], []
    try:
        futures: list = []

        def submit_all() -> None:
            if cuda:  # the burst's start on the engine's stream
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[0].record(torch.cuda.current_stream(engine.runner.device))
            futures.extend(engine.submit(r) for r in requests)
        t0 = time.perf_counter()
        core.call_between_steps(submit_all).result()
        results = [f.result() for f in futures]
        seconds = time.perf_counter() - t0
        core.call_between_steps(lambda: None).result()  # the last step's listener has run
    finally:
        engine.step_listeners.pop()
        steps, decodes = core.step_events, core.retirement.decode_log
        core.step_events = core.retirement.decode_log = None
    images = sum(len(r) for r in results)
    n_steps = sum(r.request.num_inference_steps * len(r) for r in results)
    out = {"seconds": seconds, "images_per_s": images / seconds, "request_steps_per_s": n_steps / seconds,
           "steps": steps_run}
    if cuda:
        torch.cuda.synchronize(engine.runner.device)
        out["split"] = _split(marks[0], steps, [e for *_, e in decodes if e is not None], seconds)
        out["span_images_per_s"] = span_rate(images, out["split"])
    return out


def span_rate(images: int, split: dict[str, float]) -> float:
    """A burst's images/s over its GPU span: from the first step's start to the end of the last GPU work (its last
    decode). It leaves out the burst's lead (every request submitted while the GPU waits) and the last images'
    delivery after the GPU's last work, which other requests' steps could fill at saturation (not measured). The
    first admissions and every decode stay in."""
    return images / (split["gpu_span"] - split["lead"])


def _split(start: Any, steps: list, decodes: list, seconds: float) -> dict[str, float]:
    """Where a burst's seconds went, from CUDA events on the engine's stream: `lead` from the submission to the first
    step's start (the requests submitted on the loop thread: their prompts prepared, the GPU idle), `loop` the steps'
    spans (from a step's admissions, the first ones included, to its retirement, replays and the decodes enqueued in
    them included), `decode` the
    decodes' GPU time (inside the steps' spans or after the last), `tail` from the last GPU work's end to the last
    image delivered (host). Seconds."""
    first = steps[0][0] if steps else start
    ends = [e for _, e, _ in steps] + [e for _, e in decodes]
    last = max(ends, key=lambda e: start.elapsed_time(e)) if ends else start
    gpu_s = start.elapsed_time(last) / 1e3
    return {"lead": start.elapsed_time(first) / 1e3,
            "loop": sum(a.elapsed_time(b) for a, b, _ in steps) / 1e3,
            "decode": sum(a.elapsed_time(b) for a, b in decodes) / 1e3,
            "gpu_span": gpu_s, "tail": max(0.0, seconds - gpu_s)}


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
    buckets = {c for r in out["scenarios"].values() for _, c in r["steps"]}
    ms = {}
    if engine.runner.graph_runner is not None and buckets <= set(engine.runner.graph_config.batch_buckets):
        ms = {b: step_replay_ms(engine, size, b, repeats=3) for b in sorted(buckets)}
    if ms and None not in ms.values():  # every step ran as a replay of a captured bucket
        out["replay_ms"] = ms
        for r in out["scenarios"].values():
            gpu_s = sum(ms[c] for _, c in r["steps"]) / 1e3
            r["steps_only_request_steps_per_s"] = sum(n for n, _ in r["steps"]) / gpu_s
            r["steps_gpu_s"] = gpu_s
    for r in out["scenarios"].values():
        r["steps"] = {"count": len(r["steps"]), "buckets": sorted({c for _, c in r["steps"]})}
    for new, base, metric, target in TARGETS:
        if metric not in out["scenarios"][new]:
            continue
        ratio = out["scenarios"][new][metric] / out["scenarios"][base][metric]
        out["ratios"][f"{new} / {base} ({metric})"] = {"ratio": ratio, "target": target, "holds": ratio >= target}
    spans = {name: r["span_images_per_s"] for name, r in out["scenarios"].items() if "span_images_per_s" in r}
    if spans:
        out["span_ratios"] = {f"{new} / {base}": spans[new] / spans[base] for new, base in SPAN_RATIOS}
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"guidance mix at saturation: bursts of {report['requests']} requests at {report['size']}")
    for name, r in report["scenarios"].items():
        steps_only = r.get("steps_only_request_steps_per_s")
        print(f"  {name:34s} {r['images_per_s']:7.2f} images/s  {r['request_steps_per_s']:8.1f} request-steps/s  "
              f"({r['seconds']:.2f} s; steps only {steps_only or float('nan'):8.1f} request-steps/s over "
              f"{r.get('steps_gpu_s', float('nan')):.2f} s of replays, {r['steps']['count']} steps, buckets "
              f"{r['steps']['buckets']})")
        if "split" in r:
            sp = r["split"]
            beyond = r["seconds"] - r.get("steps_gpu_s", float("nan"))
            print(f"  {'':34s} beyond the replays {beyond:.3f} s: lead {sp['lead']:.3f} s, decodes {sp['decode']:.3f} "
                  f"s, tail {sp['tail']:.3f} s, rest {beyond - sp['lead'] - sp['decode'] - sp['tail']:.3f} s "
                  f"(steps' spans {sp['loop']:.3f} s; {r['span_images_per_s']:.2f} images/s over the GPU span)")
    if "replay_ms" in report:
        print("  step replay ms per bucket: " + ", ".join(f"{b}: {v:.2f}" for b, v in report["replay_ms"].items()))
    for name, r in report["ratios"].items():
        print(f"  {name:80s} {r['ratio']:.3f}x (target >= {r['target']}x: {'holds' if r['holds'] else 'MISSED'})")
    for name, ratio in report.get("span_ratios", {}).items():
        print(f"  {name + ' (images/s over the GPU spans: a diagnostic)':80s} {ratio:.3f}x")
