"""Probe (GPU): how far a request's image moves when it runs in a mixed batch instead of alone, per compile variant,
on the trained `digits` model (fp16, 64x64, buckets 1-16, no adapter slots): the 20 mixed requests of
tests/gpu/test_compile_gpu.py, each alone, then all together (the worst pixel difference per request), then together
again in $PROBE_SCHEDULES (6) other orders with small random gaps between submissions (other bucket paths; the worst
per order). BENCHMARKS.md, sessions 10 and 11, has what it found.

    python3 tools/probe_mixed_fidelity.py                  # every variant, each in its own process, in parallel
    python3 tools/probe_mixed_fidelity.py VARIANT ...      # these, each in its own process, in parallel

Variants: `graph` the graph tier (no compile); `force` the compile tier as shipped (engine.graph_setup: the family's
layout and STEP_OPTIONS); `cudnn` cuDNN attention first (the SD default before session 10); `auto` PyTorch's
attention choice (the default since session 10: the same as `force`); `noforce` without forcing Inductor's layout
optimisation; `casts` plus Inductor's `emulate_precision_casts` (fused kernels round their intermediates to fp16 as
eager code does); `perbucket` static compiles per bucket; `det` Inductor's deterministic mode (no on-device
benchmarking of configs that change numerics) for every compile; `nosplit` Inductor's split reductions off (a
reduction's order then never depends on the batch); `pad1` no bucket 1 (a single image pads to bucket 2, so every
replay runs the one dynamic-batch compile); `inductorgn` the compile tier with the VAE decoder's group norms as
Inductor lowers them (before 25d8dd9: not graphs/group_norm.py's per-channel form). A `_slots` suffix gives the
engine the model's adapter slots (as the GPU tests have). A variant named twice runs twice, in two processes. Prints
a line per run; with $OUT, writes mixed_<index>_<variant>.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

VARIANTS = ("graph", "force", "cudnn", "noforce", "casts", "perbucket", "det", "nosplit", "pad1", "inductorgn")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "gpu"))


def run_variant(variant: str) -> dict:
    import numpy as np
    import torch

    from diffgraph import Engine, GraphConfig
    from diffgraph.config import CompileConfig
    from diffgraph.engine import graph_setup
    from test_compile_gpu import _mix, together  # the GPU test's requests and submission orders

    compile_cfg: CompileConfig | bool = False
    slots = variant.endswith("_slots")
    variant = variant.removesuffix("_slots")
    if variant == "det":
        torch._inductor.config.deterministic = True  # raises where this torch lacks the mode
    if variant == "nosplit":
        torch._inductor.config.split_reductions = False
    if variant != "graph":
        compile_cfg = CompileConfig(cache_dir=tempfile.mkdtemp(prefix=f"mixed-{variant}-"),
                                    per_bucket=variant == "perbucket",
                                    attention=variant if variant in ("auto", "cudnn") else None)
        if variant == "noforce":
            graph_setup.STEP_OPTIONS = {}
        elif variant == "casts":
            graph_setup.STEP_OPTIONS = {**graph_setup.STEP_OPTIONS, "emulate_precision_casts": True}
        elif variant == "inductorgn":
            graph_setup.use_channel_group_norms = lambda module: 0
    buckets = (2, 4, 8, 16) if variant == "pad1" else (1, 2, 4, 8, 16)
    graphs = GraphConfig(batch_buckets=buckets, resolutions=((64, 64),), verify=True)
    device = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a quick check of the probe itself (eager, fp32)
    with Engine("digits", device=device, dtype="fp16" if device != "cpu" else "fp32",
                mode="graph" if device != "cpu" else "eager", graphs=graphs, compile=compile_cfg,
                max_loras=None if slots else 0) as engine:
        requests = _mix(engine)
        alone = [engine.run(r).arrays for r in requests]
        again = engine.run(requests[1]).arrays
        worst = together(engine, requests, alone)
        paths = [together(engine, requests, alone, seed) for seed in range(int(os.environ.get("PROBE_SCHEDULES", "6")))]
        schedules = [max(p) for p in paths]
        verify = {f"{r['kind']}{r['bucket']}": round(r["verify_max_abs"] or 0.0, 5) for r in engine.graph_table()}
        return {"variant": variant + ("_slots" if slots else ""), "worst": max(worst),
                "schedules": [round(w, 4) for w in schedules], "alone twice": float(np.abs(again - alone[1]).max()),
                "per request": [round(w, 4) for w in worst],
                "per request, every order": [round(max(ws), 4) for ws in zip(worst, *paths)],
                "requests": [f"{r.sampler}/{r.num_inference_steps}/cfg{r.guidance_scale}/n{r.num_images}"
                             for r in requests],
                "verify": verify, "compiles": engine.stats.get("compiles"),
                "fallbacks": engine.stats.get("compile_fallbacks")}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        index, variant = sys.argv[2].split(":")
        if os.environ.get("OUT"):  # the compile tier's warnings and failures, with their tracebacks
            import logging
            handler = logging.FileHandler(os.path.join(os.environ["OUT"], f"mixed_{index}_{variant}.log"))
            logging.getLogger("diffgraph.graphs.compiled").addHandler(handler)
            logging.getLogger("diffgraph.graphs.compiled").setLevel(logging.DEBUG)
        result = run_variant(variant)
        print("RESULT " + json.dumps(result), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"mixed_{index}_{variant}.json"), "w") as f:
                json.dump(result, f, indent=1)
        return
    procs = {f"{i}:{v}": subprocess.Popen([sys.executable, "-u", __file__, "--one", f"{i}:{v}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, v in enumerate(sys.argv[1:] or VARIANTS)}
    requests = None
    for v, p in procs.items():
        out, _ = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            print(f"{v}: no result (rc {p.returncode})\n" + out[-3000:], flush=True)
            continue
        r = json.loads(lines[-1][7:])
        requests = r["requests"]
        print(f"{v:14s} worst {r['worst']:.4f}  other schedules {r['schedules']}  alone twice {r['alone twice']:.4f}"
              f"  compiles {r['compiles']}  fallbacks {r['fallbacks']}\n  per request {r['per request']}\n"
              f"  per request, every order {r['per request, every order']}\n"
              f"  verify {r['verify']}", flush=True)
    if requests:
        print("requests: " + json.dumps(requests))


if __name__ == "__main__":
    main()
