"""What Inductor's max-autotune buys, read from its own benchmark tables (issue 33, item 3).

A cold autotuned start of SD1.5 runs longer than one 10-minute device call, so its engine figures may never arrive; its
log does. Under `max-autotune-no-cudagraphs` Inductor benchmarks every choice of every GEMM and convolution it lowers
and prints a table per op (`AUTOTUNE addmm(...)`, the choices' times, then a `Autotune Choices Stats` JSON line). This
script reads those tables from one or more logs (`tools/gpu_issue33.sh tiers` keeps them in `$OUT/tiers.full.log`),
counts how often each op's shape occurs in one call of the UNet (at the bucket's denoiser rows) and of the VAE decoder
(at the decode batch), traced on the meta device (no weights, no GPU), and prints per op and in total the kernel time
of the chosen kernels against the best ATen (cuBLAS / cuDNN) choice: what autotuning saves per step and per decode.

    python3 tools/autotune_gain.py LOG [LOG ...] --preset random:sd15 [--rows 32] [--decode 4]

Ops whose best ATen time is not among the printed choices (all of the top ten were Triton templates) count with the
slowest printed time as the ATen time: a lower bound on that op's saving, marked ">=".
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HEADER = re.compile(r"^AUTOTUNE (\w+)\((.*)\)$")


@dataclass(frozen=True)
class Tuned:
    """One autotuned op: its key (`op`, shape), the chosen kernel's time and the best ATen choice's (ms)."""

    op: str
    key: tuple[int, ...]
    chosen: str
    chosen_ms: float
    aten_ms: float
    aten_shown: bool  # False: ATen was not among the printed choices, aten_ms is a lower bound


def _key(op: str, shapes: list[list[int]]) -> tuple[int, ...]:
    """GEMMs by (batch..., M, K, N) of their last two operands; convolutions by input and weight shapes."""
    if op == "convolution":
        return tuple(shapes[0] + shapes[1])
    a, b = shapes[-2], shapes[-1]
    return tuple(a[:-1] + [a[-1], b[-1]])


def parse_log(text: str) -> list[Tuned]:
    lines = text.splitlines()
    found: list[Tuned] = []
    for i, line in enumerate(lines):
        if not line.startswith('{"num_choices"') or i + 1 >= len(lines):
            continue
        head = _HEADER.match(lines[i + 1])
        if head is None:
            continue
        stats = json.loads(line)
        shapes = [[int(d) for d in s.split("x")] for s in head.group(2).split(", ")]
        rows = []
        for row in lines[i + 4:]:
            if not row.startswith("  "):
                break
            name, ms = row.split()[:2]
            rows.append((name, float(ms)))
        aten = [ms for name, ms in rows if not name.startswith("triton")]
        chosen_ms = next((ms for name, ms in rows if name == stats["best_kernel"]), stats["best_time"])
        found.append(Tuned(head.group(1), _key(head.group(1), shapes), stats["best_kernel"], chosen_ms,
                           min(aten) if aten else max(ms for _, ms in rows), bool(aten)))
    return found


class _Counter(TorchDispatchMode):
    """Counts the GEMMs and convolutions one call dispatches, by `_key`."""

    OPS = {torch.ops.aten.mm.default: "mm", torch.ops.aten.addmm.default: "addmm",
           torch.ops.aten.bmm.default: "bmm", torch.ops.aten.convolution.default: "convolution"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple] = collections.Counter()  # (op name, *key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.OPS.get(func)
        if name is not None:
            tensors = [list(a.shape) for a in args[:3] if isinstance(a, torch.Tensor)]
            if name == "convolution" and tensors[1][2:] == [1, 1]:  # Inductor lowers a 1x1 convolution to a GEMM
                (b, c, h, w), o = tensors[0], tensors[1][0]
                self.counts[("addmm", b * h * w, c, o)] += 1
            else:
                self.counts[(name,) + _key(name, tensors[:2] if name == "convolution" else tensors)] += 1
        return func(*args, **(kwargs or {}))


def _lookup(counter: collections.Counter, t: Tuned) -> tuple:
    """`t`'s key in `counter`: a linear may be traced as mm or addmm, and Inductor may run one as a bmm against an
    expanded weight (the VAE's attention projections)."""
    keys = [(t.op, *t.key), ({"mm": "addmm", "addmm": "mm"}.get(t.op, t.op), *t.key)]
    if t.op == "bmm":
        b, m, k, n = t.key
        keys += [("mm", b * m, k, n), ("addmm", b * m, k, n)]
    return next((k for k in keys if counter.get(k)), keys[0])


def count_ops(preset: str, rows: int, decode: int) -> dict[str, collections.Counter]:
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from diffgraph.models.presets import RANDOM_PRESETS

    spec = RANDOM_PRESETS[preset]
    counts = {}
    with torch.device("meta"):
        unet = UNet2DConditionModel(**spec.unet).half()
        vae = AutoencoderKL(**{k: v for k, v in spec.vae.items() if k != "force_upcast"}).half()
        side = spec.unet["sample_size"]
        hidden = torch.empty(rows, 77, spec.unet["cross_attention_dim"], dtype=torch.half)
        extra = {}
        if spec.unet.get("addition_embed_type") == "text_time":
            pooled = spec.unet["projection_class_embeddings_input_dim"] - 6 * spec.unet["addition_time_embed_dim"]
            extra = {"added_cond_kwargs": {"text_embeds": torch.empty(rows, pooled, dtype=torch.half),
                                           "time_ids": torch.empty(rows, 6, dtype=torch.half)}}
        with torch.no_grad():
            with _Counter() as unet_counter:
                unet(torch.empty(rows, 4, side, side, dtype=torch.half), torch.empty(rows), hidden, **extra)
            with _Counter() as vae_counter:
                vae.decode(torch.empty(decode, 4, side, side, dtype=torch.half))
    counts["step"], counts["decode"] = unet_counter.counts, vae_counter.counts
    return counts


@dataclass
class Gain:
    """One part's autotuned ops weighted by their calls: ATen's time, the chosen kernels' time (ms), the Triton
    choices as (tuned op, calls), whether the ATen time is a lower bound, and the calls in no table, by op."""

    aten_ms: float
    chosen_ms: float
    triton: list[tuple[Tuned, int]]
    bound: bool
    untuned: dict[str, int]
    shapes: int


def gain(tuned: list[Tuned], counter: collections.Counter) -> Gain:
    seen: set = set()
    result = Gain(0.0, 0.0, [], False, {}, 0)
    for t in tuned:
        key = _lookup(counter, t)
        calls = counter.get(key, 0)
        if calls == 0 or key in seen:  # a shape tuned twice (other strides): its first table counts
            continue
        seen.add(key)
        result.aten_ms += calls * t.aten_ms
        result.chosen_ms += calls * t.chosen_ms
        result.bound |= not t.aten_shown
        if t.chosen.startswith("triton"):
            result.triton.append((t, calls))
    for key, calls in counter.items():
        if key not in seen:
            result.untuned[key[0]] = result.untuned.get(key[0], 0) + calls
    result.shapes = len(seen)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--preset", default="random:sd15")
    parser.add_argument("--rows", type=int, default=32, help="denoiser rows of the step's autotuned compile")
    parser.add_argument("--decode", type=int, default=4, help="the decoder's autotuned batch")
    args = parser.parse_args()
    tuned = [t for path in args.logs for t in parse_log(open(path).read())]
    counts = count_ops(args.preset, args.rows, args.decode)
    print(f"{len(tuned)} autotuned ops in {len(args.logs)} log(s); Triton chosen for "
          f"{sum(t.chosen.startswith('triton') for t in tuned)}")
    for part, counter in counts.items():
        g = gain(tuned, counter)
        print(f"\n{part}: op, calls per {part}, chosen kernel, chosen ms, best ATen ms, saved ms per {part}")
        for t, calls in g.triton:
            mark = "" if t.aten_shown else ">="
            print(f"  {t.op}{list(t.key)} x{calls}  {t.chosen}  {t.chosen_ms:.4f}  {mark}{t.aten_ms:.4f}  "
                  f"{mark}{calls * (t.aten_ms - t.chosen_ms):.3f}")
        untuned = ", ".join(f"{n} {op}" for op, n in g.untuned.items()) or "none"
        print(f"  calls not autotuned (in no table: attention's bmm runs as SDPA): {untuned}")
        print(f"  total over {g.shapes} shapes: ATen {g.aten_ms:.2f} ms, chosen {g.chosen_ms:.2f} ms, saved "
              f"{'>=' if g.bound else ''}{g.aten_ms - g.chosen_ms:.3f} ms "
              f"({(g.aten_ms - g.chosen_ms) / max(g.aten_ms, 1e-9):.1%} of these ops' time)")


if __name__ == "__main__":
    main()
