"""The compile tier's start-up in a fresh process: warm-cache figures are only honest there, since Dynamo
and Triton keep compiled code in memory. `fresh_start(...)` runs this module as a child process on a cache folder and
returns what it measured; the child builds a graph-mode compile-tier engine (every bucket captured), generates one
image, and prints one JSON line: seconds from its start to ready, graphs compiled and their time, precompiled
versions loaded and their time, Inductor's cache hits and misses, fallbacks.

    python -m diffgraph.bench.compile_start --model random:sd15 --size 512 --buckets 1,2,4,8,16 --cache DIR
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before torch and diffgraph are imported: their imports are part of the start

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402


def fresh_start(model: str, size: int, buckets: str, cache: str, device: str = "cuda",
                timeout_s: float = 600) -> dict[str, Any]:
    """Runs the child; its report plus `wall_s` (process start to exit, as the parent saw it) and
    `launch_to_ready_s` (from the parent launching it to the child's engine being ready, by the wall clock: the
    interpreter's start included, the first image and the child's teardown not). A child that fails gives
    {"error": ...} with the end of its output, never an exception."""
    cmd = [sys.executable, "-m", "diffgraph.bench.compile_start", "--model", model, "--size", str(size),
           "--buckets", buckets, "--cache", cache, "--device", device]
    t0, launched = time.perf_counter(), time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no report within {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"}
    report = json.loads(lines[-1])
    return {**report, "wall_s": wall, "launch_to_ready_s": report["ready_unix"] - launched}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diffgraph.bench.compile_start", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--buckets", default="1,2,4,8,16")
    p.add_argument("--cache", required=True, help="the compile cache folder (root)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)

    import torch
    from torch._dynamo.utils import counters

    from ..config import CompileConfig, GraphConfig, parse_buckets
    from ..engine.engine import Engine
    from ..models.loader import load_model

    cuda = args.device == "cuda"
    t_import = time.perf_counter() - _T0
    model = load_model(args.model, device=args.device, dtype="fp16" if cuda else "fp32")
    t_load = time.perf_counter() - _T0
    graphs = GraphConfig(batch_buckets=parse_buckets(args.buckets), resolutions=((args.size, args.size),),
                         backend="cuda" if cuda else "emulated")
    with Engine(model, mode="graph", graphs=graphs, compile=CompileConfig(cache_dir=args.cache)) as engine:
        ready, ready_unix = time.perf_counter() - _T0, time.time()
        t0 = time.perf_counter()
        engine.generate("a lighthouse at dusk", width=args.size, height=args.size, num_inference_steps=4, seed=0)
        first = time.perf_counter() - t0
        stats = engine.stats
        table = engine.graph_table()
    print(json.dumps({
        "ready_s": ready, "ready_unix": ready_unix, "import_s": t_import, "load_s": t_load - t_import,
        "first_image_s": first,
        "compiles": stats["compiles"], "compile_s": stats["compile_s"], "compile_fallbacks": stats["compile_fallbacks"],
        "loaded": stats["compile_loaded"], "load_s": stats["compile_load_s"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "captured": sum(r["status"] == "captured" for r in table), "graphs": len(table),
        "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
