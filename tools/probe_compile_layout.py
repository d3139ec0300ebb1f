"""Probe (issue 13, Build item 5): layout, attention backend and Inductor options with compile on, per family and
bucket, in one 10-minute device command.

Each variant (family, weights' memory format, SDPA backend, Inductor options) runs in its own process, and the
processes compile in parallel (compiling is mostly single-threaded Python); then, one process at a time, each
captures its compiled UNet (and VAE decoder, where asked) in a CUDA graph of its own, as the engine does, and times
replays with CUDA events, with cuDNN's heuristics and again with `cudnn.benchmark`. Nothing is timed while another
process compiles. Prints one line per measurement and a table last.

    python3 -u tools/probe_compile_layout.py [sd15] [sdxl] [engine] [engineforce] [enginexl] [enginegn]   # GPU host

`engine` / `enginexl` time the compile tier's own step graphs (buckets 1 and 16, the batch dimension dynamic above 1)
per layout, where the static-shape groups time the bare UNet; their second column is not `cudnn.benchmark` but the
replay's summed kernel time (torch.profiler), the denominator of the step/kernel target.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
import time

TUNED = {"conv_1x1_as_mm": True, "coordinate_descent_tuning": True, "epilogue_fusion": False,
         "coordinate_descent_check_all_directions": True}  # what diffusers' speed-up guide sets for SDXL

def _v(family, layout, attention="auto", tuned=False, batches=(2, 32), vae=False):
    return dict(family=family, layout=layout, attention=attention, tuned=tuned, batches=batches, vae=vae)


def _e(family, layout, attention, pdl=False, force=False, gn=False):  # the engine itself: its compiled step (dynamic
    # batch above 1), buckets 1 and 16; pdl: Inductor's Triton kernels with programmatic dependent launch (Hopper),
    # which lets a kernel's launch overlap the tail of the one before it inside the graph; force: Inductor's layout
    # optimisation (channels-last activations around convolutions) forced on, which it skips for dynamic shapes;
    # gn: the UNet's group norms traced per channel first (graphs/group_norm.py, as the 16-bit VAE decoder's since
    # session 32); layout None / attention None: the family's own choices (the engine as shipped)
    return dict(family=family, layout=layout, attention=attention, tuned=False, batches=(1, 16), engine=True, pdl=pdl,
                force=force, gn=gn)


GROUPS = {  # first call: SD1.5; the second: SDXL's layouts and SD1.5's two best choices together
    "sd15": [_v("sd15", "nchw", vae=True), _v("sd15", "cl", vae=True), _v("sd15", "nchw", "efficient"),
             _v("sd15", "nchw", "cudnn"), _v("sd15", "nchw", tuned=True, batches=(2,), vae=True),
             _v("sd15", "cl", tuned=True, batches=(2,), vae=True)],
    "sdxl": [_v("sdxl", "nchw"), _v("sdxl", "cl"), _v("sdxl", "cl", "cudnn"), _v("sd15", "cl", "cudnn")],
    # the compile tier's engine (step graphs only), per layout: what the static-shape probe does not show for the
    # dynamic compile of buckets above 1
    "engine": [_e("sd15", "nchw", "auto"), _e("sd15", "nchw", "cudnn"),
               _e("sd15", "cl", "cudnn"), _e("sd15", "nchw", "cudnn", pdl=True), _e("sd15", "cl", "cudnn", pdl=True)],
    "engineforce": [_e("sd15", "nchw", "auto"), _e("sd15", "cl", "cudnn"), _e("sd15", "nchw", "auto", force=True),
                    _e("sd15", "cl", "cudnn", force=True), _e("sd15", "cl", "auto", force=True)],
    "enginexl": [_e("sdxl", "nchw", "auto"), _e("sdxl", "cl", "auto")],
    # the shipped step against the same with the UNet's group norms traced per channel first
    "enginegn": [_e("sd15", None, None, force=True), _e("sd15", None, None, force=True, gn=True)],
}
SIZES = {"sd15": 512, "sdxl": 1024}


def _graph_ms(fn) -> float:
    import torch
    from probe_layout import graph_ms  # tools/: the same capture-and-replay timing as the eager-layout probe
    ms = graph_ms(fn)
    torch.cuda.empty_cache()
    return ms


def engine_worker(spec: dict, conn) -> None:
    """A compile-tier engine with the variant's layout (step graphs only, buckets 1 and 16); times the step replays."""
    import tempfile

    from diffgraph import Engine
    from diffgraph.config import CompileConfig, GraphConfig
    from diffgraph.graphs.group_norm import use_channel_group_norms
    from diffgraph.models.loader import load_model
    try:
        from diffgraph.engine import graph_setup  # the step's Inductor options, per variant (the engine forces it)
        graph_setup.STEP_OPTIONS = {"force_layout_optimization": bool(spec.get("force"))}
        if spec.get("pdl"):
            import torch._inductor.config as inductor_config
            if not hasattr(inductor_config.triton, "enable_pdl"):
                raise RuntimeError("this torch's Inductor has no triton.enable_pdl")
            inductor_config.triton.enable_pdl = True
        size = SIZES[spec["family"]]
        device = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a smoke test of the probe up to "ready"
        graphs = GraphConfig(batch_buckets=spec["batches"], resolutions=((size, size),), capture_text_encoder=False,
                             capture_vae=False, backend="cuda" if device == "cuda" else "emulated")
        config = CompileConfig(cache_dir=tempfile.mkdtemp(), attention=spec["attention"],
                               channels_last=None if spec["layout"] is None else spec["layout"] == "cl")
        model = load_model(f"random:{spec['family']}", device=device, dtype="fp16" if device == "cuda" else "fp32")
        if spec.get("gn"):
            use_channel_group_norms(model.unet)
        engine = Engine(model, mode="graph", graphs=graphs, compile=config)
        runner = engine.runner.graph_runner
        conn.send(("ready", {"compile_s": engine.stats["compile_s"], "fallbacks": engine.stats["compile_fallbacks"]}))
        if conn.recv() != "go":
            return
        from probe_layout import eager_ms  # CUDA events around plain calls (a replay is not captured again)

        from diffgraph.bench.latency import profiled_kernel_ms
        rows = []
        for b in spec["batches"]:
            replay = lambda b=b: runner.replay("step", size, size, b)  # noqa: E731
            rows.append((f"engine step bucket {b}", False, eager_ms(replay, iters=20)))
            if device == "cuda":  # the replay's summed kernel time (the step/kernel target), in the bench column
                rows.append((f"engine step bucket {b}", True, profiled_kernel_ms(replay, warm=5, profiled=5)))
        try:
            rows += _steps_in_the_loop(engine, size) if device == "cuda" else []
        except Exception as e:  # the step timings above still count
            print(f"steps in the loop failed: {type(e).__name__}: {e}", flush=True)
        conn.send(("done", rows))
        engine.close()
    except Exception as e:  # reported, the others go on
        conn.send(("error", f"{type(e).__name__}: {str(e)[:400]}"))


def _steps_in_the_loop(engine, size: int) -> list:
    """One image, 20 steps, through the engine loop: where a step's milliseconds go beyond its kernels. CUDA events
    around each iteration (the GPU span of its copies and replay, and the GPU's idle gap before the next) and the
    host's time per iteration; medians over steps 2-19, as rows of the probe's table."""
    import statistics

    from diffgraph.bench.latency import step_events
    core, host = engine.core, []
    core.step_listeners.append(lambda plan, dt: host.append(dt))
    run = lambda: engine.generate("a lighthouse", width=size, height=size, num_inference_steps=20, seed=0)  # noqa
    run()
    run()
    t0 = time.perf_counter()
    run()
    e2e = (time.perf_counter() - t0) * 1e3
    host.clear()
    ev = step_events(engine, run)
    span = statistics.median(s.elapsed_time(e) for s, e, _ in ev[1:-1])
    gap = statistics.median(a[1].elapsed_time(b[0]) for a, b in zip(ev[1:-2], ev[2:-1]))
    return [("loop: e2e 1 image", False, e2e), ("loop: step GPU span", False, span),
            ("loop: GPU gap before next", False, gap), ("loop: host per iteration", False,
                                                        statistics.median(host[1:-1]) * 1e3)]


def worker(spec: dict, conn) -> None:
    family = spec["family"]
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
    if spec.get("engine"):
        return engine_worker(spec, conn)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from diffgraph.models.loader import load_model
    try:
        m = load_model(f"random:{family}", device="cuda", dtype="fp16")
        unet, vae = m.unet, m.vae.to(m.vae_dtype)
        fmt = torch.channels_last if spec["layout"] == "cl" else torch.contiguous_format
        unet.to(memory_format=fmt)
        vae.to(memory_format=fmt)
        backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION}.get(spec["attention"])

        def run_unet(x, t, e, added):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return unet(x, t, encoder_hidden_states=e, added_cond_kwargs=added, return_dict=False)[0]

        def run_vae(z):
            return vae.decode(z, return_dict=False)[0]

        options = {"triton.cudagraphs": False, **(TUNED if spec["tuned"] else {})}
        cu = torch.compile(run_unet, options=options, dynamic=False)
        cv = torch.compile(run_vae, options=options, dynamic=False)
        lat = SIZES[family] // 8
        work = []  # (label, thunk)
        compile_s = {}
        for b in spec["batches"]:
            x = torch.randn(b, 4, lat, lat, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
            t = torch.full((b,), 500.0, device="cuda")
            e = torch.randn(b, 77, unet.config.cross_attention_dim, device="cuda", dtype=torch.float16)
            added = None
            if family == "sdxl":
                added = {"text_embeds": torch.randn(b, 1280, device="cuda", dtype=torch.float16),
                         "time_ids": torch.randn(b, 6, device="cuda", dtype=torch.float16)}
            t0 = time.perf_counter()
            with torch.no_grad():
                cu(x, t, e, added)
            torch.cuda.synchronize()
            compile_s[f"unet {b}"] = time.perf_counter() - t0
            work.append((f"unet cfg batch {b}", lambda x=x, t=t, e=e, a=added: cu(x, t, e, a)))
        if spec.get("vae"):
            z = torch.randn(1, 4, lat, lat, device="cuda", dtype=m.vae_dtype).contiguous(memory_format=fmt)
            t0 = time.perf_counter()
            with torch.no_grad():
                cv(z)
            torch.cuda.synchronize()
            compile_s["vae 1"] = time.perf_counter() - t0
            work.append(("vae decode 1 image", lambda z=z: cv(z)))
        torch.cuda.empty_cache()
        conn.send(("ready", compile_s))
        if conn.recv() != "go":
            return
        results = []
        for label, fn in work:
            for bench in (False, True):
                torch.backends.cudnn.benchmark = bench
                with torch.no_grad():
                    ms = _graph_ms(fn)
                results.append((label, bench, ms))
        torch.backends.cudnn.benchmark = False
        conn.send(("done", results))
    except Exception as e:  # the probe reports a variant that does not run, and goes on with the others
        conn.send(("error", f"{type(e).__name__}: {str(e)[:400]}"))


def name_of(spec: dict) -> str:
    layout = "family-layout" if spec["layout"] is None else spec["layout"]  # None: the family's own choices
    attention = "family" if spec["attention"] is None else spec["attention"]
    return (f"{spec['family']} {layout} attn={attention}{' tuned' if spec['tuned'] else ''}"
            f"{' engine' if spec.get('engine') else ''}{' pdl' if spec.get('pdl') else ''}"
            f"{' force-layout' if spec.get('force') else ''}{' channel-gn' if spec.get('gn') else ''}")


def main(groups: list[str], deadline_s: float = float(os.environ.get("PROBE_DEADLINE_S", 430))) -> None:
    import torch
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(),
          "precompile API:", hasattr(torch.compiler, "load_compiled_function"), flush=True)
    ctx = mp.get_context("spawn")
    t0 = time.time()
    procs = []
    for group in groups:
        for spec in GROUPS[group]:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker, args=(spec, child), daemon=True)
            p.start()
            procs.append((name_of(spec), p, parent))
    ready = {}
    for name, p, conn in procs:
        left = deadline_s - (time.time() - t0)
        if left > 0 and conn.poll(left):
            kind, payload = conn.recv()
            print(f"[{time.time() - t0:5.0f} s] {name}: {kind} {payload}", flush=True)
            if kind == "ready":
                ready[name] = payload
        else:
            print(f"[{time.time() - t0:5.0f} s] {name}: not compiled by the deadline", flush=True)
    wait_for = os.environ.get("PROBE_WAIT_FILE")  # another job on this GPU: time nothing until it is done
    while wait_for and not os.path.exists(wait_for) and time.time() - t0 < deadline_s + 120:
        time.sleep(2)
    print(f"[{time.time() - t0:5.0f} s] measuring", flush=True)
    table = []
    for name, p, conn in procs:
        if name not in ready:
            p.kill()
            continue
        conn.send("go")
        if conn.poll(120):
            kind, payload = conn.recv()
            if kind == "done":
                for label, bench, ms in payload:
                    print(f"{name:36s} {label:22s} cudnn.benchmark={bench!s:5s} {ms:8.2f} ms", flush=True)
                    table.append((name, label, bench, ms))
            else:
                print(f"{name}: {kind} {payload}", flush=True)
        p.kill()
    print(f"\nprobe took {time.time() - t0:.0f} s\n| variant | graph | cuDNN heuristics ms | cudnn.benchmark ms |")
    print("|---|---|---|---|")
    rows: dict = {}
    for name, label, bench, ms in table:
        rows.setdefault((name, label), {})[bench] = ms
    for (name, label), v in rows.items():
        print(f"| {name} | {label} | {v.get(False, float('nan')):.2f} | {v.get(True, float('nan')):.2f} |")
    print("JSON " + json.dumps({"compile_s": ready, "rows": table}))


if __name__ == "__main__":
    main(sys.argv[1:] or ["sd15"])
