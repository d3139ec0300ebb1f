"""The compile tier's VAE decode per image, by Inductor layout and bucket: the decoder compiled as the engine compiles
it (graphs/compiled.py `Compiled`, the batch dimension marked dynamic, which makes Inductor skip its channels-last
layout optimisation) against the same with `force_layout_optimization` (what the step's compile asks since session 9)
and with the decoder's convolution weights in channels-last memory too; each bucket captured in a CUDA graph of our
own and replayed. As in the engine, a batch of 1 runs the dynamic batch's precompiled version. `static`: a compile
per bucket (`CompileConfig(per_bucket=True)`: static shapes, Inductor's own layout choice; the other buckets' compiles
run in their warm-ups, outside `compile_s`). Also the largest difference of each variant's pixels from the first's
(same latents). `force_gn`: `force` with the decoder's group norms traced per channel first (graphs/group_norm.py; the
engine's since session 32, the statistics in one pass since session 33); `force_gn_cd`: that with Inductor's
coordinate-descent tuning of its own kernels.

    python3 tools/probe_vae_layout.py [--model random:sd15] [--size 512x512] [--buckets 1,2,4,8]
        [--variants dynamic,force,force_cl,static,force_at,force_gn,force_gn_cd] [--mode default]
        [--no-vae-upcast] [--repeats 20] [--kernels B] [--json out.json]

SDXL decodes in fp32 (its VAE config's force_upcast); `--no-vae-upcast` decodes it in fp16, as `--no-vae-upcast`
does for an fp16-safe VAE (sdxl-vae-fp16-fix): on a random preset the speed is what counts, not the pixels. The
engine asks for the layout only for 16-bit decoders (engine/graph_setup.py `VAE_OPTIONS`): the fp32 rows say
whether an fp32 decoder should too.

Each figure: the median of `repeats` replays timed one by one with CUDA events, after 3 warm-ups (probe_layout.py
`graph_ms`). `--kernels B`: where one decode of B images spends its device time, per variant (torch.profiler over one
call of the compiled decoder outside a graph: the same kernels), by category (convolutions, Inductor's fused code,
copies, ...; probe_fp8.py `split_kernels`) and the top kernels, in ms per image.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.config import CompileConfig, LoadOptions  # noqa: E402
from diffgraph.engine.graph_setup import set_conv_layout  # noqa: E402
from diffgraph.graphs.compiled import Compiled  # noqa: E402
from diffgraph.graphs.group_norm import ChannelGroupNorm  # noqa: E402
from diffgraph.models.loader import load_model  # noqa: E402
from probe_layout import graph_ms  # noqa: E402  (the probes' timer: one capture, replays)

VARIANTS = {  # name -> (Inductor options, convolution weights channels-last, a compile per bucket: static shapes)
    "dynamic": ({}, False, False),
    "force": ({"force_layout_optimization": True}, False, False),
    "force_cl": ({"force_layout_optimization": True}, True, False),
    "static": ({}, False, True),  # CompileConfig(per_bucket=True): Inductor's own choices for each batch
    # Inductor's GEMM / convolution templates benchmarked, without max-autotune-no-cudagraphs' coordinate-descent
    # tuning of every other kernel (the mode's longest part): what autotuning the convolutions alone buys, and costs
    "force_at": ({"force_layout_optimization": True, "max_autotune": True}, False, False),
    # the engine's: `force` with the group norms traced per channel first (graphs/group_norm.py)
    "force_gn": ({"force_layout_optimization": True}, False, False),
    # force_gn with Inductor's coordinate-descent tuning of its own (Triton) kernels' configs: the group norms' and
    # the pointwise code's, not the convolutions
    "force_gn_cd": ({"force_layout_optimization": True, "coordinate_descent_tuning": True}, False, False),
}


def replay_ms(fn, latents: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of one replay of `fn(latents)` captured in a CUDA graph (probe_layout.py's timer), and its output
    (one more call outside the graph: the same compiled kernels)."""
    static = latents.clone()
    ms = graph_ms(lambda: fn(static), repeats, median=True)
    return ms, fn(static).clone()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--size", default="512x512")
    p.add_argument("--buckets", default="1,2,4,8")
    p.add_argument("--variants", default="dynamic,force,force_cl")
    p.add_argument("--mode", default="default", help="Inductor mode (default, max-autotune-no-cudagraphs)")
    p.add_argument("--no-vae-upcast", action="store_true", help="decode an fp16 model in fp16 (SDXL upcasts)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernels", type=int, default=0, help="profile one decode of this many images per variant")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    buckets = [int(b) for b in a.buckets.split(",")]
    model = load_model(a.model, device="cuda", dtype="fp16",
                       options=LoadOptions(vae_upcast=False) if a.no_vae_upcast else None)
    adapter = model.adapter
    decoder = adapter.decoder(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lat = torch.randn((max(*buckets, a.kernels), 4, h // 8, w // 8), device="cuda", dtype=model.dtype, generator=gen)
    rows, first = [], {}
    dtype = str(adapter.vae_dtype(model)).removeprefix("torch.")

    def save() -> None:  # after every row: a run the call's time limit stops keeps what it measured
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"model": a.model, "size": a.size, "mode": a.mode, "vae_dtype": dtype, "rows": rows}, f,
                          indent=1)
    for name in a.variants.split(","):
        options, cl, per_bucket = VARIANTS[name]
        set_conv_layout(decoder, channels_last=cl)
        form = ChannelGroupNorm if name.startswith("force_gn") else torch.nn.GroupNorm
        for m in decoder.modules():  # nn.GroupNorm's own forward, or the per-channel form (`force_gn*`)
            if type(m) in (torch.nn.GroupNorm, ChannelGroupNorm):  # (a subclass keeps its own)
                m.__class__ = form
        torch._dynamo.reset()
        fn = Compiled(partial(adapter.decode, model, decoder), CompileConfig(mode=a.mode, per_bucket=per_bucket),
                      "the VAE decoder", lambda args: args[:1], folder=tempfile.mkdtemp(prefix=f"vae_{name}_"),
                      options=options)
        t0 = time.perf_counter()
        fn(lat[:max(buckets)])  # the dynamic batch's compile first, as the engine's prewarm does
        compile_s = time.perf_counter() - t0
        for b in buckets:
            ms, out = replay_ms(fn, lat[:b], a.repeats)
            diff = float((out.float() - first[b].float()).abs().max()) if b in first else 0.0
            first.setdefault(b, out)
            rows.append({"variant": name, "bucket": b, "ms": ms, "ms_per_image": ms / b, "max_diff": diff,
                         "compile_s": compile_s, "compiles": fn.compiles, "fallbacks": fn.fallbacks})
            print(f"{name} bucket {b}: {ms:.2f} ms, {ms / b:.2f} ms/image, max diff {diff:.4f} "
                  f"(compile {compile_s:.0f} s, {fn.compiles} compiles)", flush=True)
            save()
        if a.kernels:
            from probe_fp8 import _kernel_ms, split_kernels  # the GPU host's probes: diffgraph's Engine imported
            fn(lat[:a.kernels])
            split, top = split_kernels(_kernel_ms(lambda: fn(lat[:a.kernels])), top=14)
            per = {k: round(v / a.kernels, 3) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}
            rows.append({"variant": name, "kernels_of": a.kernels, "ms_per_image_by_kind": per,
                         "top_ms_per_image": [(k[:90], round(v / a.kernels, 3)) for k, v in top]})
            print(f"{name} kernels, {a.kernels} images, ms per image: {per}")
            for k, v in top:
                print(f"    {v / a.kernels:7.3f}  {k[:110]}")
            save()
    print(f"\n{a.model} {a.size} VAE decode in {dtype}, compile tier ({a.mode}), ms per image\n")
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print("| bucket | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for b in buckets:
        cells = [next((f"{r['ms_per_image']:.2f}" for r in rows if r["variant"] == n and r.get("bucket") == b), "")
                 for n in names]
        print(f"| {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
