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
from probe_layout import graph_ms  # noqa: E402  (one captured-graph timer for the probes)

ENDS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")


def main() -> None:
    engine = Engine("random:sd15", device="cuda", dtype="fp16", mode="eager")
    unet = engine.model.unet.eval()
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
            for k in (1, 4):  # one adapter per row (4 different ones in the batch), or a stack of 4 per row
                idx = (torch.arange(rows, device="cuda") % 4 + 1).view(rows, 1).repeat(1, k)
                ctx.set(idx, torch.ones((rows, k), device="cuda", dtype=torch.float16))
                ms = graph_ms(lambda: wrapped(x, t, encoder_hidden_states=cond, return_dict=False), iters=50)
                print(f"side path on {len(targets)} layers, max rank {rank}, {k} adapter(s) per row: {ms:.2f} ms = "
                      f"{ms / base:.3f}x", flush=True)
            ctx.set(None, None)
            ms = graph_ms(lambda: wrapped(x, t, encoder_hidden_states=cond, return_dict=False), iters=50)
            print(f"wrapped, no side path (rank {rank}): {ms:.2f} ms = {ms / base:.3f}x", flush=True)
            del wrapped, bank
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
