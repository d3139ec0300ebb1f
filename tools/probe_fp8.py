"""Where fp8 linears pay on the GPU (issue 33), in two parts, fp16 against fp8 side by side in one process:

  widths: one transformer linear of SD1.5 at 512x512 (a LayerNorm, then the Linear: what a block's projection sees),
          for each (tokens, in, out) the UNet runs, at a bucket of --rows images with CFG (2 denoiser rows each):
          its time in one CUDA graph, eager and (with --compile) compiled by Inductor then captured, as the compile
          tier does; so the table says from which width on fp8 pays, eager and fused.
  step:   a bucket-`--rows` step of the engine (rows / 2 images with CFG 7.5; the engine's CUDA step events,
          median over rounds), a 16-bit engine and an fp8 engine (`Engine(quantize=Fp8Config(min_features))`),
          each loading its own copy of the preset, in the graph tier or, with --compile, the compile tier; and the relative
          L2 error of one UNet output of the fp8 model against the 16-bit one; with --split, where a step's device
          time goes (convolutions, matmuls, fp8 matmuls, attention, Inductor's fused code, copies, other: eager
          elementwise kernels), from the profiles of a run of --steps steps and of a 1-step run.

          With --cse (compile tier), a third engine "fp8+cse": the fp8 engine with a post-grad pass that merges
          repeated pure ops (`QuantCse`), so an input that several fp8 linears read (self-attention's q, k and v) is
          quantised once: Inductor does not merge them itself (three amax reductions of one input, seen on the CPU).

  shared: how much of the per-token quantisation is of inputs already quantised (one eager UNet call of --preset at
          its native size, bf16, batch 2, on any device: each quantised input's storage and shape, kept alive so none
          is reused): what `QuantCse` could save at most.

    python3 tools/probe_fp8.py shared --preset random:sdxl         # on the CPU too (a few minutes for SDXL)
    python3 tools/probe_fp8.py widths [--compile]                  # on the GPU host
    python3 tools/probe_fp8.py step --preset random:sd15 [--compile] [--split] [--rows 16] [--min-features 640] [--cse]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_layout import graph_ms  # noqa: E402  (the probes' timer: one capture, replays)

from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402

from diffgraph import Engine, GraphConfig  # noqa: E402
from diffgraph.engine import graph_setup  # noqa: E402
from diffgraph.quantize import Fp8Config, Fp8Linear, relative_error  # noqa: E402

aten, prims = torch.ops.aten, torch.ops.prims
# ops with no side effect that the per-token quantisation is made of (and the views before it)
PURE = {aten.view.default, aten.reshape.default, aten.abs.default, aten.amax.default, aten.clamp_min.default,
        aten.clamp_max.default, aten.clamp.default, aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor,
        prims.convert_element_type.default, aten._to_copy.default}


def _frozen(a):
    if isinstance(a, (list, tuple)):
        return tuple(_frozen(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in a.items()))
    return a


class QuantCse(CustomGraphPass):
    """Inductor's post-grad pre-pass: a PURE op whose target and arguments equal an earlier one's is replaced by it
    (in graph order, so chains merge: view -> abs -> amax -> ... -> fp8 of one input, once). `removed` counts."""

    removed = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in PURE:
                continue
            key = (node.target, _frozen(node.args), _frozen(node.kwargs))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
                QuantCse.removed += 1
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "diffgraph-probe-quant-cse-1"

    def __repr__(self) -> str:  # stable: part of the compiled code's cache key
        return "QuantCse()"

# SD1.5's transformer linears at 512x512: (tokens a row, in_features, out_features); geglu's proj is out 2 x 4C
SD15_LINEARS = ((4096, 320, 320), (4096, 320, 2560), (4096, 1280, 320), (1024, 640, 640), (1024, 640, 5120),
                (1024, 2560, 640), (256, 1280, 1280), (256, 1280, 10240), (256, 5120, 1280))


def _compiled(fn):
    return torch.compile(fn, backend="inductor", dynamic=False, options={"triton.cudagraphs": False})


def widths(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    rows = 2 * args.rows
    print(f"{'tokens x in -> out (' + str(rows) + ' rows)':34s} {'fp16 ms':>8s} {'fp8 ms':>8s} {'fp8/fp16':>9s}"
          + (f" {'fp16 comp':>9s} {'fp8 comp':>9s} {'fp8/fp16':>9s}" if args.compile else ""))
    for tokens, k, n in SD15_LINEARS:
        x = torch.randn(rows, tokens, k, device=dev, dtype=torch.float16)
        norm = nn.LayerNorm(k).to(dev, torch.float16)
        lin = nn.Linear(k, n).to(dev, torch.float16)
        q = Fp8Linear.from_linear(lin)
        plain = [graph_ms(lambda m=m: m(norm(x))) for m in (lin, q)]
        line = f"{f'{tokens} x {k} -> {n}':34s} {plain[0]:8.3f} {plain[1]:8.3f} {plain[1] / plain[0]:9.3f}"
        if args.compile:
            fused = []
            for m in (lin, q):
                torch._dynamo.reset()  # the lambda's one code object would recompile past Dynamo's limit, then run eager
                fn = _compiled(lambda m=m: m(norm(x)))
                with torch.no_grad():
                    fn()
                fused.append(graph_ms(fn))
            line += f" {fused[0]:9.3f} {fused[1]:9.3f} {fused[1] / fused[0]:9.3f}"
        print(line)


# kernel name fragments -> the category a step's device time is split into (the first match wins)
KERNEL_KINDS = (("fp8 matmul", ("scaled_mm", "f8", "e4m3")), ("attention", ("flash", "fmha", "attention", "sdpa")),
                ("convolution", ("conv", "implicit", "dgrad", "wgrad", "nchw", "nhwc")),
                ("matmul", ("gemm", "cutlass", "xmma", "sm90", "matmul")), ("Inductor's fused code", ("triton",)))


def _kernel_ms(run) -> dict[str, float]:
    """Device milliseconds of each CUDA kernel (by name) over one `run()` (torch.profiler; a graph replay's kernels
    are recorded one by one)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if us:
            out[evt.key] = out.get(evt.key, 0.0) + us / 1000
    return out


def kernel_split(run, steps: int, top: int = 6) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Where one denoising step's device time goes: the kernels of `run(steps)` minus those of `run(1)` (the text
    encoders, the VAE decode and the first step cancel), divided by steps - 1, summed by category (KERNEL_KINDS);
    and the `top` kernels by time."""
    many, one = _kernel_ms(lambda: run(steps)), _kernel_ms(lambda: run(1))
    return split_kernels({k: (v - one.get(k, 0.0)) / (steps - 1) for k, v in many.items()}, top)


def split_kernels(per: dict[str, float], top: int = 6) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Kernel ms by name -> ms by category (KERNEL_KINDS; copies apart) and the `top` kernels by time."""
    split: dict[str, float] = {}
    for name, ms in per.items():
        low = name.lower()
        # Inductor names a kernel after every op fused into it: a group norm fused with a convolution's bias is
        # "triton_..._convolution_native_group_norm_...", Inductor's code, not a convolution
        kind = "Inductor's fused code" if low.startswith("triton") else next(
            (k for k, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")
        if "memcpy" in low or "memset" in low:
            kind = "copies"
        split[kind] = split.get(kind, 0.0) + ms
    return split, sorted(per.items(), key=lambda kv: -kv[1])[:top]


def step(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    size = args.size or (1024 if "xl" in args.preset else 512)
    graphs = GraphConfig(batch_buckets=(args.rows,), resolutions=((size, size),))
    engines = {"16-bit": Engine(args.preset, device="cuda", graphs=graphs, compile=args.compile),
               "fp8": Engine(args.preset, device="cuda", graphs=graphs, compile=args.compile,
                             quantize=Fp8Config(min_features=args.min_features))}
    print(engines["fp8"].quantized.summary())
    if args.cse and args.compile:
        options = graph_setup.STEP_OPTIONS
        graph_setup.STEP_OPTIONS = {**options, "post_grad_custom_pre_pass": QuantCse()}
        try:
            engines["fp8+cse"] = Engine(args.preset, device="cuda", graphs=graphs, compile=True,
                                        quantize=Fp8Config(min_features=args.min_features))
        finally:
            graph_setup.STEP_OPTIONS = options
        print(f"fp8+cse: {QuantCse.removed} repeated ops merged in the step's graphs")
    with torch.no_grad():  # one UNet output of each engine's model (each loaded its own copy of the preset)
        unet, fp8_unet = engines["16-bit"].model.denoiser, engines["fp8"].model.denoiser
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(2, unet.config.in_channels, size // 8, size // 8, device=dev, generator=g, dtype=torch.float16)
        t = torch.full((2,), 500.0, device=dev)
        ctx = torch.randn(2, 77, unet.config.cross_attention_dim, device=dev, generator=g, dtype=torch.float16)
        kw = {}
        if unet.config.addition_embed_type == "text_time":
            kw["added_cond_kwargs"] = {"text_embeds": torch.randn(2, 1280, device=dev, dtype=torch.float16),
                                       "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * 2, device=dev,
                                                                dtype=torch.float16)}
        err = relative_error(unet(x, t, ctx, **kw).sample.float(), fp8_unet(x, t, ctx, **kw).sample.float())

    def batch(e: Engine, steps: int | None = None) -> float:
        reqs = [e.make_request("a cat", seed=i, num_inference_steps=steps or args.steps, guidance_scale=7.5,
                               height=size, width=size) for i in range(args.rows // 2)]  # CFG: 2 rows an image
        e.core.step_events = []
        futures: list = []
        e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
        for f in futures:
            f.result()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(t) for s, t, _ in e.core.step_events)

    for e in engines.values():  # warm: captures and compiles happen here
        batch(e)
    times = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            times[name].append(batch(e))
    splits = {name: kernel_split(lambda n, e=e: batch(e, n), args.steps) for name, e in engines.items()} if args.split else {}
    for e in engines.values():
        e.close()
    tier = "compile" if args.compile else "graph"
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{args.preset} {size}x{size}, bucket {args.rows} ({args.rows // 2} images with CFG), {tier} tier, "
          f"min_features {args.min_features}; UNet output's relative L2 error fp8 vs 16-bit: {err:.4f}")
    print(f"{'step':10s} {'ms':>8s} {'ratio':>7s}   rounds")
    for name, v in med.items():
        print(f"{name:10s} {v:8.2f} {v / med['16-bit']:7.3f}   {' '.join(f'{r:.2f}' for r in times[name])}")
    if splits:
        kinds = sorted({k for sp, _ in splits.values() for k in sp}, key=lambda k: -splits["16-bit"][0].get(k, 0.0))
        print(f"{'device ms per step':24s} " + " ".join(f"{n:>8s}" for n in splits))
        for k in kinds + ["total"]:
            print(f"{k:24s} " + " ".join(f"{(sum(sp.values()) if k == 'total' else sp.get(k, 0.0)):8.2f}"
                                          for sp, _ in splits.values()))
        for name, (_, top) in splits.items():
            print(f"{name} top kernels: " + "; ".join(f"{k[:60]} {ms:.2f}" for k, ms in top))


def shared(args: argparse.Namespace) -> None:
    import diffgraph.quantize.fp8 as fp8
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    seen: list[torch.Tensor] = []  # every quantised input, kept: a freed one's storage could be reused by the next
    real = fp8.quantize_rows

    def recording(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x2d)
        return real(x2d)

    fp8.quantize_rows = recording
    with Engine(args.preset, device=dev, dtype="bf16", mode="eager", quantize=Fp8Config(args.min_features)) as e:
        unet = e.model.denoiser
        size = args.size or e.info.native_size
        x = torch.zeros(2, unet.config.in_channels, size // 8, size // 8, dtype=torch.bfloat16, device=dev)
        ctx = torch.zeros(2, 77, unet.config.cross_attention_dim, dtype=torch.bfloat16, device=dev)
        kw = {}
        if unet.config.addition_embed_type == "text_time":
            kw["added_cond_kwargs"] = {"text_embeds": torch.zeros(2, 1280, dtype=torch.bfloat16, device=dev),
                                       "time_ids": torch.zeros(2, 6, dtype=torch.bfloat16, device=dev)}
        with torch.no_grad():
            unet(x, torch.full((2,), 500.0, device=dev), encoder_hidden_states=ctx, **kw)
    fp8.quantize_rows = real
    total = sum(t.numel() for t in seen)
    distinct = {(t.data_ptr(), tuple(t.shape)): t.numel() for t in seen}
    print(f"{args.preset} {size}x{size}: {len(seen)} quantisations of {len(distinct)} distinct inputs; "
          f"{total / 1e6:.1f}M elements quantised, {sum(distinct.values()) / 1e6:.1f}M distinct "
          f"({1 - sum(distinct.values()) / total:.1%} of the quantisation's work repeats an earlier one)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("widths", "step", "shared"))
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--rows", type=int, default=16,
                   help="the bucket: denoiser rows a step runs (widths: the images; step: 2 rows an image, CFG)")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-features", type=int, default=640)
    p.add_argument("--compile", action="store_true", help="Inductor's code, captured in the graphs")
    p.add_argument("--split", action="store_true", help="step: also each engine's device time per kernel category")
    p.add_argument("--cse", action="store_true", help="step, with --compile: also an fp8 engine whose step graphs "
                   "quantise an input shared by several linears once (QuantCse)")
    args = p.parse_args()
    with torch.no_grad():
        {"widths": widths, "step": step, "shared": shared}[args.part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
