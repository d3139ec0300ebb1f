"""Would decoding beside the denoising pay? The UNet step and the VAE decode, each captured in a CUDA graph of its own
memory pool, replayed one after the other on one stream (what the engine does today: every graph shares one pool,
so they must never run at once) against the same replays on two streams at once.

    python3 tools/probe_overlap.py [--model random:sd15] [--size 512] [--step-rows 32] [--vae-bucket 4]
        [--steps 4] [--decodes 8] [--rounds 5] [--compile] [--json out.json]

One round: `steps` step replays at `step-rows` denoiser rows and `decodes` decode replays of `vae-bucket` images,
which at the defaults is one wave of a 4-step guidance-free burst at bucket 32 (4 steps of 32 images, their 32
decodes in VAE replays of 4). Serial: all on one stream; overlapped: the steps on one stream, the decodes on another.
The engine would need the VAE graphs in a pool of their own (`overlap_mem_mb`: the decode pool's size) and its
decodes on a side stream; this probe says first whether the GPU runs the two faster together. Without `--compile`,
the graph tier's layout (NCHW weights, eager kernels); with it, the compile tier's: the UNet's convolution weights as
its family chooses (`graph_setup.layout`), both compiled by Inductor in default mode (the engine's STEP_OPTIONS, and
for a 16-bit decoder VAE_OPTIONS, `force_layout_optimization`, with its group norms per channel), but for static
shapes (the engine marks the batch dynamic). Medians of `rounds`, CUDA events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.config import CompileConfig  # noqa: E402
from diffgraph.engine.graph_setup import STEP_OPTIONS, VAE_OPTIONS, layout, set_conv_layout  # noqa: E402
from diffgraph.graphs.group_norm import use_channel_group_norms  # noqa: E402
from diffgraph.models.loader import load_model  # noqa: E402


def capture(fn, pool) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    torch.cuda.synchronize()
    return graph


def timed(work, rounds: int) -> float:
    """Median ms of `work()` (which enqueues on any streams and joins them to the current one)."""
    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        work()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--step-rows", type=int, default=32)
    p.add_argument("--vae-bucket", type=int, default=4, help="a decode replay's images (the engine's VAE buckets: 1, 2, 4)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--decodes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    m = load_model(a.model, device="cuda", dtype="fp16")
    adapter, unet = m.adapter, m.unet
    decoder = adapter.decoder(m)
    if a.compile:
        set_conv_layout(unet, layout(CompileConfig(), adapter)[0])
    lat, b, v = a.size // 8, a.step_rows, a.vae_bucket
    x = torch.randn(b, 4, lat, lat, device="cuda", dtype=torch.float16)
    t = torch.full((b,), 500.0, device="cuda")
    ctx = torch.randn(b, 77, unet.config.cross_attention_dim, device="cuda", dtype=torch.float16)
    added = None
    if m.family == "sdxl":
        added = {"text_embeds": torch.randn(b, 1280, device="cuda", dtype=torch.float16),
                 "time_ids": torch.randn(b, 6, device="cuda", dtype=torch.float16)}
    z = torch.randn(v, 4, lat, lat, device="cuda", dtype=m.dtype)
    step_fn = lambda: unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added, return_dict=False)  # noqa: E731
    decode_fn = lambda: adapter.decode(m, decoder, z)  # noqa: E731
    if a.compile:
        step_fn = torch.compile(step_fn, options=STEP_OPTIONS)
        if m.vae_dtype != torch.float32:  # the engine's 16-bit decoder: its group norms per channel (group_norm.py)
            use_channel_group_norms(decoder)
        decode_fn = torch.compile(decode_fn, options=VAE_OPTIONS if m.vae_dtype != torch.float32 else None)
    with torch.no_grad():
        before = torch.cuda.memory_reserved()
        g_step = capture(step_fn, torch.cuda.graph_pool_handle())
        mid = torch.cuda.memory_reserved()
        g_vae = capture(decode_fn, torch.cuda.graph_pool_handle())
        after = torch.cuda.memory_reserved()
    s_step, s_vae = torch.cuda.Stream(), torch.cuda.Stream()

    def steps() -> None:
        for _ in range(a.steps):
            g_step.replay()

    def decodes() -> None:
        for _ in range(a.decodes):
            g_vae.replay()

    def serial() -> None:
        steps()
        decodes()

    def overlapped() -> None:
        here = torch.cuda.current_stream()
        for s, work in ((s_step, steps), (s_vae, decodes)):
            s.wait_stream(here)
            with torch.cuda.stream(s):
                work()
        here.wait_stream(s_step)
        here.wait_stream(s_vae)

    out = {"model": a.model, "size": a.size, "step_rows": b, "vae_bucket": v, "steps": a.steps,
           "decodes": a.decodes, "compile": a.compile, "vae_dtype": str(m.vae_dtype).removeprefix("torch."),
           "steps_ms": timed(steps, a.rounds), "decodes_ms": timed(decodes, a.rounds),
           "serial_ms": timed(serial, a.rounds), "overlapped_ms": timed(overlapped, a.rounds),
           "step_pool_mb": (mid - before) / 2**20, "overlap_mem_mb": (after - mid) / 2**20}
    out["gain"] = out["serial_ms"] / out["overlapped_ms"]
    print(f"{a.model} {a.size}x{a.size}{' compiled' if a.compile else ''}: {a.steps} steps at {b} rows "
          f"{out['steps_ms']:.1f} ms, {a.decodes} decodes of {v} ({out['vae_dtype']}) {out['decodes_ms']:.1f} ms; "
          f"serial {out['serial_ms']:.1f} ms, overlapped {out['overlapped_ms']:.1f} ms: {out['gain']:.3f}x "
          f"(the decode pool {out['overlap_mem_mb']:.0f} MiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
