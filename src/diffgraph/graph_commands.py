"""`diffgraph info` and `diffgraph compile`: an engine built to show, or to fill, its graphs (and the compile tier's
cache). Imported by cli.py only when one of them runs; errors are ValueErrors, which the CLI prints."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .cli_flags import compile_from_args, quantize_from_args
from .models.presets import DEFAULT_MODEL


def graph_config(args: argparse.Namespace) -> Any:
    from .config import GraphConfig, parse_buckets, parse_resolutions

    return GraphConfig(batch_buckets=parse_buckets(args.batch_buckets),
                       resolutions=parse_resolutions(args.resolutions) if args.resolutions else (),
                       verify=getattr(args, "verify", False))


def compile_cache(args: argparse.Namespace) -> int:
    """diffgraph compile: an engine with the compile tier over an empty or partial cache at --out, every graph key
    prewarmed (compiled, then captured), then the folder and its size."""
    import time

    import torch

    from .engine.engine import Engine
    from .graphs.compiled import cache_dir, folder_bytes

    if not torch.cuda.is_available():
        raise ValueError("diffgraph compile needs a CUDA device: compiled code is made for the GPU that runs it")
    logging.getLogger("diffgraph").setLevel(logging.INFO)
    config = compile_from_args(args, cache_dir=args.out)
    quantize = quantize_from_args(args)
    t0 = time.perf_counter()
    with Engine(model=args.model or DEFAULT_MODEL, device="cuda", mode="graph", graphs=graph_config(args),
                compile=config, quantize=quantize) as engine:
        folder = cache_dir(config, engine.model, engine.runner.device)
        failed = [c.name for c in engine.runner.compiled if c.failed]
        stats = engine.stats
    print(f"compiled in {time.perf_counter() - t0:.0f} s into {folder}: {folder_bytes(folder) / 2**20:.1f} MiB "
          f"({stats['compiles']} graphs compiled, {stats['compile_loaded']} precompiled ones already there)"
          + (f"; fell back to uncompiled code: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def info(args: argparse.Namespace) -> int:
    from .engine.engine import Engine, default_device, parse_device
    from .quantize import weight_count

    cuda = parse_device(args.device or default_device()).type == "cuda"
    quantize = quantize_from_args(args)
    logging.getLogger("diffgraph").setLevel(logging.INFO)  # one line per captured graph
    with Engine(model=args.model or DEFAULT_MODEL, device=args.device, mode="graph" if cuda else "eager",
                graphs=graph_config(args), compile=compile_from_args(args), quantize=quantize) as engine:
        m = engine.model
        print(f"model {m.name}: family {m.family}, native {m.native_size}px, {m.dtype}, device {m.device}, "
              f"UNet {weight_count(m.denoiser) / 1e6:.1f}M parameters")
        print(f"tiers: compile {'on' if args.compile else 'off'}, quantize "
              + (engine.quantized.summary() if engine.quantized is not None else "none (16 bits)"))
        print(f"ready in {engine.ready_s:.1f} s (load and prewarm captures)")
        table = engine.graph_table()
        if not table:
            print("mode eager: CUDA graphs need a CUDA device")
            return 0
        print(f"{'kind':5} {'size':>9} {'bucket':>6} {'status':9} {'capture ms':>10} {'pool MiB':>9} {'replays':>7} "
              f"{'eager':>5} {'verify':>9}")
        for r in table:
            size = f"{r['width']}x{r['height']}" if r["height"] else "-"
            verify = "" if r["verify_max_abs"] is None else f"{r['verify_max_abs']:.2e}"
            print(f"{r['kind']:5} {size:>9} {r['bucket']:>6} {r['status']:9} {r['capture_ms']:10.0f} "
                  f"{r['pool_mib_added']:9.1f} {r['replays']:7d} {r['eager_fallbacks']:5d} {verify:>9}"
                  + (f"  {r['error']}" if r["error"] else ""))
        print(f"graph pool: {sum(r['pool_mib_added'] for r in table):.0f} MiB")
    return 0
