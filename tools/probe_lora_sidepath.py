"""Probe (issue 12 design): what the per-row LoRA side path (diffgraph.lora.sidepath, gather + einsum per layer)
costs in a full SD1.5 UNet step at bucket 16 (CFG batch 32, 512x512, fp16), captured in a CUDA graph, against the
plain UNet; rows use 4 different adapters, on the attention and feed-forward projections, at max ranks 16 and 64.

    python3 tools/probe_lora_sidepath.py      # on the GPU host; prints one line per case
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

sys.path.insert(0, "src")
sys.path.insert(0, "tools")

from diffgraph import Engine  # noqa: E402
from diffgraph.lora.sidepath import RowLoras, attach  # noqa: E402
from probe_layout import eager_ms, graph_ms  # noqa: E402  (the probes' timers)

ENDS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")


SHAPES = [(32, 4096, 320, 320), (32, 4096, 320, 2560), (32, 4096, 1280, 320), (32, 1024, 640, 640),
          (32, 1024, 640, 5120), (32, 1024, 2560, 640), (32, 256, 1280, 1280), (32, 256, 1280, 10240),
          (32, 256, 5120, 1280)]  # (rows, tokens, in, out) of SD1.5's targeted layers at bucket 16, 512x512
CONFIGS = [None, (128, 128, 64, 3, 8), (128, 64, 64, 3, 4), (128, 64, 64, 4, 4), (64, 128, 64, 3, 4),
           (128, 128, 32, 4, 8), (256, 64, 64, 3, 8)]


def shapes(rank: int = 16) -> None:
    """Per layer shape: cuBLAS linear alone, unfused side path, and the fused kernel per tile config."""
    from diffgraph.lora import kernels

    for n, length, n_in, n_out in SHAPES:
        x = torch.randn((n, length, n_in), device="cuda", dtype=torch.float16)
        w = torch.randn((n_out, n_in), device="cuda", dtype=torch.float16) * 0.02
        bias = torch.zeros(n_out, device="cuda", dtype=torch.float16)
        a = torch.randn((9, rank, n_in), device="cuda", dtype=torch.float16) * 0.02
        b = torch.randn((9, rank, n_out), device="cuda", dtype=torch.float16) * 0.02
        idx = (torch.arange(n, device="cuda") % 4 + 1).view(n, 1)
        scale = torch.ones((n, 1), device="cuda")
        base = eager_ms(lambda: torch.nn.functional.linear(x, w, bias), iters=30)
        cells = [f"linear {base:.3f} ms"]
        for config in CONFIGS:
            try:
                ms = eager_ms(lambda: kernels.lora_linear(x, w, bias, a, b, idx, scale, config=config), iters=30)
                cells.append(f"{config or 'default'} {ms / base:.2f}x")
            except Exception as e:  # a config the GPU cannot run (shared memory)
                cells.append(f"{config} failed: {type(e).__name__}")
        print(f"{(n, length, n_in, n_out)}: " + " | ".join(cells), flush=True)


def main() -> None:
    shapes()
    engine = Engine("random:sd15", device="cuda", dtype="fp16", mode="eager")
    unet = engine.model.denoiser.eval()
    rows = 32
    x = torch.randn((rows, 4, 64, 64), device="cuda", dtype=torch.float16)
    t = torch.full((rows,), 500, device="cuda")
    cond = torch.randn((rows, 77, 768), device="cuda", dtype=torch.float16)
    with torch.no_grad():
        base = graph_ms(lambda: unet(x, t, encoder_hidden_states=cond, return_dict=False), iters=50)
        print(f"plain UNet, batch {rows}: {base:.2f} ms", flush=True)
        for rank in (16, 64):
            wrapped = copy.deepcopy(unet)
            targets = [n for n, m in wrapped.named_modules() if n.endswith(ENDS) and isinstance(m, (nn.Linear, nn.Conv2d))]
            ctx = RowLoras()
            bank = attach(wrapped, targets, slots=8, max_rank=rank, rows=ctx)
            for layer in bank.layers.values():
                layer.a.normal_(std=0.01)
                layer.b.normal_(std=0.01)
            layers = [m for m in wrapped.modules() if hasattr(m, "fused")]
            for k in (1, 4):  # one adapter per row (4 different ones in the batch), or a stack of 4 per row
                idx = (torch.arange(rows, device="cuda") % 4 + 1).view(rows, 1).repeat(1, k)
                ctx.set(idx, torch.ones((rows, k), device="cuda", dtype=torch.float16))
                outs = {}
                for fused in (False, True):
                    for m in layers:
                        m.fused = fused
                    ms = graph_ms(lambda: wrapped(x, t, encoder_hidden_states=cond, return_dict=False), iters=50)
                    outs[fused] = wrapped(x, t, encoder_hidden_states=cond, return_dict=False)[0].float()
                    print(f"side path on {len(targets)} layers ({'fused kernel' if fused else 'bmm'}), max rank "
                          f"{rank}, {k} adapter(s) per row: {ms:.2f} ms = {ms / base:.3f}x", flush=True)
                print(f"  fused vs bmm output max abs {(outs[True] - outs[False]).abs().max().item():.3g} "
                      f"(output max abs {outs[False].abs().max().item():.3g})", flush=True)
            ctx.set(None, None)
            ms = graph_ms(lambda: wrapped(x, t, encoder_hidden_states=cond, return_dict=False), iters=50)
            print(f"wrapped, no side path (rank {rank}): {ms:.2f} ms = {ms / base:.3f}x", flush=True)
            del wrapped, bank
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
