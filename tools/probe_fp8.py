"""A first look at fp8 linears on the GPU (issue 33): random:sd15's UNet in fp16 at a batch of 16 rows, 512x512,
eager and in one CUDA graph each, with the transformer linears of in_features >= --min-features in fp8
(diffgraph.quantize) against the 16-bit UNet: the forward's time (CUDA events, median of --reps) and the relative L2
error of its output, and whether the fp8 graph's replay equals its eager forward.

    python3 tools/probe_fp8.py [--rows 16] [--min-features 640]    # on the GPU host
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from diffgraph.models.loader import load_model
from diffgraph.quantize import quantize_linears, relative_error


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--min-features", type=int, default=640)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    model = load_model(args.preset, dev, "fp16")
    unet = model.unet.eval()
    q = copy.deepcopy(unet)
    report = quantize_linears(q, min_features=args.min_features)
    print(report.summary())
    g = torch.Generator(device=dev).manual_seed(0)
    size = 64 if "xl" not in args.preset else 128
    x = torch.randn(args.rows, unet.config.in_channels, size, size, device=dev, generator=g, dtype=torch.float16)
    t = torch.full((args.rows,), 500.0, device=dev)
    ctx = torch.randn(args.rows, 77, unet.config.cross_attention_dim, device=dev, generator=g, dtype=torch.float16)
    rows = []
    with torch.no_grad():
        ref = unet(x, t, ctx).sample
        out = q(x, t, ctx).sample
        for name, m in (("fp16", unet), ("fp8 linears", q)):
            eager = timed(lambda: m(x, t, ctx).sample, args.reps)
            graph, static = graphed(lambda: m(x, t, ctx).sample)
            replay = timed(graph.replay, args.reps)
            rows.append((name, eager, replay, relative_error(m(x, t, ctx).sample.float(), static.float())))
    print(f"relative L2 error of the fp8 UNet's output against fp16: {relative_error(ref.float(), out.float()):.4f}")
    print(f"{'UNet forward, ' + str(args.rows) + ' rows':24s} {'eager ms':>9s} {'graph ms':>9s} {'replay vs eager':>16s}")
    for name, eager, replay, err in rows:
        print(f"{name:24s} {eager:9.2f} {replay:9.2f} {err:16.2e}")
    print(f"fp8 / fp16 graph replay: {rows[1][2] / rows[0][2]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
