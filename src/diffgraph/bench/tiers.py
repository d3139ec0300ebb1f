"""`diffgraph bench throughput --tiers graph,compile,fp8,autotune`: each tier's images/s at saturation and its step's
share of the GPU's dense 16-bit peak, side by side in one run.

Tiers (TIERS): `graph` (CUDA graphs of the eager code), `compile` (Inductor's code captured in the same graphs), `fp8`
(the compile tier with `--quantize fp8`), `autotune` (the compile tier in Inductor's mode max-autotune-no-cudagraphs),
`autotune-fp8`. Each tier is an engine of its own over its own copy of the model, one at a time (the one before is
closed first), and every resolution and bucket is prewarmed at its start, timed (`start_s`: loading, compiling,
capturing; the compile tiers each over an empty cache folder of their own: a cold start; with `--compile-cache DIR`
each tier's folder is DIR/<tier>, kept, so an autotuned compile longer than one call resumes in the next and a later
run times a warm start).

Per tier: a burst of `--burst` requests (20 steps, CFG 7.5, seeds 0..N-1) submitted at once, timed to the last image
(decode included), best of `--repeats`; one replay of the step graph at the largest bucket; and one image alone (20
steps, CFG 7.5), submit to result, median of 3 (`one_image_ms`: the one-image target per tier). The step's
FLOPs are counted once per family and resolution (not per tier: fp8 changes how a matmul runs, not how much it
computes), with torch's FlopCounterMode over one eager step of a 16-bit engine at that bucket (matmuls,
convolutions, attention); `peak_share` = FLOPs / replay time / the GPU's dense fp16 tensor peak (PEAK_TFLOPS by
device name, or `--peak-tflops`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from ..config import GraphConfig
from .guidance_mix import burst
from .latency import step_replay_ms

TIERS = ("graph", "compile", "fp8", "autotune", "autotune-fp8")
# dense fp16 / bf16 tensor-core TFLOPS (no sparsity) from the vendors' data sheets, by a part of the device name;
# the first match wins (an H100 without "PCIe" or "NVL" in its name is taken as the SXM part)
PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("A100", 312.0),
               ("L40S", 362.1), ("L4", 121.0), ("RTX 4090", 165.2), ("A10", 125.0))


def parse_tiers(text: str) -> tuple[str, ...]:
    """'graph,compile,...' -> the tiers; an unknown one is a ValueError naming the choices."""
    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise ValueError(f"--tiers {text!r}: unknown tier(s) {', '.join(bad) or '(none given)'}; choose from "
                         f"{', '.join(TIERS)}")
    return tiers


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The dense 16-bit tensor peak of a device by its name (None: not in PEAK_TFLOPS; give --peak-tflops)."""
    if override:
        return override
    return next((tflops for part, tflops in PEAK_TFLOPS if part in device_name), None)


def engine_options(tier: str, cache_root: str) -> dict[str, Any]:
    """`Engine(...)` keywords of a tier: its compile config (a cache folder of its own) and quantize setting."""
    from ..config import CompileConfig
    if tier == "graph":
        return {}
    mode = "max-autotune-no-cudagraphs" if tier.startswith("autotune") else "default"
    return {"compile": CompileConfig(cache_dir=f"{cache_root}/{tier}", mode=mode),
            "quantize": "fp8" if tier.endswith("fp8") else None}


def step_flops(model: str, size: tuple[int, int], rows: int, device: str = "cuda", **engine_kwargs: Any) -> float:
    """The FLOPs of one denoising step over `rows` denoiser rows (rows / 2 images with CFG) at (height, width) `size`,
    from FlopCounterMode over an eager step of a 16-bit engine of `model`."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..engine.engine import Engine
    with Engine(model, device=device, mode="eager", graphs=GraphConfig(resolutions=(size,), prewarm=False),
                **engine_kwargs) as engine:
        w = engine.runner
        request = engine.make_request("x", width=size[1], height=size[0], num_inference_steps=20, guidance_scale=7.5)
        images = rows // 2
        w.buffers(size).x[:images] = 0
        coefs = np.repeat(w.request_plan(request).coefs[5][None], images, 0)
        live = [(i, 1, 2) for i in range(images)]
        w.step(size, coefs, live, None)  # warm (lazy buffers, cuDNN's choices) outside the count
        counter = FlopCounterMode(display=False)
        with counter:
            w.step(size, coefs, live, None)
        return float(counter.get_total_flops())


def run_tier(model: str, tier: str, size: tuple[int, int], n: int, repeats: int, cache_root: str,
             graphs: GraphConfig | None = None, **engine_kwargs: Any) -> dict[str, Any]:
    """One tier's figures: start seconds, the burst's images/s (best of `repeats`), the top bucket's step replay, one
    image alone. `graphs`: the engine's graph config (default: CUDA graphs of `size`, every bucket)."""
    from ..engine.engine import Engine
    t0 = time.perf_counter()
    engine = Engine(model, **{"device": "cuda", **engine_kwargs}, mode="graph", max_queue=100000,
                    graphs=graphs or GraphConfig(resolutions=(size,)), **engine_options(tier, cache_root))
    try:
        start_s = time.perf_counter() - t0
        h, w = size

        def requests(count: int = n) -> list:
            return [engine.make_request(f"a photo of a fox, number {i}", num_inference_steps=20, seed=i, width=w,
                                        height=h, guidance_scale=7.5) for i in range(count)]
        burst(engine, requests()[:max(2, n // 8)])  # warm: the buckets a burst walks
        runs = [burst(engine, requests()) for _ in range(repeats)]
        best = max(runs, key=lambda r: r["images_per_s"])
        alone = []
        for request in requests(3):
            t1 = time.perf_counter()
            engine.run(request)
            alone.append((time.perf_counter() - t1) * 1e3)
        top = engine.runner.graph_config.max_bucket
        stats = engine.stats
        return {"tier": tier, "start_s": start_s, "images_per_s": best["images_per_s"], "seconds": best["seconds"],
                "bucket": top, "step_ms": step_replay_ms(engine, size, top, repeats=3),
                "one_image_ms": statistics.median(alone),
                "compiles": stats.get("compiles", 0), "compile_fallbacks": stats.get("compile_fallbacks", 0)}
    finally:
        engine.close()


def run(model: str, tiers: tuple[str, ...], size: tuple[int, int], n: int, repeats: int = 2,
        peak: float | None = None, cache_root: str | None = None, **engine_kwargs: Any) -> dict[str, Any]:
    """Every tier side by side (the FLOPs counted first, once); each tier's figures are printed as it ends (a long
    cold compile of a later tier leaves the earlier ones on the screen). `cache_root`: the tiers' compile caches
    (kept; None: a fresh temporary folder, every start cold)."""
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, peak)
    out: dict[str, Any] = {"model": model, "size": f"{size[1]}x{size[0]}", "burst": n, "device": name,
                           "peak_tflops": peak, "torch": torch.__version__, "tiers": []}
    out["cache"] = "cold" if cache_root is None else cache_root
    load = engine_kwargs.get("load")
    out["vae_upcast"] = None if load is None else load.vae_upcast  # None: the VAE config's (SDXL's: fp32 decode)
    cache_root = cache_root or tempfile.mkdtemp(prefix="diffgraph-tiers-")
    flops: float | None = None
    for tier in tiers:
        r = run_tier(model, tier, size, n, repeats, cache_root, **engine_kwargs)
        if flops is None:  # the bucket is the engines' own (every tier has the same graph config)
            flops = step_flops(model, size, r["bucket"], **engine_kwargs)
            out["step_tflop"] = flops / 1e12
        r["peak_share"] = (flops / (r["step_ms"] / 1e3) / (peak * 1e12)
                           if peak and r["step_ms"] else None)
        out["tiers"].append(r)
        print_tier(r, out["tiers"][0])
    return out


def print_tier(r: dict[str, Any], first: dict[str, Any]) -> None:
    share = f"{r['peak_share']:.1%}" if r["peak_share"] is not None else "n/a"
    print(f"  {r['tier']:13s} {r['images_per_s']:7.2f} images/s ({r['images_per_s'] / first['images_per_s']:.3f}x)  "
          f"bucket-{r['bucket']} step {r['step_ms'] or float('nan'):7.2f} ms  {share:>6s} of the dense peak  "
          f"start {r['start_s']:6.0f} s  compiles {r['compiles']}, fallbacks {r['compile_fallbacks']}  "
          f"one image {r['one_image_ms']:7.1f} ms", flush=True)


def print_report(report: dict[str, Any]) -> None:
    print(f"tiers side by side: {report['model']} {report['size']}, bursts of {report['burst']} 20-step CFG requests, "
          f"{report['device']} (dense peak {report['peak_tflops'] or 'unknown'} TFLOPS), one step "
          f"{report.get('step_tflop', float('nan')):.2f} TFLOP at the largest bucket; compile caches "
          f"{report.get('cache', 'cold')}; VAE upcast {report.get('vae_upcast')}")
    for r in report["tiers"]:
        print_tier(r, report["tiers"][0])
