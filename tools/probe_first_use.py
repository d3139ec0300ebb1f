"""Probe: the per-shape first-use cost of a UNet forward, and the SDPA backend behind most of it.

The cold-start breakdown of `bench latency` shows ~0.8 s for the first warm-up iteration of every SD1.5
step bucket (a step is 12-95 ms). Profiled (session 3), a first forward spends half its CPU time building
cuDNN attention graphs (aten::_cudnn_attention_forward) and a quarter in cuDNN convolution plans; running
first forwards from threads does not help (the plan caches are per thread). This probe compares the SDPA
backends per model: the first forward of a new shape, and the graph-replay time of the UNet and the VAE.

    python3 tools/probe_first_use.py            # on the GPU host
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
from probe_layout import graph_ms  # noqa: E402

from diffgraph.models.loader import load_model  # noqa: E402


def unet_call(m, batch: int, lat: int):
    unet = m.unet
    x = torch.randn(batch, 4, lat, lat, device="cuda", dtype=torch.float16)
    ctx = torch.randn(batch, 77, unet.config.cross_attention_dim, device="cuda", dtype=torch.float16)
    t = torch.full((batch,), 500.0, device="cuda")
    added = None
    if m.family == "sdxl":
        added = {"text_embeds": torch.randn(batch, 1280, device="cuda", dtype=torch.float16),
                 "time_ids": torch.randn(batch, 6, device="cuda", dtype=torch.float16)}
    return lambda: unet(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added, return_dict=False)


def first_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def probe(name: str, lat: int, replay_batches: list[int]) -> None:
    m = load_model(name, device="cuda", dtype="fp16")
    first_ms(unet_call(m, 2, lat))  # context, handles, the first kernels: not part of any backend's figure
    for i, (bname, backend) in enumerate(BACKENDS.items()):
        new = 2 * (i + 2) + 1  # a batch no backend has run before: its first forward pays every per-shape cost
        with sdpa_kernel([backend]):
            first = first_ms(unet_call(m, new, lat))
            second = first_ms(unet_call(m, new, lat))
            replays = []
            for b in replay_batches:
                fn = unet_call(m, b, lat)
                with torch.no_grad():
                    replays.append(graph_ms(fn))
        print(f"{name:12s} sdpa {bname:9s} new shape (CFG batch {new}): first {first:6.0f} ms, second "
              f"{second:5.0f} ms | replay ms at CFG batch " + ", ".join(
                  f"{b}: {ms:.2f}" for b, ms in zip(replay_batches, replays)), flush=True)
        torch.cuda.empty_cache()
    # which backend the default choice takes for this model's shapes
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first_ms(unet_call(m, 2, lat))
    names = sorted({e.key for e in prof.key_averages() if "attention" in e.key or "flash" in e.key})
    print(f"{name:12s} default SDPA ops: {names}")
    vae = m.vae.to(m.vae_dtype)
    for bname, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                z = torch.randn(1, 4, lat, lat, device="cuda", dtype=m.vae_dtype)
                with torch.no_grad():
                    ms = graph_ms(lambda: vae.decode(z, return_dict=False))
            print(f"{name:12s} vae {str(m.vae_dtype)[6:]} sdpa {bname:9s} 1 image replay {ms:.2f} ms", flush=True)
        except RuntimeError as e:  # a backend that does not take this dtype (flash: no fp32)
            print(f"{name:12s} vae sdpa {bname}: not available ({str(e).splitlines()[0][:80]})")
    del m
    torch.cuda.empty_cache()


def main() -> None:
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    probe("random:sd15", 64, [2, 8, 32])
    probe("random:sdxl", 128, [2, 8])


if __name__ == "__main__":
    main()
