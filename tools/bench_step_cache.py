"""One image's end-to-end latency with per-row step caching against the same request uncached, in one process
(random-initialised true architectures; fp16 graph mode, optionally the compile tier). Each case: warm-up runs,
then medians of `--repeats` (prompt to decoded pixels), and the step graphs the timed runs replayed (per kind: a
cached step's kind names its key). Writes JSON.

    PYTHONPATH=src python tools/bench_step_cache.py --cases random:sd15@512,random:sdxl@1024 --steps 20 \
        --caches off,auto,deepcache:3 [--compile] [--out bench_step_cache.json]

A cache is `off`, `auto` or `METHOD:INTERVAL` (deepcache: uniform, branch 0; taylorseer: order 1)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from diffgraph import Engine, GraphConfig


def cache_value(text: str):
    if text in ("off", "auto"):
        return None if text == "off" else "auto"
    method, interval = text.split(":")
    value = {"method": method, "interval": int(interval)}
    if method == "deepcache":
        value.update(branch=0, schedule="uniform")
    return value


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_replays(engine: Engine) -> dict[str, int]:
    """Replays per step graph kind so far (a cached step's kind names its key: "step_step_cache_b0k0"); in the timed
    runs they sum to the steps taken where no step ran eagerly."""
    out: dict[str, int] = {}
    for r in engine.runner.graph_table():
        if r["kind"].startswith("step"):
            out[r["kind"]] = out.get(r["kind"], 0) + (r["replays"] or 0)
    return out


def run_case(case: str, steps: int, caches: list[str], repeats: int, compile_tier: bool, device: str) -> list[dict]:
    model, size = case.split("@")
    size = int(size)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((size, size),), prewarm=False)
    rows = []
    cuda = device == "cuda"
    with Engine(model=model, device=device, dtype="fp16" if cuda else "fp32", mode="graph" if cuda else "eager",
                graphs=cfg if cuda else None, compile=compile_tier) as engine:
        for name in caches:
            value = cache_value(name)
            request = lambda: engine.make_request("a lighthouse on a cliff at dusk", width=size, height=size, seed=1,
                                                  num_inference_steps=steps,
                                                  extras=None if value is None else {"step_cache": value})
            for _ in range(2):
                engine.run(request())
            times, before = [], step_replays(engine)
            for _ in range(repeats):
                sync(device)
                t = time.perf_counter()
                engine.run(request())
                sync(device)
                times.append((time.perf_counter() - t) * 1000)
            after = step_replays(engine)
            replayed = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
            rows.append(dict(case=case, cache=name, steps=steps, compile=compile_tier, ms=statistics.median(times),
                             all_ms=times, replays=replayed))
            print(json.dumps(rows[-1]), flush=True)
    base = next((r["ms"] for r in rows if r["cache"] == "off"), None)
    for r in rows:
        r["speedup"] = None if base is None else base / r["ms"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="random:sd15@512,random:sdxl@1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--caches", default="off,auto,deepcache:3")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script (eager)")
    p.add_argument("--out", default="bench_step_cache.json")
    a = p.parse_args()
    rows = []
    for case in a.cases.split(","):
        rows += run_case(case, a.steps, a.caches.split(","), a.repeats, a.compile, a.device)
        json.dump(dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__, rows=rows), open(a.out, "w"),
                  indent=1)
    for r in rows:
        print(f"{r['case']:>22} {r['cache']:>12} {r['ms']:8.1f} ms  x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()
