"""Step caching's speed targets in one run: one image's latency, images/s at saturation, and a half-cached burst
(random-initialised true architectures; graph mode, optionally the compile tier; text encoder and decode included:
the prompt cache is off unless --prompt-cache, so every request encodes its prompt). Each case (MODEL@SIZE) opens
one engine and runs the asked modes on it in order; every result is one JSON line appended to --out as it finishes,
so a killed run keeps what finished, and --budget-s starts no mode past that many seconds (it records the skip).

Modes (--mode, comma-separated):
- one: one image's latency per --caches entry, the median of --repeats; `speedup` against the `off` entry before
  it; "auto" records the setting it resolved to (`setting`, `interval`).
- saturation: --burst N requests submitted at once (distinct prompts, seeds 0..N-1) uncached, then the same
  requests at --cache (default: deepcache:3 on a UNet, taylorseer:3 on a DiT): images/s each, `ratio` (cached over
  uncached), and the cached images' mean / largest absolute difference to the uncached ones in uint8 levels.
- half: the same burst with every other row cached, against its two halves run one after the other: `ratio` is the
  mix's images/s over the halves' (target >= 0.95); `mix_vs_apart_max_levels`: each row in the mix against itself
  in its half (a row's image never depends on its companions).
Warm-up runs come first, at --warm-steps steps and timed apart (mode one: two runs; a burst: a burst of the same
mix, min(N, largest batch bucket) requests): `warmup_ms` / `warmup_s`, and the graphs and compiles they made
(`warmup_captures`, `warmup_capture_ms`, `warmup_compiles`, `warmup_compile_s`). Each timed record counts what
happened while it was timed: `steps_run`, `replays` per step graph kind, `eager_steps` (steps that replayed no
graph), `captures` / `capture_ms` (graphs made on first use) and `compiles` / `compile_s` (the compile tier's):
captures and compiles 0 mean the warm-up made every variant the timed part used.

    PYTHONPATH=src python tools/bench_step_cache.py --cases random:sd15@512,random:sdxl@1024 --steps 20 \\
        --mode one,saturation,half --caches off,auto,deepcache:3 [--burst 16] [--compile] [--out bench.jsonl]
    PYTHONPATH=src python tools/bench_step_cache.py --cases random:zimage-base@1024 --mode saturation \\
        --cache taylorseer:3 --burst 8 --warm-steps 8 --compile   # the base checkpoint's 50 steps, guidance 5

A cache is `off`, `auto` or `METHOD:INTERVAL[:ORDER]` (deepcache: uniform, branch 0; taylorseer: ORDER, default 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from diffgraph import Engine, GraphConfig

PROMPT = "a lighthouse on a cliff at dusk"
UNET_CACHE, DIT_CACHE = "deepcache:3", "taylorseer:3"


def cache_value(text: str) -> Any:
    """A --caches / --cache entry as a request's `step_cache` value (None: off)."""
    if text in ("off", "auto"):
        return None if text == "off" else "auto"
    method, interval, *rest = text.split(":")
    value: dict[str, Any] = {"method": method, "interval": int(interval)}
    if method == "deepcache":
        value.update(branch=0, schedule="uniform")
    elif method == "taylorseer":
        value["order"] = int(rest[0]) if rest else 1
    return value


def setting(engine: Engine, text: str) -> dict[str, Any]:
    """What the engine reads `text` as: the setting's infotext and its interval ("auto" resolved)."""
    value = cache_value(text)
    if value is None:
        return {"setting": "off", "interval": 1}
    cap = next(c for c in engine.runner.capabilities.present if c.name == "step_cache")
    spec = cap.params[0].kind(value)
    return {"setting": spec.infotext(), "interval": getattr(spec, "interval", None)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def graph_counts(engine: Engine) -> dict[str, Any]:
    """The engine's counters so far: steps run, graphs made on first use and their capture ms, compiles and their
    seconds (the compile tier), and the replays per step graph kind (a cached step's kind names its key:
    "step_step_cache_b0k0"); read on the engine's loop between two steps, where a finished step is counted."""
    table, stats = engine.core.call_between_steps(lambda: (engine.graph_table(), engine.stats)).result()
    replays: dict[str, int] = {}
    for r in table:
        if r["kind"].startswith("step") and r["replays"]:
            replays[r["kind"]] = replays.get(r["kind"], 0) + r["replays"]
    return {"steps_run": stats["steps"], "captures": sum(r["on_demand"] for r in table),
            "capture_ms": sum(r["capture_ms"] for r in table), "compiles": stats["compiles"],
            "compile_s": stats["compile_s"], "replays": replays}


def counts_since(engine: Engine, before: dict[str, Any]) -> dict[str, Any]:
    """The counters' growth since `before`; `eager_steps`: the steps run that replayed no graph."""
    now = graph_counts(engine)
    out = {k: now[k] - before[k] for k in ("steps_run", "captures", "capture_ms", "compiles", "compile_s")}
    out["replays"] = {k: n - before["replays"].get(k, 0) for k, n in now["replays"].items()
                      if n > before["replays"].get(k, 0)}
    out["eager_steps"] = out["steps_run"] - sum(out["replays"].values())
    return out


def warmup_counts(engine: Engine, before: dict[str, Any]) -> dict[str, Any]:
    """What a warm-up made: `warmup_captures`, `warmup_capture_ms`, `warmup_compiles`, `warmup_compile_s`."""
    grown = counts_since(engine, before)
    return {f"warmup_{k}": grown[k] for k in ("captures", "capture_ms", "compiles", "compile_s")}


def levels(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, int]:
    """Mean and largest absolute difference of two image lists as 8-bit images (uint8 levels)."""
    d = np.abs(np.stack([(x * 255).round() for x in a]).astype(np.int16)
               - np.stack([(x * 255).round() for x in b]).astype(np.int16))
    return float(d.mean()), int(d.max())


@dataclass
class Case:
    name: str
    engine: Engine
    size: int
    args: argparse.Namespace
    cache: str          # the named setting of the saturation and half modes
    bucket: int         # the largest batch bucket: the rows a step holds

    def request(self, cache: str, seed: int, tag: str, steps: int | None = None):
        value = cache_value(cache)
        return self.engine.make_request(
            f"{PROMPT}, {tag} {seed}" if tag else PROMPT, width=self.size, height=self.size, seed=seed,
            num_inference_steps=steps or self.args.steps, guidance_scale=self.args.guidance,
            extras=None if value is None else {"step_cache": value})


def burst(engine: Engine, requests: list) -> tuple[float, list[np.ndarray]]:
    """Seconds from submitting `requests` at once (between two steps) to the last image, and the images."""
    futures: list = []
    t = time.perf_counter()
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in requests)).result()
    images = [f.result().arrays[0] for f in futures]
    return time.perf_counter() - t, images


def timed_burst(case: Case, caches: list[str], seeds: list[int]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A warm-up burst of the same mix (its first min(N, bucket) caches, other seeds), then the timed burst."""
    warm = [case.request(c, 100_000 + i, "warm", case.args.warm_steps) for i, c in enumerate(caches[:case.bucket])]
    before = graph_counts(case.engine)
    warmup_s, _ = burst(case.engine, warm)
    warmup, before = warmup_counts(case.engine, before), graph_counts(case.engine)
    wall, images = burst(case.engine, [case.request(c, s, "take") for c, s in zip(caches, seeds)])
    return dict(images=len(caches), warmup_s=warmup_s, **warmup, wall_s=wall, images_per_s=len(caches) / wall,
                **counts_since(case.engine, before)), images


def one_image(case: Case, emit: Callable[[dict], None]) -> None:
    base = None
    for name in case.args.caches.split(","):
        warmup_ms, before = [], graph_counts(case.engine)
        for _ in range(2):
            t = time.perf_counter()
            case.engine.run(case.request(name, 1, "", case.args.warm_steps))
            sync(case.args.device)
            warmup_ms.append((time.perf_counter() - t) * 1000)
        warmup, times, before = warmup_counts(case.engine, before), [], graph_counts(case.engine)
        for _ in range(case.args.repeats):
            sync(case.args.device)
            t = time.perf_counter()
            case.engine.run(case.request(name, 1, ""))
            sync(case.args.device)
            times.append((time.perf_counter() - t) * 1000)
        ms = statistics.median(times)
        base = ms if name == "off" else base
        emit(dict(mode="one", cache=name, **setting(case.engine, name), ms=ms, all_ms=times, warmup_ms=warmup_ms,
                  **warmup, speedup=None if base is None else base / ms, **counts_since(case.engine, before)))


def saturation(case: Case, emit: Callable[[dict], None]) -> None:
    seeds = list(range(case.args.burst))
    plain, uncached = timed_burst(case, ["off"] * len(seeds), seeds)
    emit(dict(mode="saturation", cache="off", **setting(case.engine, "off"), **plain))
    cached, images = timed_burst(case, [case.cache] * len(seeds), seeds)
    mean, largest = levels(images, uncached)
    emit(dict(mode="saturation", cache=case.cache, **setting(case.engine, case.cache), **cached,
              ratio=cached["images_per_s"] / plain["images_per_s"], mean_abs_diff_levels=mean,
              max_abs_diff_levels=largest))


def half(case: Case, emit: Callable[[dict], None]) -> None:
    seeds = list(range(case.args.burst))
    caches = [case.cache if i % 2 else "off" for i in seeds]
    plain, plain_images = timed_burst(case, caches[0::2], seeds[0::2])
    cached, cached_images = timed_burst(case, caches[1::2], seeds[1::2])
    emit(dict(mode="half_apart", cache="off", **plain))
    emit(dict(mode="half_apart", cache=case.cache, **setting(case.engine, case.cache), **cached))
    mix, images = timed_burst(case, caches, seeds)
    apart_s = plain["wall_s"] + cached["wall_s"]
    _, worst = levels(images[0::2] + images[1::2], plain_images + cached_images)
    emit(dict(mode="half", cache=case.cache, **setting(case.engine, case.cache), **mix, apart_s=apart_s,
              apart_images_per_s=len(seeds) / apart_s, ratio=apart_s / mix["wall_s"], mix_vs_apart_max_levels=worst))


MODES = {"one": one_image, "saturation": saturation, "half": half}


def open_engine(model: str, size: int, a: argparse.Namespace) -> Engine:
    """The case's engine; graph mode off CUDA replays the emulated backend's graphs (the same keys and counters)."""
    cuda = a.device == "cuda"
    buckets = tuple(int(b) for b in a.buckets.split(","))
    graphs = GraphConfig(batch_buckets=buckets, resolutions=((size, size),), prewarm=False,
                         **({} if cuda else {"backend": "emulated"}))
    dtype = a.dtype or (("bf16" if "zimage" in model else "fp16") if cuda else "fp32")
    return Engine(model=model, device=a.device, dtype=dtype, mode=a.engine_mode, graphs=graphs, compile=a.compile,
                  prompt_cache_size=512 if a.prompt_cache else 0)


def run_case(spec: str, a: argparse.Namespace, emit: Callable[[dict], None], deadline: float) -> None:
    """One engine for `spec` (MODEL@SIZE), the asked modes on it in order; each record names the case, its steps and
    guidance (the model's defaults where not given) and the tier."""
    model, size = spec.split("@")
    t = time.perf_counter()
    with open_engine(model, int(size), a) as engine:
        unet = engine.model.family in ("sd", "sdxl")
        case = Case(spec, engine, int(size), a, a.cache or (UNET_CACHE if unet else DIT_CACHE),
                    max(int(b) for b in a.buckets.split(",")))
        probe = case.request("off", 0, "")
        tagged = dict(steps=probe.num_inference_steps, guidance=probe.guidance_scale, compile=a.compile,
                      engine_mode=engine.mode, dtype=str(engine.model.dtype).removeprefix("torch."))
        out = lambda record: emit({"case": spec, **tagged, **record})  # noqa: E731
        out(dict(mode="ready", ready_s=time.perf_counter() - t))
        for mode in a.mode.split(","):
            if time.perf_counter() > deadline:
                out(dict(mode=mode, skipped=f"past --budget-s {a.budget_s}"))
                continue
            t = time.perf_counter()
            try:
                MODES[mode](case, out)
            except Exception as e:  # noqa: BLE001 - the next mode still runs
                out(dict(mode=mode, error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:]))
            out(dict(mode=mode + "_done", wall_s=time.perf_counter() - t))


def summary(record: dict) -> str | None:
    """A result's line for the log's end (None: not a result)."""
    if "case" not in record:
        return None
    head = f"{record['case']:>24} {record['mode']:>11} {record.get('setting', record.get('cache', '')):>42}"
    if "error" in record or "skipped" in record:
        return f"{head} {record.get('error') or record['skipped']}"
    if "steps_run" not in record:
        return None
    counts = (f"  (timed: {record['steps_run']} steps, {record['eager_steps']} eager, {record['captures']} captures, "
              f"{record['compiles']} compiles)")
    if record["mode"] == "one":
        return f"{head} {record['ms']:9.1f} ms  x{record['speedup'] or 0:.2f}{counts}"
    tail = f"  x{record['ratio']:.2f}" if "ratio" in record else ""
    if "mean_abs_diff_levels" in record:
        tail += f"  {record['mean_abs_diff_levels']:.2f} levels to uncached"
    return f"{head} {record['images_per_s']:7.2f} img/s{tail}{counts}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="random:sd15@512,random:sdxl@1024", help="MODEL@SIZE,...")
    p.add_argument("--mode", default="one", help="one, saturation, half (comma-separated; run in this order)")
    p.add_argument("--steps", type=int, default=None, help="default: the model's (random:zimage-base: 50)")
    p.add_argument("--guidance", type=float, default=None, help="default: the model's")
    p.add_argument("--caches", default="off,auto,deepcache:3", help="mode one's settings, `off` first")
    p.add_argument("--cache", default=None, help=f"saturation / half's setting (default {UNET_CACHE} / {DIT_CACHE})")
    p.add_argument("--burst", type=int, default=16, help="requests submitted at once (saturation, half)")
    p.add_argument("--warm-steps", type=int, default=None,
                   help="the warm-up runs' steps (default: --steps; fewer save time, and a timed record's "
                        "`captures` says whether they made every graph it used)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--buckets", default="1,2,4", help="batch buckets (the largest: the rows a step holds)")
    p.add_argument("--compile", action="store_true", help="the compile tier")
    p.add_argument("--prompt-cache", action="store_true",
                   help="keep encoded prompts (mode one's repeats then skip the text encoder, as before this option)")
    p.add_argument("--engine-mode", default="graph", choices=("graph", "eager"))
    p.add_argument("--dtype", default=None, help="default: bf16 for Z-Image, fp16 else on cuda; fp32 on cpu")
    p.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script")
    p.add_argument("--budget-s", type=float, default=None, help="start no mode past this many seconds")
    p.add_argument("--out", default="bench_step_cache.jsonl")
    p.add_argument("--summarize", metavar="JSONL", help="print the summary of a finished (or killed) run's --out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    if a.summarize:
        records = [json.loads(line) for line in open(a.summarize) if line.strip()]
        print("\n".join(filter(None, map(summary, records))))
        return records
    unknown = sorted(set(a.mode.split(",")) - set(MODES))
    if unknown:
        raise SystemExit(f"--mode {unknown[0]!r} is unknown; allowed: {', '.join(MODES)}")
    deadline = time.perf_counter() + (a.budget_s if a.budget_s is not None else float("inf"))
    records: list[dict] = []
    with open(a.out, "w") as f:
        def emit(record: dict) -> None:
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(json.dumps(record), flush=True)

        emit(dict(mode="run", device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                  torch=torch.__version__, args=vars(a)))
        for spec in a.cases.split(","):
            try:
                run_case(spec, a, emit, deadline)
            except Exception as e:  # noqa: BLE001 - the next case still runs
                emit(dict(case=spec, mode="case", error=f"{type(e).__name__}: {e}"[:2000],
                          trace=traceback.format_exc()[-3000:]))
    print("\n".join(filter(None, map(summary, records))))
    return records


if __name__ == "__main__":
    main()
