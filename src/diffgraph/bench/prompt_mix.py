"""`diffgraph bench throughput --prompt-mix N`: long prompts beside short ones, side by side (targets below).

  * the step: one replay at the largest bucket of 1-window rows (kind "step") against the same bucket with the
    rows' prompts at 3 windows ("step_context3": what a group mixing 1- and 3-window rows replays; target <= 1.1x),
    at 6 windows (2- and 3-window rows together), and against the alternative of keeping chunk counts apart (two
    replays of half the bucket, one per chunk count): the measurement behind features/context.py's design;
  * images/s at saturation: bursts of N requests of AUTOMATIC1111-syntax prompts, all of one chunk, then with 30% of
    them 2 or 3 chunks long (target >= 0.95x), decode included, best of `repeats`;
  * the submitting thread's cost of a 3-chunk prompt: parsing and tokenising it (`text/prepared.py:prepare`),
    median of 200 (target < 5 ms on the CPU).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..text.prepared import prepare
from .guidance_mix import burst
from .latency import _timed

SHORT = "a photo of a red fox in the snow, (detailed fur:1.2), [blurry]"
CLAUSE = "a detailed painting of a small red house in the dark forest at night, soft light"


def long_prompt(chunks: int) -> str:
    """An AUTOMATIC1111 prompt that tokenises to `chunks` 75-token chunks (BREAK between them)."""
    return " BREAK ".join([f"({CLAUSE}:1.1), {CLAUSE}"] * chunks)


def replay_ms(engine: Any, kind: str, key: tuple[int, int], bucket: int, repeats: int) -> float | None:
    runner = engine.runner.graph_runner
    h, w = key
    if runner is None or runner.stats[(kind, h, w, bucket)].status != "captured":
        return None
    return _timed(lambda: [runner.replay(kind, h, w, bucket) for _ in range(10)], repeats) / 10


def prepare_ms(engine: Any, chunks: int = 3, n: int = 200) -> float:
    request = engine.make_request(long_prompt(chunks), prompt_syntax="a1111", num_inference_steps=2)
    assert prepare(engine.runner.text_setup, request)[0].chunks == chunks, "the bench prompt's chunk count changed"
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        prepare(engine.runner.text_setup, request)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(engine: Any, n: int, size: tuple[int, int], steps: int = 20, repeats: int = 2) -> dict[str, Any]:
    h, w = size
    program = engine.runner.program
    out: dict[str, Any] = {"requests": n, "size": f"{w}x{h}", "steps": steps, "scenarios": {}, "ratios": {},
                           "prepare_3_chunks_ms": prepare_ms(engine)}
    buckets = engine.runner.graph_config.batch_buckets
    top = 16 if 16 in buckets else max(buckets)  # the targets' bucket-16 step (16 denoiser rows)
    neutral = program.neutral()
    kinds = {c: program.kind(tuple(c if f.name == "context" else p for f, p in zip(program.features, neutral)))
             for c in (1, 3, 6)}
    ms = {f"{c} windows, bucket {b}": replay_ms(engine, kinds[c], size, b, 5)
          for c, b in ((1, top), (3, top), (6, top), (1, top // 2), (3, top // 2))}
    out["replay_ms"] = ms
    one, mixed = ms[f"1 windows, bucket {top}"], ms[f"3 windows, bucket {top}"]
    if mixed is not None and one:
        out["ratios"]["step mixing 1- and 3-window rows / all 1-window"] = {
            "ratio": mixed / one, "target": 1.1, "holds": mixed <= 1.1 * one, "lower_is_better": True}
        halves = (ms[f"1 windows, bucket {top // 2}"], ms[f"3 windows, bucket {top // 2}"])
        if None not in halves:
            out["split_groups_ms"] = sum(halves)  # chunk counts kept apart: two replays of half the rows
    short, mixed_name = f"{steps} steps, 1-chunk prompts", f"{steps} steps, 30% 2-3 chunk prompts"
    for name, share in ((short, 0.0), (mixed_name, 0.3)):
        def requests(share=share):
            return [engine.make_request(long_prompt(2 + i % 2) if i % 10 < round(10 * share) else SHORT,
                                        prompt_syntax="a1111", num_inference_steps=steps, seed=i, width=w, height=h,
                                        guidance_scale=7.5, sampler="dpmpp_2m") for i in range(n)]
        burst(engine, requests()[:max(2, n // 8)])  # warm
        runs = [burst(engine, requests()) for _ in range(repeats)]
        best = max(runs, key=lambda r: r["images_per_s"])
        best["steps"] = {"count": len(best["steps"]), "buckets": sorted({c for _, c in best["steps"]})}
        out["scenarios"][name] = best
    a, b = (out["scenarios"][k]["images_per_s"] for k in (mixed_name, short))
    out["ratios"]["images/s, 30% 2-3 chunk prompts / all 1-chunk"] = {"ratio": a / b, "target": 0.95,
                                                                      "holds": a / b >= 0.95}
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"prompt mix: bursts of {report['requests']} requests at {report['size']}, {report['steps']} steps")
    print(f"  parse + tokenise a 3-chunk prompt (submitting thread): {report['prepare_3_chunks_ms']:.2f} ms")
    for name, v in report["replay_ms"].items():
        print(f"  step replay, {name:28s} {v if v is not None else float('nan'):8.2f} ms")
    if "split_groups_ms" in report:
        print(f"  chunk counts kept apart (two half-bucket replays): {report['split_groups_ms']:.2f} ms")
    for name, r in report["scenarios"].items():
        print(f"  {name:34s} {r['images_per_s']:7.2f} images/s ({r['seconds']:.2f} s, {r['steps']['count']} steps)")
    for name, r in report["ratios"].items():
        bound = "<=" if r.get("lower_is_better") else ">="
        print(f"  {name:60s} {r['ratio']:.3f}x (target {bound} {r['target']}x: {'holds' if r['holds'] else 'MISSED'})")


def main(argv: list[str] | None = None) -> int:
    """`python -m diffgraph.bench.prompt_mix [--model M]`: the submitting thread's cost of a 3-chunk prompt on this
    machine (the CPU's figure; the GPU scenarios run with `diffgraph bench throughput --prompt-mix N`)."""
    import argparse

    from ..engine.engine import Engine

    p = argparse.ArgumentParser(prog="python -m diffgraph.bench.prompt_mix")
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--chunks", type=int, default=3)
    args = p.parse_args(argv)
    with Engine(args.model, device="cpu", dtype="fp32") as engine:
        ms = prepare_ms(engine, args.chunks)
    print(f"parse + tokenise a {args.chunks}-chunk AUTOMATIC1111 prompt on the submitting thread: {ms:.2f} ms "
          f"(median of 200; target < 5 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
