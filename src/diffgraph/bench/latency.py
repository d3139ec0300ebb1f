"""`diffgraph bench latency`: one process, the same weights and seeds for every contender.

Contenders: diffusers' pipeline eager; diffusers with torch.compile(unet, mode="reduce-overhead");
diffgraph eager; diffgraph graph; diffgraph compile (the compile tier: its cold start with an empty cache folder in
this process, then twice in fresh processes: on that folder, and on a copy of it elsewhere). For each
model/resolution and image count it reports per-step ms (from end-to-end runs at two step counts:
(t(N) - t(N/2)) / (N/2), so fixed costs cancel), end-to-end ms (prompt to decoded pixels), ratios to diffusers eager, cold start (load to ready; first
call of the compiled contender), graph pool memory and the summed GPU kernel time of one step
(torch.profiler over one eager step, and over one step replay of each graph tier), beside the step as the engine loop
runs it (`loop_step_ms`: CUDA events around the loop's iterations, idle gaps between steps included; the per-step
figure by difference carries the host's run-to-run jitter over ten steps). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any, Callable

import torch

CONTENDERS = ("diffusers", "diffusers_compile", "diffgraph_eager", "diffgraph_graph", "diffgraph_compile")
DEFAULT_CASES = ("random:sd15@512", "random:sdxl@1024")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _e2e_and_step(f_full: Callable[[], Any], f_half: Callable[[], Any], steps: int, half: int,
                  repeats: int) -> dict[str, float]:
    """End-to-end ms at `steps` (after one warm call) and per-step ms from the difference to `half` steps."""
    f_full()
    e2e = _timed(f_full, repeats)
    return {"e2e_ms": e2e, "step_ms": (e2e - _timed(f_half, repeats)) / (steps - half)}


def step_events(engine, run: Callable[[], Any]) -> list[tuple[Any, Any, bool]]:
    """The engine loop's per-iteration CUDA events (start, end, whether the loop had waited for work) while `run()`
    runs, synchronised; recording is off again afterwards."""
    core = engine.core
    core.step_events = []
    try:
        run()
        _sync()
        return core.step_events
    finally:
        core.step_events = None


def loop_step_ms(engine, run: Callable[[], Any]) -> float:
    """Per-step GPU time of a generation through the engine loop: CUDA events around each iteration (its copies and
    replay), from the start of the second step to the end of the second-to-last over the steps between, so the
    GPU's idle gaps between steps count and admission and retirement do not. NaN off CUDA."""
    if not engine.runner.cuda:
        return float("nan")
    inner = step_events(engine, run)[1:-1]
    return inner[0][0].elapsed_time(inner[-1][1]) / len(inner) if len(inner) >= 2 else float("nan")


def profiled_kernel_ms(run_step: Callable[[], None], warm: int, profiled: int) -> float:
    """Mean summed CUDA kernel time (torch.profiler) of `profiled` consecutive calls after `warm` calls."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(warm):
            run_step()
        _sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                run_step()
            _sync()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return total_us / 1e3 / profiled if total_us else float("nan")


def kernel_ms_of_one_step(engine, size: int, images: int, warm: int = 5, profiled: int = 3,
                          replayed: bool = False) -> float:
    """Summed CUDA kernel time of one whole step, in ms: the mean over `profiled` consecutive steps after
    `warm` steps (the clocks a 20-step generation sees). Eager by default; with `replayed`, the kernels of
    the step's graph replays (the same kernels at the duty cycle of a replay: at large batches the GPU
    then runs at lower clocks than between eager launches). NaN where nothing was recorded."""
    from ..graphs.step import whole_step

    from ..features.program import layout

    w = engine.runner
    key = (size, size)
    buf = w.buffers(key)
    request = engine.make_request("x", width=size, height=size, num_inference_steps=20, sampler="euler",
                                  guidance_scale=7.5)
    coefs = w.request_plan(request).coefs  # CFG 7.5: two denoiser rows per image
    buf.coefs[:images] = torch.as_tensor(coefs[5], dtype=torch.float32, device=buf.x.device)
    rows = [(i, 1, 2) for i in range(images)]
    if not replayed:
        buf.index[:2 * images] = torch.as_tensor(layout(rows, 2 * images), device=buf.x.device)
        return profiled_kernel_ms(lambda: whole_step(w.program, w.denoise_eager, buf, images, 2 * images,
                                                     w.program.neutral()), warm, profiled)
    runner = w.graph_runner
    bucket = runner.bucket("step", size, size, 2 * images) if runner is not None else None
    if bucket != 2 * images:
        return float("nan")
    buf.index[:bucket] = torch.as_tensor(layout(rows, bucket), device=buf.x.device)
    return profiled_kernel_ms(lambda: runner.replay("step", size, size, bucket), warm, profiled)


def _load_model_timed(model_name: str, device: str, out: dict[str, Any]):
    """Loads the model, recording in `out` the seconds of the imports, the CUDA start-up and the load, and its
    dtype."""
    from ..models.loader import load_model

    _sync()
    t0 = time.perf_counter()
    cuda = device == "cuda"
    # the first case pays the imports and CUDA start-up: part of its cold start; the model classes are
    # imported lazily by their packages, so name them here to keep their imports out of "model build"
    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel  # noqa: F401
    out["import_s"] = time.perf_counter() - t0
    if cuda:
        torch.zeros(1, device=device)
    out["cuda_init_s"] = time.perf_counter() - t0 - out["import_s"]
    model = load_model(model_name, device=device, dtype="fp16" if cuda else "fp32")
    _sync()
    out["load_s"] = time.perf_counter() - t0
    out["dtype"] = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model.dtype, "fp32")
    return model


def _graph_engine_timed(model, size: int, buckets: tuple[int, ...], cuda: bool, out: dict[str, Any]):
    """The graph-mode engine, recording in `out` its capture and warm-up seconds, its memory pool and any graph
    that failed to capture."""
    from ..config import GraphConfig
    from ..engine.engine import Engine

    t0 = time.perf_counter()
    # on the CPU (smoke tests of this script) the graphs are emulated
    graph = Engine(model, mode="graph", graphs=GraphConfig(batch_buckets=buckets, resolutions=((size, size),),
                                                           backend="cuda" if cuda else "emulated"))
    out["graph_capture_s"] = time.perf_counter() - t0
    table = graph.graph_table()
    out["graph_warmup_s"] = sum(r.get("warmup_ms", 0.0) for r in table) / 1e3
    out["graph_warmup_first_s"] = sum(r.get("warmup_first_ms", 0.0) for r in table) / 1e3
    out["graph_capture_by_kind_s"] = {k: sum(r["capture_ms"] for r in table if r["kind"] == k) / 1e3
                                      for k in {r["kind"] for r in table}}
    out["cold_start_graph_s"] = out["load_s"] + out["graph_capture_s"]
    runner = graph.runner.graph_runner
    step_stats = [s for k, s in runner.stats.items() if k[0] == "step"]
    largest = max(step_stats, key=lambda s: s.bucket)
    out["pool_mib_total"] = runner.pool_mib()
    out["pool_mib_step_graphs"] = sum(s.pool_mib_added for s in step_stats)
    out["pool_mib_largest_step_alone"] = largest.pool_mib_added
    out["graph_failures"] = [r for r in graph.graph_table() if r["status"] == "failed"]
    return graph


def _time_contenders(eager, graph, n: int, size: int, steps: int, half: int, contenders: list[str], repeats: int,
                     cuda: bool, diffgraph_fn, diffusers_fn) -> dict[str, Any]:
    """One image count's kernel ms per step and every uncompiled contender's end-to-end and step times."""
    res: dict[str, Any] = {"kernel_ms_per_step": kernel_ms_of_one_step(eager, size, n) if cuda else float("nan"),
                           "replay_kernel_ms_per_step": kernel_ms_of_one_step(graph, size, n, replayed=True)
                           if cuda else float("nan")}
    for c in contenders:
        if c in ("diffusers_compile", "diffgraph_compile"):
            continue
        f_full = diffgraph_fn(eager if c == "diffgraph_eager" else graph, n, steps) if c != "diffusers" \
            else diffusers_fn(n, steps)
        f_half = diffgraph_fn(eager if c == "diffgraph_eager" else graph, n, half) if c != "diffusers" \
            else diffusers_fn(n, half)
        res[c] = _e2e_and_step(f_full, f_half, steps, half, repeats)
        if c != "diffusers":  # where diffgraph's end-to-end time goes (the last run)
            res[c]["timings"] = {k: round(v, 1) for k, v in f_full().timings.items()}
            res[c]["loop_step_ms"] = loop_step_ms(eager if c == "diffgraph_eager" else graph, f_full)
    return res


def _time_diffusers_compile(pipe, diffusers_fn, image_counts: list[int], steps: int, half: int, repeats: int,
                            out: dict[str, Any]) -> None:
    """diffusers with its UNet under torch.compile (reduce-overhead): first call, end-to-end and step times per
    image count into out["results"]; a failure is recorded in out["compile_error"], not raised."""
    plain = pipe.unet
    pipe.unet = torch.compile(plain, mode="reduce-overhead")
    try:
        for n in image_counts:  # each new batch size recompiles (a minute each)
            _sync()
            t0 = time.perf_counter()
            diffusers_fn(n, steps)()
            _sync()
            first = time.perf_counter() - t0
            diffusers_fn(n, steps)()
            e2e = _timed(diffusers_fn(n, steps), repeats)
            diffusers_fn(n, half)()
            e2e_half = _timed(diffusers_fn(n, half), repeats)
            out["results"][n]["diffusers_compile"] = {"e2e_ms": e2e, "step_ms": (e2e - e2e_half) / (steps - half),
                                                      "first_call_s": first}
    except Exception as e:  # report, do not lose the other contenders' numbers
        out["compile_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        pipe.unet = plain


def _add_ratios(out: dict[str, Any], contenders: list[str]) -> None:
    """Each contender's end-to-end and step times over diffusers', where diffusers ran."""
    for n, res in out["results"].items():
        base = res.get("diffusers", {}).get("e2e_ms")
        base_step = res.get("diffusers", {}).get("step_ms")
        for c in contenders:
            if c in res and base:
                res[c]["e2e_ratio"] = res[c]["e2e_ms"] / base
                res[c]["step_ratio"] = res[c]["step_ms"] / base_step


def run_case(model_name: str, size: int, image_counts: list[int], steps: int, contenders: list[str],
             repeats: int, buckets: tuple[int, ...], device: str = "cuda", fresh_starts: bool = True,
             diffusers_compile_images: list[int] | None = None) -> dict[str, Any]:
    from ..engine.engine import Engine

    out: dict[str, Any] = {"model": model_name, "size": size, "steps": steps, "results": {}}
    cuda = device == "cuda"
    model = _load_model_timed(model_name, device, out)
    prompt, seed = "a photograph of an astronaut riding a horse", 0
    half = max(1, steps // 2)

    eager = Engine(model, mode="eager")
    graph = _graph_engine_timed(model, size, buckets, cuda, out)

    pipe = eager.diffusers_pipeline("euler", "default")

    def diffgraph_fn(engine, n, k):
        return lambda: engine.generate(prompt, width=size, height=size, num_inference_steps=k, num_images=n,
                                       seed=seed, sampler="euler")

    def diffusers_fn(n, k):
        return lambda: pipe(prompt, width=size, height=size, num_inference_steps=k, num_images_per_prompt=n,
                            generator=torch.Generator().manual_seed(seed), output_type="pil")  # PIL, as ours

    for n in image_counts:
        out["results"][n] = _time_contenders(eager, graph, n, size, steps, half, contenders, repeats, cuda,
                                             diffgraph_fn, diffusers_fn)

    if "diffgraph_compile" in contenders:
        out["compile"] = _compile_tier(out, graph, model, model_name, size, image_counts, steps, half, repeats,
                                       buckets, device, diffgraph_fn, fresh_starts)
        print("compile tier:", json.dumps({"compile": out["compile"], "results": out["results"]}, default=str),
              flush=True)  # kept if a later part fails
    if "diffusers_compile" in contenders:
        _time_diffusers_compile(pipe, diffusers_fn, diffusers_compile_images or image_counts, steps, half, repeats,
                                out)
    _add_ratios(out, contenders)
    out["graph_table"] = graph.graph_table()
    graph.close()
    eager.close()
    return out


def step_replay_ms(engine, key: tuple[int, int], bucket: int, repeats: int) -> float | None:
    """One replay of the engine's step graph at (height, width) `key` and `bucket` (median over `repeats` runs of
    10), None if not captured."""
    runner = engine.runner.graph_runner
    h, w = key
    if runner.stats[("step", h, w, bucket)].status != "captured":
        return None
    return _timed(lambda: [runner.replay("step", h, w, bucket) for _ in range(10)], repeats) / 10


def _compile_tier(out: dict[str, Any], graph, model, model_name: str, size: int, image_counts: list[int], steps: int,
                  half: int, repeats: int, buckets: tuple[int, ...], device: str,
                  diffgraph_fn: Callable[..., Callable[[], Any]], fresh_starts: bool = True) -> dict[str, Any]:
    """The diffgraph_compile contender: a compile-tier engine started on an empty cache folder (cold start, graphs
    verified against the uncompiled functions), its end-to-end and per-step times (into out["results"]), the
    kernels of its step replays, its pool beside the graph tier's, both tiers' step replay at the largest bucket,
    then two starts in fresh processes: on that folder, and on a copy of it elsewhere."""
    import shutil
    import tempfile

    from ..config import CompileConfig, GraphConfig
    from ..engine.engine import Engine
    from ..engine.graph_setup import set_conv_layout
    from ..graphs.compiled import folder_bytes
    from .compile_start import fresh_start

    cuda = device == "cuda"
    root = tempfile.mkdtemp(prefix="diffgraph-compile-")
    info: dict[str, Any] = {"cache_root": root}
    top = max(buckets)
    # the graph tier's replay first: the compile tier may give the shared UNet channels-last weights (new storage)
    info[f"graph_replay_ms_at_{top}"] = step_replay_ms(graph, (size, size), top, repeats)
    _sync()
    t0 = time.perf_counter()
    engine = Engine(model, mode="graph", compile=CompileConfig(cache_dir=root),
                    graphs=GraphConfig(batch_buckets=buckets, resolutions=((size, size),), verify=True,
                                       backend="cuda" if cuda else "emulated"))
    info["ready_s"] = time.perf_counter() - t0
    info["cold_start_s"] = out["load_s"] + info["ready_s"]
    stats = engine.stats
    info.update(compiles=stats["compiles"], compile_s=stats["compile_s"], fallbacks=stats["compile_fallbacks"])
    table = engine.graph_table()
    info["verify_max_abs"] = {f"{r['kind']}{r['bucket']}": r["verify_max_abs"] for r in table
                              if r.get("verify_max_abs") is not None}
    info["not_captured"] = [f"{r['kind']}{r['bucket']}: {r['error']}" for r in table if r["status"] != "captured"]
    info["pool_mib"] = engine.runner.graph_runner.pool_mib()
    info["pool_ratio"] = info["pool_mib"] / out["pool_mib_total"] if out["pool_mib_total"] else float("nan")
    step = engine.runner.compiled[0] if engine.runner.compiled else None  # the layout as applied
    info["layout"] = f"{step.tag} options={step.options}" if step is not None else None
    info[f"compile_replay_ms_at_{top}"] = step_replay_ms(engine, (size, size), top, repeats)
    if info[f"compile_replay_ms_at_{top}"] and info[f"graph_replay_ms_at_{top}"]:
        info["rate_ratio_at_top"] = info[f"graph_replay_ms_at_{top}"] / info[f"compile_replay_ms_at_{top}"]
    for n in image_counts:
        res = out["results"][n]
        f_full, f_half = diffgraph_fn(engine, n, steps), diffgraph_fn(engine, n, half)
        res["diffgraph_compile"] = {**_e2e_and_step(f_full, f_half, steps, half, repeats),
                                    "timings": {k: round(v, 1) for k, v in f_full().timings.items()},
                                    "loop_step_ms": loop_step_ms(engine, f_full)}
        res["compile_replay_kernel_ms_per_step"] = kernel_ms_of_one_step(engine, size, n, replayed=True) \
            if cuda else float("nan")
    info["cache_mib"] = folder_bytes(engine.runner.compile_folder) / 2**20
    engine.close()
    set_conv_layout(model.denoiser, channels_last=False)  # diffusers + torch.compile measured as before, on NCHW
    print("compile tier before the fresh starts:", json.dumps(
        {"info": info, "e2e": {n: out["results"][n].get("diffgraph_compile") for n in image_counts}}, default=str),
        flush=True)  # kept if a fresh start runs past the device command's limit
    if not fresh_starts:
        return info
    spec = ",".join(map(str, buckets))
    info["warm_same_folder"] = fresh_start(model_name, size, spec, root, device)
    print("fresh start on the same folder:", json.dumps(info["warm_same_folder"], default=str), flush=True)
    shutil.copytree(root, root + "-copy")
    info["warm_copied_folder"] = fresh_start(model_name, size, spec, root + "-copy", device)
    return info


def _format_compile(c: dict[str, Any]) -> list[str]:
    lines = [f"  compile tier: cold start {c['cold_start_s']:.1f}s (engine {c['ready_s']:.1f}s: {c['compiles']} graphs "
             f"compiled in {c['compile_s']:.1f}s), fallbacks {c['fallbacks']}, cache {c['cache_mib']:.0f} MiB, pool "
             f"{c['pool_mib']:.0f} MiB = {c['pool_ratio']:.2f}x the graph tier's"]
    for label in ("warm_same_folder", "warm_copied_folder"):
        if label not in c:  # --no-fresh-starts
            continue
        w = c[label]
        lines.append(f"    fresh process, {label.replace('_', ' ')}: " + (
            f"ready {w['launch_to_ready_s']:.1f}s after launch (in-process {w['ready_s']:.1f}s: imports "
            f"{w['import_s']:.1f}s, model {w['load_s']:.1f}s), {w['compiles']} graphs in {w['compile_s']:.1f}s, "
            f"{w.get('loaded', 0)} precompiled loaded in {w.get('load_s', 0.0):.1f}s, FX "
            f"cache hits {w['fxgraph_cache_hit']} misses {w['fxgraph_cache_miss']}, {w['captured']}/{w['graphs']} "
            f"captured" if "error" not in w else f"failed: {w['error']}"))
    rates = {k: v for k, v in c.items() if "replay_ms_at" in k and v is not None}
    if rates:
        lines.append("    step replay at the largest bucket: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
                     + f"; rate compile/graph {c.get('rate_ratio_at_top', float('nan')):.3f}x")
    lines.append("    compiled vs uncompiled (verification max abs): " + ", ".join(
        f"{k} {v:.2g}" for k, v in c["verify_max_abs"].items()))
    if c["not_captured"]:
        lines.append("    not captured: " + "; ".join(c["not_captured"]))
    return lines


def format_table(report: list[dict[str, Any]]) -> str:
    lines = []
    for case in report:
        lines.append(f"{case['model']} {case['size']}x{case['size']}, {case['steps']} steps, {case.get('dtype', 'fp16')} | load {case['load_s']:.1f}s, "
                     f"graph capture {case['graph_capture_s']:.1f}s, cold start {case['cold_start_graph_s']:.1f}s | "
                     f"pool {case['pool_mib_total']:.0f} MiB (step graphs {case['pool_mib_step_graphs']:.0f}, "
                     f"largest bucket alone {case['pool_mib_largest_step_alone']:.0f})")
        lines.append(f"  cold start: imports {case['import_s']:.1f}s, CUDA init {case['cuda_init_s']:.1f}s, "
                     f"model build {case['load_s'] - case['import_s'] - case['cuda_init_s']:.1f}s, captures by kind "
                     + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(case["graph_capture_by_kind_s"].items()))
                     + f" (warm-up iterations {case['graph_warmup_s']:.1f}s of it, the first of each graph "
                     f"{case.get('graph_warmup_first_s', float('nan')):.1f}s)")
        captured = [r for r in case.get("graph_table", []) if r["status"] == "captured"]
        if captured:  # where the start-up goes, per graph: whole capture / first warm-up iteration, ms
            lines.append("  per graph (capture / first warm-up ms): " + ", ".join(
                f"{r['kind']}{r['bucket']} {r['capture_ms']:.0f}/{r.get('warmup_first_ms', 0.0):.0f}" for r in captured))
        lines.append(f"  {'images':>6} {'contender':<18} {'step ms':>8} {'e2e ms':>9} {'e2e/diffusers':>13} {'step/kernel':>11}")
        for n, res in case["results"].items():
            for c in CONTENDERS:
                if c not in res:
                    continue
                r = res[c]
                lines.append(f"  {n:>6} {c:<18} {r['step_ms']:8.2f} {r['e2e_ms']:9.1f} {r.get('e2e_ratio', float('nan')):13.3f} "
                             f"{r['step_ms'] / res['kernel_ms_per_step']:11.3f}"
                             + (f"  first call {r['first_call_s']:.1f}s" if "first_call_s" in r else ""))
            lines.append(f"  {n:>6} {'(GPU kernels)':<18} {res['kernel_ms_per_step']:8.2f}   eager step's kernels")
            rk = res.get("replay_kernel_ms_per_step", float("nan"))
            g = res.get("diffgraph_graph")
            gl = g.get("loop_step_ms", float("nan")) if g else float("nan")
            lines.append(f"  {n:>6} {'(GPU kernels)':<18} {rk:8.2f}   kernels inside one graph replay"
                         + (f"; graph step / these {g['step_ms'] / rk:.3f} (in the loop {gl:.2f} ms: {gl / rk:.3f})"
                            if g else ""))
            ck = res.get("compile_replay_kernel_ms_per_step")
            cr = res.get("diffgraph_compile")
            if cr and ck:
                loop = cr.get("loop_step_ms", float("nan"))
                lines.append(f"  {n:>6} {'(GPU kernels)':<18} {ck:8.2f}   kernels inside one compiled step replay; "
                             f"compiled step / these {cr['step_ms'] / ck:.3f} (in the loop {loop:.2f} ms: "
                             f"{loop / ck:.3f}); timings {cr['timings']}")
        if case.get("compile"):
            lines.extend(_format_compile(case["compile"]))
        if case.get("compile_error"):
            lines.append(f"  compile error: {case['compile_error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffgraph bench latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help="MODEL@SIZE list (default: %(default)s)")
    p.add_argument("--images", default="1,4", help="image counts (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--buckets", default="1,2,4,8,16",
                   help="the engine's batch buckets, in denoiser rows (an image with classifier-free guidance needs 2)")
    p.add_argument("--diffusers-compile-images", default="", help="image counts for diffusers_compile (default: "
                   "--images; each one recompiles)")
    p.add_argument("--no-fresh-starts", action="store_true", help="diffgraph_compile: skip the two starts in fresh "
                   "processes on a warm cache folder")
    p.add_argument("--json", default="bench_latency.json", help="output JSON path")
    p.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script (emulated graphs)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("diffgraph: error: bench latency needs a CUDA device (or --device cpu for a smoke test)")
        return 2
    from ..config import parse_buckets

    report = []
    for case in args.cases.split(","):
        name, size = case.split("@")
        contenders = [c for c in args.contenders.split(",") if c]
        report.append(run_case(name, int(size), [int(v) for v in args.images.split(",")], args.steps, contenders,
                               args.repeats, parse_buckets(args.buckets), args.device, not args.no_fresh_starts,
                               [int(v) for v in args.diffusers_compile_images.split(",") if v]))
        print(format_table(report[-1:]), flush=True)
        gc.collect()  # the case's engines and model are gone: give their memory back before the next one
        if args.device == "cuda":
            torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    try:
        import diffusers
        env["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    with open(args.json, "w") as f:
        json.dump({"env": env, "cases": report}, f, indent=1, default=str)
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
