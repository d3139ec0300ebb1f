"""`diffgraph compare --quantize fp8 --model M`: the command line of bench/fp8_compare.py (argparse and checks only:
torch is imported when the command runs, not for `--help`).

    diffgraph compare --quantize fp8 --model models/dreamshaper_8.safetensors --seeds 20
    diffgraph compare --quantize fp8 --model digits --min-features 64   (fp8 forced onto its small layers; the oracle)

Prints the fp8 report (layers quantised and skipped, MiB saved), the relative L2 error of one denoiser step against
16 bits, the mean and max pixel difference of the final images over the seeds, and for the digits presets the
digits oracle's score of both tiers. Bad input is a ValueError, which cli.py prints as one line (exit 2).
"""

from __future__ import annotations

import argparse

from .cli_checks import check_devices
from .cli_flags import add_checkpoint_arguments, add_quantize_arguments, checkpoint_options, quantize_from_args
from .config import parse_quantize, parse_resolutions


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="preset, local diffusers folder or checkpoint file (.safetensors: SD1.x, SD2.x, SDXL), as "
                        "`generate --model` takes; your own checkpoint says more than random weights")
    add_checkpoint_arguments(p)
    add_quantize_arguments(p, min_features=("--min-features", "--quantize-min-features"))
    p.add_argument("--seeds", type=int, default=20, help="images per tier, one seed each (default: 20)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per image (default: 20)")
    p.add_argument("--size", default=None, metavar="WxH", help="image size (default: the model's native size)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--prompt", default=None,
                   help="one prompt for every seed (default: a few built-in ones; a digits preset's own digit "
                        "prompts, which the oracle scores)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="the reference's dtype, fp16 or bf16 (default: fp16 on cuda, fp32 on "
                                                 "cpu)")


def run_compare(args: argparse.Namespace) -> int:
    if parse_quantize(args.quantize or "none") != "fp8":
        raise ValueError("compare measures the fp8 tier against 16 bits: give --quantize fp8")
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be at least 1 (e.g. {flag} 20)")
    size = None
    if args.size is not None:
        sizes = parse_resolutions(args.size)
        if len(sizes) != 1:
            raise ValueError(f"--size {args.size!r}: give one size, WIDTHxHEIGHT (e.g. 512x512)")
        size = sizes[0][::-1]  # (width, height)
    check_devices(args)
    quantize = quantize_from_args(args)
    from .bench.fp8_compare import compare_fp8

    load = checkpoint_options(args)
    result = compare_fp8(args.model, quantize, seeds=args.seeds, steps=args.steps, size=size, device=args.device,
                         dtype=args.dtype, guidance=args.guidance, prompt=args.prompt, load=load)
    print(result.format())
    return 0
