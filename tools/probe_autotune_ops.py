"""Inductor's max-autotune on a family's largest GEMMs and convolutions, one op at a time (issue 33, item 3).

A whole autotuned SDXL start needs far more than one device call; its step's time sits in a few shapes. This probe
traces the UNet on the meta device at `--rows` denoiser rows (tools/autotune_gain.py's counting), takes the `--top`
GEMM / convolution shapes by FLOPs per step (attention excluded: it runs as SDPA, which Inductor does not autotune),
and compiles each alone as the step has it (fp16, channels-last convolutions, a linear with or without its bias) under
`max-autotune-no-cudagraphs`. Inductor prints each op's table of choices; feed the log to tools/autotune_gain.py:

    python3 tools/probe_autotune_ops.py --preset random:sdxl --rows 16 --top 10 2>&1 | tee ops.log
    python3 tools/autotune_gain.py ops.log --preset random:sdxl --rows 16
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from autotune_gain import count_ops


def _flops(key: tuple, calls: int) -> int:
    if key[0] == "convolution":
        b, c, h, w, o, _, kh, kw = key[1:]
        return 2 * b * h * w * o * c * kh * kw * calls
    return 2 * key[1] * key[2] * key[3] * calls


def _op(key: tuple):
    """The op alone, its inputs on the GPU as the step has them."""
    dev, half = "cuda", torch.float16
    if key[0] == "convolution":
        b, c, h, w, o, _, kh, _ = key[1:]
        x = torch.randn(b, c, h, w, device=dev, dtype=half).to(memory_format=torch.channels_last)
        weight = torch.randn(o, c, kh, kh, device=dev, dtype=half).to(memory_format=torch.channels_last)
        return (lambda x, weight, bias: F.conv2d(x, weight, bias, padding=kh // 2)), (
            x, weight, torch.randn(o, device=dev, dtype=half))
    m, k, n = key[1:]
    x, weight = torch.randn(m, k, device=dev, dtype=half), torch.randn(n, k, device=dev, dtype=half) / k ** 0.5
    if key[0] == "mm":
        return (lambda x, weight: F.linear(x, weight)), (x, weight)
    return (lambda x, weight, bias: F.linear(x, weight, bias)), (x, weight, torch.randn(n, device=dev, dtype=half))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="random:sdxl")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    counts = count_ops(args.preset, args.rows, 1)["step"]
    shapes = sorted(((k, n) for k, n in counts.items() if k[0] != "bmm"), key=lambda kn: -_flops(*kn))
    total = sum(_flops(k, n) for k, n in shapes)
    covered = 0
    for key, calls in shapes[:args.top]:
        covered += _flops(key, calls)
        torch._dynamo.reset()
        fn, inputs = _op(key)
        start = time.perf_counter()
        with torch.no_grad():
            torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)(*inputs)
        torch.cuda.synchronize()
        print(f"probe {key} x{calls}: compiled and autotuned in {time.perf_counter() - start:.1f} s; "
              f"{covered / total:.1%} of the step's GEMM and convolution FLOPs so far", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
