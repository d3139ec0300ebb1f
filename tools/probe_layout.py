"""Probe: does memory layout / cuDNN autotuning change the UNet step and the VAE decode on this GPU?

Times one CUDA-graph replay of the UNet (CFG batch) and one eager VAE decode for each variant:
NCHW (default), cudnn.benchmark, channels_last, both, both + fused QKV. Prints a table; the engine's
choice is recorded in BENCHMARKS.md.

    python3 tools/probe_layout.py            # on the GPU host
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from diffgraph.models.loader import load_model


def graph_ms(fn, iters=20, median=False):
    """Ms of one replay of `fn` captured in a CUDA graph (after warm-ups): the mean over `iters` back-to-back
    replays, or with `median` the median of `iters` replays timed one by one."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    if median:
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del g
        return statistics.median(times)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    del g
    return a.elapsed_time(b) / iters


def eager_ms(fn, iters=5):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def probe(name: str, size: int, cfg_batches: list[int]) -> None:
    m = load_model(name, device="cuda", dtype="fp16")
    unet, vae = m.unet, m.vae
    lat = size // 8
    emb_dim = unet.config.cross_attention_dim
    rows = []
    variants = [("nchw", False, False, False), ("bench", True, False, False), ("cl", False, True, False),
                ("cl+bench", True, True, False), ("cl+bench+qkv", True, True, True)]
    for vname, bench, cl, qkv in variants:
        torch.backends.cudnn.benchmark = bench
        if cl:
            unet.to(memory_format=torch.channels_last)
        if qkv:
            unet.fuse_qkv_projections()
        for b in cfg_batches:
            x = torch.randn(b, 4, lat, lat, device="cuda", dtype=torch.float16)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            t = torch.full((b,), 500.0, device="cuda")
            e = torch.randn(b, 77, emb_dim, device="cuda", dtype=torch.float16)
            added = None
            if m.family == "sdxl":
                added = {"text_embeds": torch.randn(b, 1280, device="cuda", dtype=torch.float16),
                         "time_ids": torch.randn(b, 6, device="cuda", dtype=torch.float16)}
            with torch.no_grad():
                ms = graph_ms(lambda: unet(x, t, encoder_hidden_states=e, added_cond_kwargs=added, return_dict=False))
            rows.append((f"{name} unet {vname}", b, ms))
            print(f"{name:12s} unet {vname:14s} cfg batch {b:3d}: {ms:8.2f} ms", flush=True)
        torch.cuda.empty_cache()
    if qkv:
        unet.unfuse_qkv_projections()
    # VAE decode, 1 image, in the dtype the engine uses (fp32 for SDXL, the upcast)
    vdtype = m.vae_dtype
    vae.to(vdtype)
    for vname, bench, cl in [("nchw", False, False), ("bench", True, False), ("cl", False, True), ("cl+bench", True, True)]:
        torch.backends.cudnn.benchmark = bench
        vae.to(memory_format=torch.channels_last if cl else torch.contiguous_format)
        for n in (1, 4):
            z = torch.randn(n, 4, lat, lat, device="cuda", dtype=vdtype)
            if cl:
                z = z.contiguous(memory_format=torch.channels_last)
            with torch.no_grad():
                ms = eager_ms(lambda: vae.decode(z, return_dict=False))
            print(f"{name:12s} vae {str(vdtype)[6:]} {vname:10s} images {n}: {ms:8.2f} ms", flush=True)
        torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False
    torch.cuda.empty_cache()


if __name__ == "__main__":
    which = sys.argv[1:] or ["sd15", "sdxl"]
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
    t0 = time.time()
    if "sd15" in which:
        probe("random:sd15", 512, [2, 8, 32])
    if "sdxl" in which:
        probe("random:sdxl", 1024, [2, 8])
    print(f"probe took {time.time() - t0:.0f} s")
