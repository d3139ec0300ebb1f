"""`diffgraph compare --quantize fp8 --model M` and `diffgraph compare --step-cache SETTING --model M`: the command
line of bench/fp8_compare.py and bench/step_cache_quality.py (argparse and checks only: torch is imported when the
command runs, not for `--help`).

    diffgraph compare --quantize fp8 --model models/dreamshaper_8.safetensors --seeds 20
    diffgraph compare --quantize fp8 --model digits --min-features 64   (fp8 forced onto its small layers; the oracle)
    diffgraph compare --step-cache auto --model digits -o cache.png
    diffgraph compare --step-cache '{"method": "deepcache", "interval": 2, "branch": 1}' --model M

fp8: prints the fp8 report (layers quantised and skipped, MiB saved), the relative L2 error of one denoiser step
against 16 bits, the mean and max pixel difference of the final images over the seeds, and for the digits presets
the digits oracle's score of both tiers. Step cache: renders the same requests cached and uncached in one engine,
writes them side by side (per seed, uncached left of cached) to --output, and prints the full evaluations, the
share of the UNet a cached one skips, the mean and max pixel difference and for the digits presets both oracle
scores. Bad input is a ValueError, which cli.py prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

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
    p.add_argument("--step-cache", default=None, metavar="auto|JSON",
                   help="measure this step-cache setting against uncached instead of fp8 (as `generate --step-cache` "
                        "takes it: auto, or a JSON object such as '{\"method\": \"deepcache\", \"interval\": 3}')")
    p.add_argument("-o", "--output", default="compare-step-cache.png",
                   help="with --step-cache: the side-by-side image, per seed uncached left of cached "
                        "(default: compare-step-cache.png)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="the reference's dtype, fp16 or bf16 (default: fp16 on cuda, fp32 on "
                                                 "cpu)")


def run_compare(args: argparse.Namespace) -> int:
    if args.step_cache is not None and args.quantize is not None:
        raise ValueError("compare measures one thing: give --quantize fp8 or --step-cache SETTING, not both")
    if args.step_cache is None and parse_quantize(args.quantize or "none") != "fp8":
        raise ValueError("compare measures the fp8 tier against 16 bits: give --quantize fp8 (or a step cache "
                         "against uncached: --step-cache SETTING)")
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
    if args.step_cache is not None:
        return _compare_step_cache(args, size)
    quantize = quantize_from_args(args)
    from .bench.fp8_compare import compare_fp8

    load = checkpoint_options(args)
    result = compare_fp8(args.model, quantize, seeds=args.seeds, steps=args.steps, size=size, device=args.device,
                         dtype=args.dtype, guidance=args.guidance, prompt=args.prompt, load=load)
    print(result.format())
    return 0


def _step_cache_value(text: str) -> Any:
    """--step-cache as the request's `step_cache` value (a JSON object read)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--step-cache is not a JSON object: {e}") from None


def _compare_step_cache(args: argparse.Namespace, size: tuple[int, int] | None) -> int:
    setting = _step_cache_value(args.step_cache)
    from .bench.step_cache_quality import compare_step_cache

    result = compare_step_cache(args.model, setting, seeds=args.seeds, steps=args.steps, size=size,
                                device=args.device, dtype=args.dtype, guidance=args.guidance, prompt=args.prompt,
                                load=checkpoint_options(args))
    result.image.save(args.output)
    print(result.format())
    print(f"  side by side (per seed, uncached left of cached): {args.output}")
    return 0
