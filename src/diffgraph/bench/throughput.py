"""`diffgraph bench throughput`: open-loop Poisson arrivals against the engine, all batching modes.

A seeded trace of requests (default mix: 20/30/50 steps, two resolutions, samplers euler and
dpmpp_2m) arrives at a fixed rate; for each batching mode (step, request, off) and each rate the
same trace is replayed in process. Reported: throughput (images/s over the arrival window and drain),
p50/p90/p99 latency, mean live rows per step, and the GPU idle time between consecutive steps (the
host time per step that does not overlap GPU work, from CUDA events). The compute-bound rate is
measured separately: the largest bucket, every row full, steady state, for the same mix.

`--edit-fraction F`: a share F of the trace's requests are edits (half image-to-image, half inpainting, strength
uniform in 0.5..1.0, from a fixed random image); each run is then made twice on the same arrival times, without
the edits and with them, and the ratios of mean live rows per step and of the window's work are printed (edits
must not break batches), with the VAE encoder's ms per replay (an edit's one extra replay).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cli_flags import (add_checkpoint_arguments, add_compile_mode_argument, add_quantize_arguments,
                         checkpoint_options, compile_from_args, quantize_from_args)

MODES = ("step", "request", "off")


@dataclass(frozen=True)
class TraceItem:
    at: float
    steps: int
    size: tuple[int, int]  # (height, width)
    sampler: str
    seed: int
    edit: str | None = None   # "img2img" | "inpaint" | None (text-to-image)
    strength: float = 1.0
    lora: int | None = None   # which of the benchmark's random LoRA adapters the request uses (None: none)


def make_trace(rate: float, duration: float, seed: int, steps=(20, 30, 50), sizes=((512, 512), (768, 512)),
               samplers=("euler", "dpmpp_2m"), edit_fraction: float = 0.0) -> list[TraceItem]:
    """Poisson arrivals; with edit_fraction > 0 a second generator marks edits, so the arrival times, sizes,
    steps, samplers and seeds are those of the trace without edits."""
    rng = np.random.default_rng(seed)
    edits = np.random.default_rng([seed, 1])
    t, items = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            return items
        item = TraceItem(t, int(rng.choice(steps)), tuple(sizes[rng.integers(len(sizes))]),
                         str(rng.choice(samplers)), int(rng.integers(2**31)))
        if edit_fraction > 0 and edits.random() < edit_fraction:
            kind = "inpaint" if edits.random() < 0.5 else "img2img"
            item = TraceItem(item.at, item.steps, item.size, item.sampler, item.seed, kind,
                             float(edits.uniform(0.5, 1.0)))
        items.append(item)


def edit_inputs(size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random image of `size` (height, width) and a mask of its central half (white = repaint)."""
    h, w = size
    image = np.random.default_rng(h * 10007 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    mask = np.zeros((h, w), np.uint8)
    mask[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = 255
    return image, mask


def with_loras(trace: list[TraceItem], k: int, seed: int) -> list[TraceItem]:
    """The same trace, each request using one of k adapters (seeded, uniform): the second seed's scenario."""
    rng = np.random.default_rng([seed, 2])
    return [dataclasses.replace(i, lora=int(rng.integers(k))) for i in trace]


def random_adapter(engine, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A random rank-`rank` LoRA (diffusers/PEFT keys) on every UNet layer the engine has a side path for (the
    attention and feed-forward projections), made here rather than carried (an SDXL one is tens of MB)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for module, slot in engine.runner.loras.banks["unet"].layers.items():
        n_in, n_out, k = slot.n_in, slot.b.shape[2], slot.kernel  # k: a convolution's kernel (with --lora-conv)
        down = (rank, n_in) if k is None else (rank, n_in, *k)
        state[f"unet.{module}.lora_A.weight"] = torch.randn(down, generator=gen) / (slot.a.shape[2] ** 0.5)
        state[f"unet.{module}.lora_B.weight"] = torch.randn((n_out, rank) + (() if k is None else (1, 1)),
                                                            generator=gen) * 0.01
    return state


def captures(engine) -> int:
    """Graph captures since start-up (on first use, or after an invalidation) and invalidations, over every key:
    anything a run makes the engine capture again."""
    return sum(r["on_demand"] + r["invalidations"] for r in engine.graph_table())


def without_edits(trace: list[TraceItem]) -> list[TraceItem]:
    return [TraceItem(i.at, i.steps, i.size, i.sampler, i.seed) for i in trace]


def size_name(key: tuple[int, int]) -> str:
    """(height, width) -> 'WxH', the JSON key of a resolution."""
    return f"{key[1]}x{key[0]}"


def work_fraction(steps: list[tuple[float, tuple[int, int], int]], row_step_ms: dict[tuple[int, int], float],
                  lo: float, hi: float) -> float:
    """The share of the window [lo, hi] (seconds) that the denoising work done in it would take at the full
    bucket: every step's live rows times its resolution's per-row cost at the full bucket, over the window.
    Times the steps-only compute-bound rate, it is the window's throughput; unlike counting completions it
    does not depend on when waves of rows happen to finish."""
    work_ms = sum(rows * row_step_ms[key] for t, key, rows in steps if lo <= t <= hi)
    return work_ms / ((hi - lo) * 1e3) if hi > lo else float("nan")


def replay(engine, trace: list[TraceItem], timeout: float,
           row_step_ms: dict[tuple[int, int], float] | None = None) -> dict[str, Any]:
    """Submits the trace open-loop (arrivals do not wait for completions) and collects latencies. With
    `row_step_ms` (per resolution, the full bucket's step ms / rows), also the work fraction of the window."""
    steps_done: list[tuple[float, tuple[int, int], int]] = []

    def on_step(plan, seconds):
        steps_done.append((time.perf_counter(), plan.key, plan.n_rows))
    engine.step_listeners.append(on_step)
    try:
        return _replay(engine, trace, timeout, row_step_ms, steps_done)
    finally:
        engine.step_listeners.remove(on_step)


class _Completions:
    """What the requests' done-callbacks record: latencies, completion times with their image counts, errors, and
    how many callbacks ran (they run after result() waiters wake)."""

    def __init__(self):
        self.lat: list[float] = []
        self.done_at: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.called: list[int] = []
        self.lock = threading.Lock()

    def callback(self, sent: float):
        def done(f):
            with self.lock:
                self.called.append(1)
                if f.exception() is None:
                    now = time.perf_counter()
                    self.lat.append(now - sent)
                    self.done_at.append((now, f.result().request.num_images))
                else:
                    self.errors.append(type(f.exception()).__name__)
        return done


def _trace_request(engine, item: TraceItem):
    """The engine request of one trace item, with its edit inputs and its adapter."""
    edit = {}
    if item.edit is not None:
        image, mask = edit_inputs(item.size)
        edit = {"image": image, "strength": item.strength, **({"mask_image": mask} if item.edit == "inpaint" else {})}
    loras = [(f"bench/{item.lora}", 1.0)] if item.lora is not None else []
    return engine.make_request("a photo of a cat", width=item.size[1], height=item.size[0],
                               num_inference_steps=item.steps, sampler=item.sampler, seed=item.seed, loras=loras,
                               **edit)


def _submit_trace(engine, trace: list[TraceItem], t0: float, completions: _Completions) -> list:
    """Submits each item at its arrival time after t0; returns the (future, request) of those the engine took."""
    futures = []
    for item in trace:
        delay = t0 + item.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        req = _trace_request(engine, item)
        try:
            fut = engine.submit(req)
        except Exception as e:
            completions.errors.append(type(e).__name__)
            continue
        fut.add_done_callback(completions.callback(sent))
        futures.append((fut, req))
    return futures


def _abort_past_deadline(engine, futures: list, deadline: float) -> list:
    """Waits for every request until the deadline and aborts those still running there; returns their futures."""
    aborted = []
    for fut, req in futures:
        try:
            fut.result(timeout=max(0.0, deadline - time.perf_counter()))
        except Exception:
            if not fut.done():
                aborted.append(fut)
                engine.abort(req.request_id)
    return aborted


def _drain(futures: list, aborted: list, completions: _Completions) -> int:
    """Waits for the aborted requests to stop and the last callbacks to run; returns how many did not finish."""
    for fut, _ in futures:  # aborted ones finish at the next boundary
        try:
            fut.result(timeout=60)
        except Exception:
            pass
    # a request aborted at the deadline may still have finished at that step boundary: it counts as done
    unfinished = sum(1 for fut in aborted if not fut.done() or fut.exception() is not None)
    settled = sum(1 for fut, _ in futures if fut.done())
    wait_until = time.perf_counter() + 5.0
    while len(completions.called) < settled and time.perf_counter() < wait_until:  # the last callbacks may still run
        time.sleep(0.001)
    return unfinished


def _steady_rate(done_at: list[tuple[float, int]]) -> float:
    """Images/s between the 10th and 90th percentile completions (sorted): no ramp-up, no drain."""
    if len(done_at) < 10:
        return float("nan")
    lo, hi = int(0.1 * len(done_at)), int(0.9 * len(done_at))
    return sum(n for _, n in done_at[lo + 1:hi + 1]) / (done_at[hi][0] - done_at[lo][0])


def _replay(engine, trace, timeout, row_step_ms, steps_done) -> dict[str, Any]:
    completions = _Completions()
    engine.core.step_events = []
    rows0, steps0 = engine.stats["rows_stepped"], engine.stats["steps"]
    t0 = time.perf_counter()
    futures = _submit_trace(engine, trace, t0, completions)
    aborted = _abort_past_deadline(engine, futures, t0 + trace[-1].at + timeout)
    elapsed = time.perf_counter() - t0
    unfinished = _drain(futures, aborted, completions)
    lat, done_at, errors = completions.lat, completions.done_at, completions.errors
    events = engine.core.step_events
    engine.core.step_events = None
    if engine.runner.cuda:
        torch.cuda.synchronize()
    # GPU idle between consecutive steps while work was waiting (not when the engine had nothing to do)
    gaps = [max(0.0, prev[1].elapsed_time(cur[0])) for prev, cur in zip(events, events[1:]) if not cur[2]]
    steps = engine.stats["steps"] - steps0
    lat_ms = np.array(sorted(lat)) * 1e3
    done_at.sort()
    steady = _steady_rate(done_at)
    # images/s over the last two thirds of the arrival window (at saturation the queue never empties there)
    lo_t, hi_t = t0 + trace[-1].at / 3, t0 + trace[-1].at
    window = sum(n for t, n in done_at if lo_t <= t <= hi_t) / max(1e-9, hi_t - lo_t)
    work = work_fraction(steps_done, row_step_ms, lo_t, hi_t) if row_step_ms else float("nan")
    pct = (lambda q: float(np.percentile(lat_ms, q))) if len(lat_ms) else (lambda q: float("nan"))
    return {"requests": len(trace), "completed": len(lat), "unfinished": unfinished, "errors": errors[:5],
            "images_per_s": len(lat) / elapsed, "steady_images_per_s": steady,
            "window_images_per_s": window, "window_work_fraction": work, "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "mean_live_rows": (engine.stats["rows_stepped"] - rows0) / max(1, steps),
            "gpu_idle_between_steps_ms": float(np.mean(gaps)) if gaps else float("nan"),
            "gpu_idle_p99_ms": float(np.percentile(gaps, 99)) if gaps else float("nan")}


def encoder_ms(engine, sizes, iters: int = 20) -> dict[str, dict[int, float]]:
    """Per size, the VAE encoder's ms per call of 1 and 2 images (graph replays where graphed), CUDA events."""
    out: dict[str, dict[int, float]] = {}
    for key in sizes:
        out[size_name(key)] = {}
        for n in (1, 2):
            pixels = torch.rand((n, 3, *key)) * 2 - 1
            engine.runner.encode_pixels(key, pixels)  # warm (captures on first use where needed)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                engine.runner.encode_pixels(key, pixels)
            end.record()
            torch.cuda.synchronize()
            out[size_name(key)][n] = round(start.elapsed_time(end) / iters, 3)
    return out


def compute_bound_rate(engine, sizes, steps=(20, 30, 50), iters: int = 30) -> dict[str, Any]:
    """Images/s with the largest bucket full at every step, for the mix's mean steps and sizes: of the
    denoising steps alone, and with every image also decoded in full VAE batches (an image is not done
    before its decode: that is the rate an engine can at best deliver)."""

    w = engine.runner
    b = w.max_rows // 2  # classifier-free guided rows: two denoiser rows each, the largest bucket full
    step_ms, decode_ms = {}, {}
    for key in sizes:
        request = engine.make_request("x", width=key[1], height=key[0], num_inference_steps=20, sampler="euler",
                                      guidance_scale=7.5)
        buf = w.buffers(key)
        buf.x[:b] = 0
        coefs = np.repeat(w.request_plan(request).coefs[5][None], b, 0)
        rows = [(i, 1, 2) for i in range(b)]
        for _ in range(3):
            w.step(key, coefs, rows, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            w.step(key, coefs, rows, None)
        torch.cuda.synchronize()
        name = size_name(key)
        step_ms[name] = (time.perf_counter() - t0) / iters * 1e3
        vb = max(w.decode_buckets)
        latents = buf.x[:vb].clone()
        for _ in range(2):
            w.decode(key, latents)
        t0 = time.perf_counter()
        for _ in range(5):
            w.decode(key, latents)
        decode_ms[name] = (time.perf_counter() - t0) / 5 / latents.shape[0] * 1e3
    mean_steps = float(np.mean(steps))
    steps_only = np.mean([ms / b * mean_steps for ms in step_ms.values()])
    with_decode = np.mean([step_ms[k] / b * mean_steps + decode_ms[k] for k in step_ms])
    return {"images_per_s": 1e3 / with_decode, "steps_only_images_per_s": 1e3 / steps_only,
            "full_bucket_step_ms": step_ms, "decode_ms_per_image": decode_ms}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffgraph bench throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--sizes", default="512x512,512x768", help="WxH list (default: %(default)s)")
    p.add_argument("--steps", default="20,30,50")
    p.add_argument("--samplers", default="euler,dpmpp_2m")
    p.add_argument("--rates", default="", help="arrival rates in requests/s; default: 0.5x, 0.65x and 0.8x the "
                   "compute-bound rate (latency under load) and 3x (saturation)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    p.add_argument("--modes", default=",".join(MODES),
                   help="batching modes; step:FILL/HOLD_MS runs step mode with that bucket growth policy "
                        "(e.g. step:0/0 turns it off; default step uses the engine defaults)")
    p.add_argument("--max-wait-ms", type=float, default=20.0,
                   help="request mode's batching window (the seed design: 5-20 ms; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--edit-fraction", type=float, default=0.0, metavar="F",
                   help="share of the requests that are edits (image-to-image and inpainting, strength 0.5-1.0); "
                        "each run is then made without and with them (default: 0)")
    p.add_argument("--loras", type=int, default=0, metavar="K",
                   help="each request uses one of K random adapters (rank --lora-rank on the attention and feed-forward "
                        "projections); each run is then made without and with them (default: 0)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=None, help="adapter slots with --loras (default: 8)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the slots' rank with --loras (default: 64)")
    p.add_argument("--guidance-mix", type=int, default=0, metavar="N",
                   help="only the guidance scenarios at saturation (bench/guidance_mix.py): bursts of N requests")
    p.add_argument("--prompt-mix", type=int, default=0, metavar="N",
                   help="only the prompt-length scenarios (bench/prompt_mix.py): step replays at 1, 3 and 6 prompt "
                        "windows, bursts of N requests with 30%% long AUTOMATIC1111 prompts beside all-short ones")
    p.add_argument("--sampler-mix", type=int, default=0, metavar="N",
                   help="only the sampler scenarios (bench/sampler_mix.py): bursts of N requests, every sampler mixed "
                        "against all-euler of the same evaluations, and 20-step heun against 39-step euler")
    p.add_argument("--preview-cost", type=int, default=0, metavar="N",
                   help="only the live-preview scenarios (bench/preview_cost.py): bursts of N requests with and "
                        "without previews")
    p.add_argument("--compile", action="store_true", help="the compile tier (Engine(compile=True))")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="the compile tier's cache folder; with --tiers each tier's is DIR/<tier>, kept, so a start "
                        "there is warm once compiled (default: a fresh folder, cold starts)")
    add_compile_mode_argument(p)
    add_quantize_arguments(p)
    add_checkpoint_arguments(p)
    p.add_argument("--tiers", default=None, metavar="T1,T2,...",
                   help="only the tiers side by side (bench/tiers.py: graph, compile, fp8, autotune, autotune-fp8): "
                        "images/s of a burst at saturation, the step's share of the dense peak, start seconds")
    p.add_argument("--burst", type=int, default=64, metavar="N", help="with --tiers: requests per burst")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="with --tiers: the GPU's dense 16-bit peak (default: its data sheet's, by device name)")
    p.add_argument("--json", default="bench_throughput.json")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw latency percentiles and images/s against the arrival rate, per mode (matplotlib)")
    return p


def _run_tiers(args, tiers, size, load) -> int:
    """`--tiers`: the tiers side by side (bench/tiers.py), printed and written to --json."""
    from . import tiers as tier_bench
    report = tier_bench.run(args.model, tiers, size, args.burst, peak=args.peak_tflops,
                            cache_root=args.compile_cache, load=load)
    tier_bench.print_report(report)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


def _run_scenario(engine, args, size) -> int:
    """`--guidance-mix`, `--prompt-mix`, `--sampler-mix` or `--preview-cost`: the first one given, on `engine`."""
    from . import guidance_mix, preview_cost, prompt_mix, sampler_mix
    bench, n = next((b, k) for b, k in ((guidance_mix, args.guidance_mix), (prompt_mix, args.prompt_mix),
                                         (sampler_mix, args.sampler_mix), (preview_cost, args.preview_cost)) if k)
    report = {"model": args.model, "compile": args.compile, "quantize": args.quantize or "none",
              "env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}}
    report.update(bench.run(engine, n, size))
    engine.close()
    bench.print_report(report)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


def _compute_bound_report(engine, args, sizes, steps, samplers) -> tuple[dict[str, Any], list[float]]:
    """The report's head, with the compute-bound rate of the mix (printed), and the arrival rates to run: --rates,
    or fractions of the compute-bound rate."""
    cb = compute_bound_rate(engine, sizes, steps)
    rate_cb = cb["images_per_s"]
    rates = [float(r) for r in args.rates.split(",") if r] or [round(f * rate_cb, 2) for f in (0.5, 0.65, 0.8, 3.0)]
    report: dict[str, Any] = {"model": args.model, "quantize": args.quantize or "none", "sizes": args.sizes,
                              "steps": steps, "samplers": samplers, "compute_bound_images_per_s": rate_cb,
                              "compute_bound": cb, "runs": []}
    print(f"compute-bound rate {rate_cb:.2f} images/s with decode, {cb['steps_only_images_per_s']:.2f} steps only "
          f"(bucket {engine.runner.max_rows} step ms: {cb['full_bucket_step_ms']}, decode ms per image: "
          f"{cb['decode_ms_per_image']})", flush=True)
    return report, rates


def _trace_variants(trace: list[TraceItem], args) -> list[tuple[str, list[TraceItem]]]:
    """(name suffix, trace) of each run of one rate: the trace alone, or without and with its edits or adapters."""
    variants = [("", trace)] if not args.edit_fraction else [("", without_edits(trace)), ("+edits", trace)]
    if args.loras:
        variants = [("", trace), (f"+loras{args.loras}", with_loras(trace, args.loras, args.seed))]
    return variants


def _set_batching(engine, mode: str, max_wait_ms: float, defaults) -> None:
    """Reconfigures the engine for one --modes entry (`step`, `request`, `off`, or `step:FILL/HOLD_MS`)."""
    batching, _, grow = mode.partition(":")
    extra = {}
    if grow:
        fill, hold = grow.split("/")
        extra = {"grow_fill": float(fill), "grow_hold_ms": float(hold)}
    engine.reconfigure(batching=batching, max_wait_ms=max_wait_ms if batching == "request" else 0.0,
                       **{"grow_fill": defaults.grow_fill, "grow_hold_ms": defaults.grow_hold_ms, **extra})


def _replay_rates(engine, args, sizes, steps, samplers, rates, report: dict[str, Any]) -> None:
    """Every rate's trace replayed in every mode (and variant), each run printed and added to report["runs"]."""
    cb = report["compute_bound"]
    defaults = engine.scheduler.config
    row_step_ms = {key: cb["full_bucket_step_ms"][size_name(key)] / engine.runner.max_rows for key in sizes}
    for rate in rates:
        trace = make_trace(rate, args.duration, args.seed, steps, sizes, samplers, args.edit_fraction)
        variants = _trace_variants(trace, args)
        for (suffix, run_trace), mode in ((v, m) for m in args.modes.split(",") for v in variants):
            _set_batching(engine, mode, args.max_wait_ms, defaults)
            before = captures(engine)
            r = replay(engine, run_trace, timeout=args.duration, row_step_ms=row_step_ms)
            r.update(mode=mode + suffix, rate=rate, edits=sum(i.edit is not None for i in run_trace),
                     captures_during_run=captures(engine) - before,
                     lora_loads=engine.stats["lora_loads"], adapters=len({i.lora for i in run_trace} - {None}))
            report["runs"].append(r)
            mode = mode + suffix
            print(f"rate {rate:6.2f}/s {mode:14s} {r['images_per_s']:6.2f} img/s (steady {r['steady_images_per_s']:5.2f}, window {r['window_images_per_s']:5.2f}, work {r['window_work_fraction'] * cb['steps_only_images_per_s']:5.2f})  p50 {r['p50_ms']:8.0f} ms  "
                  f"p90 {r['p90_ms']:8.0f}  p99 {r['p99_ms']:8.0f}  live rows {r['mean_live_rows']:5.2f}  "
                  f"GPU idle/step {r['gpu_idle_between_steps_ms']:.3f} ms  done {r['completed']}/{r['requests']}",
                  flush=True)


def _print_edit_ratios(by: dict, args) -> None:
    """Each run with edits against the same arrivals without them."""
    print(f"with edits ({args.edit_fraction:g} of the requests) vs text-to-image only, same arrivals (targets: live "
          "rows >= 0.95x, window work >= 0.9x):")
    for (rate, mode), r in by.items():
        base = by.get((rate, mode.removesuffix("+edits"))) if mode.endswith("+edits") else None
        if base:
            print(f"  rate {rate:6.2f}/s {mode:20s}: live rows {r['mean_live_rows']:.2f} / "
                  f"{base['mean_live_rows']:.2f} = {r['mean_live_rows'] / base['mean_live_rows']:.3f}x  window work "
                  f"{r['window_work_fraction']:.3f} / {base['window_work_fraction']:.3f} = "
                  f"{r['window_work_fraction'] / base['window_work_fraction']:.3f}x  ({r['edits']} edits)")


def _print_lora_ratios(by: dict, args) -> None:
    """Each run with adapters against the same arrivals without them."""
    print(f"with {args.loras} adapters (rank {args.lora_rank}, {args.max_loras or 8} slots of rank "
          f"{args.max_lora_rank}) vs none, same arrivals (targets: images/s >= 0.85x at saturation, 0 captures):")
    for (rate, mode), r in by.items():
        base = by.get((rate, mode.split("+loras")[0])) if "+loras" in mode else None
        if base:
            print(f"  rate {rate:6.2f}/s {mode:20s}: {r['images_per_s']:.2f} / {base['images_per_s']:.2f} images/s = "
                  f"{r['images_per_s'] / base['images_per_s']:.3f}x  window work {r['window_work_fraction']:.3f} / "
                  f"{base['window_work_fraction']:.3f}  captures during the run {r['captures_during_run']}  "
                  f"requests {r['requests']}, slot loads so far {r['lora_loads']}")


def _print_step_vs_request(by: dict, args, rates, report: dict[str, Any]) -> None:
    """Per rate, each step mode's latency and throughput against request mode's and the compute-bound rate."""
    cb, rate_cb = report["compute_bound"], report["compute_bound_images_per_s"]
    print("step vs request mode, per arrival rate (the issue's targets: p99 <= 0.6x, images/s >= request mode's):")
    for rate in rates:
        rq = by.get((rate, "request"))
        for mode in (m for m in args.modes.split(",") if m.startswith("step")):
            st = by.get((rate, mode))
            if st and rq:
                print(f"  rate {rate:6.2f}/s {mode:14s}: p99 {st['p99_ms']:8.0f} / {rq['p99_ms']:8.0f} ms = "
                      f"{st['p99_ms'] / rq['p99_ms']:.2f}x  images/s {st['images_per_s']:.2f} vs {rq['images_per_s']:.2f}  "
                      f"steady {st['steady_images_per_s'] / rate_cb:.2f} (window {st['window_images_per_s'] / rate_cb:.2f}) "
                      f"of compute-bound with decode, {st['steady_images_per_s'] / cb['steps_only_images_per_s']:.2f} "
                      f"(window {st['window_images_per_s'] / cb['steps_only_images_per_s']:.2f}) steps only; "
                      f"work done in the window: {st['window_work_fraction'] * cb['steps_only_images_per_s'] / rate_cb:.2f} "
                      f"of compute-bound with decode ({st['window_work_fraction']:.2f} of the GPU's time at full buckets)")


def _write_report(report: dict[str, Any], args, rates) -> None:
    """The comparisons printed, the report written to --json, and with --plot its figure drawn."""
    by = {(r["rate"], r["mode"]): r for r in report["runs"]}
    if args.edit_fraction:
        _print_edit_ratios(by, args)
    if args.loras:
        _print_lora_ratios(by, args)
    _print_step_vs_request(by, args, rates, report)
    report["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    if args.plot:
        from .plots import plot_runs
        plot_runs(report["runs"], args.plot, f"bench throughput: {args.model}, {report['env']['gpu']}")
        print(f"plot: {args.plot}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        quantize, compile = quantize_from_args(args), compile_from_args(args, args.compile_cache)
        load = checkpoint_options(args)
        if args.tiers is not None:
            from . import tiers as tier_bench
            tiers = tier_bench.parse_tiers(args.tiers)
            if args.compile or args.quantize:
                raise ValueError("--tiers chooses each tier's compile and quantize settings: leave out --compile, "
                                 "--compile-mode and --quantize")
    except ValueError as e:
        print(f"diffgraph: error: {e}")
        return 2
    if not torch.cuda.is_available():
        print("diffgraph: error: bench throughput needs a CUDA device")
        return 2
    from ..config import GraphConfig, parse_resolutions
    from ..engine.engine import Engine

    sizes = parse_resolutions(args.sizes)
    if args.tiers is not None:
        return _run_tiers(args, tiers, sizes[0], load)
    steps = tuple(int(s) for s in args.steps.split(","))
    samplers = tuple(args.samplers.split(","))
    lora_args = dict(max_loras=args.max_loras or 8, max_lora_rank=args.max_lora_rank) if args.loras else {}
    compile_args = {"compile": compile} if compile else {}
    engine = Engine(args.model, device="cuda", mode="graph", graphs=GraphConfig(resolutions=sizes), max_queue=100000,
                    quantize=quantize, load=load, **lora_args, **compile_args)
    if args.guidance_mix or args.prompt_mix or args.sampler_mix or args.preview_cost:
        return _run_scenario(engine, args, sizes[0])
    for i in range(args.loras):
        engine.add_lora(f"bench/{i}", random_adapter(engine, args.lora_rank, i))
    report, rates = _compute_bound_report(engine, args, sizes, steps, samplers)
    # warm every graph the mix touches before timing
    for size in sizes:
        engine.generate("warm", width=size[1], height=size[0], num_inference_steps=2)
    if not 0 <= args.edit_fraction <= 1:
        print("diffgraph: error: --edit-fraction must be in [0, 1]")
        return 2
    if args.edit_fraction:
        report["encoder_ms"] = encoder_ms(engine, sizes)
        print(f"VAE encoder replay ms (bucket 1 = image-to-image, 2 = inpainting): {report['encoder_ms']}", flush=True)
    _replay_rates(engine, args, sizes, steps, samplers, rates, report)
    engine.close()
    _write_report(report, args, rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
