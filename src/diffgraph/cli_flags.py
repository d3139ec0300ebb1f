"""Command-line flags shared by `diffgraph generate`, `serve`, `info`, `compile`, `compare` and `bench throughput`
(argparse and the settings they make: nothing heavy is imported, so `--help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Any

from .config import (COMPILE_MODES, QUANTIZE_CHOICES, CompileConfig, LoadOptions, parse_compile_mode, parse_quantize,
                     quantize_argument)
from .settings import Setting


# the settings these flags set, declared once: ServerConfig's fields carry them (serve's flags and TOML keys), and
# the other commands add the same flags from them
CHECKPOINT_SETTINGS = {
    "vae": Setting(
        "a VAE (.safetensors file or diffusers folder) in place of the model's, e.g. the fp16-safe SDXL VAE",
        "model", engine="load", metavar="FILE_OR_DIR"),
    "text_encoder": Setting(
        "a split diffusion model's text-encoder file (ComfyUI's text_encoders/ file, e.g. qwen_3_4b.safetensors) in "
        "place of the one found beside it or named in its sidecar", "model", engine="load", metavar="FILE"),
    "tokenizer": Setting(
        "a split diffusion model's tokenizer folder, for one whose tokenizer diffgraph does not ship (FLUX.2 dev: the "
        "checkpoint's tokenizer/ folder, tokenizer.json and its config, or the diffusers folder holding it), in place "
        "of the one named in its sidecar; models that read no such folder leave it", "model", engine="load",
        metavar="DIR"),
    "vae_upcast": Setting(
        "decode in fp32 when the model runs in fp16 (default: the VAE config's force_upcast, which SDXL's sets); "
        "--no-vae-upcast for an fp16-safe VAE given as a single file, e.g. sdxl-vae-fp16-fix, whose file carries no "
        "config", "model", engine="load", action="bool"),
    "model_config": Setting(
        "a checkpoint file's diffusers config folder (default: detected from the file's keys; diffgraph writes the "
        "SD1.5, SD2, SDXL configs itself, nothing is downloaded)", "model", engine="load", metavar="DIR"),
    "prediction_type": Setting(
        "what the model predicts (default: the model's scheduler config, or the checkpoint's marks; SD2 checkpoints "
        "that do not say: v_prediction)", "model", engine="load", choices=("epsilon", "v_prediction")),
    "zero_snr": Setting(
        "zero terminal SNR betas and trailing timesteps, as v-prediction / ztsnr fine-tunes train (default: the "
        "model's, or the checkpoint's ztsnr mark)", "model", engine="load", action="bool"),
}
COMPILE_MODE = Setting(
    "with --compile: max-autotune-no-cudagraphs benchmarks Inductor's GEMM and convolution templates (a much longer "
    "first compile, kept in the compile cache; BENCHMARKS.md has what it buys); default: default",
    "graphs", engine="compile", metavar="|".join(COMPILE_MODES))
QUANTIZE = Setting(
    "fp8: the denoiser's transformer linears (attention projections, feed-forward) in fp8 with per-token activation "
    "scales, after LoRA fusing: less weight memory, not yet faster (README); `diffgraph compare --quantize fp8` "
    "measures what it costs your model (default: none, 16 bits)", "graphs", engine="quantize",
    metavar="|".join(QUANTIZE_CHOICES))
QUANTIZE_MIN_FEATURES = Setting(
    "with --quantize fp8: only linears of at least N inputs run in fp8 (default: 640; a bare fp8 matmul paid 1.5x at "
    "1280 on the H200, nothing at 320; the tiny digits presets need 64)", "graphs", engine="quantize", metavar="N")


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """How the model's files are read (serve and generate): a VAE override, a single file's config folder, the
    prediction type and zero-SNR overrides."""
    for name, s in CHECKPOINT_SETTINGS.items():
        s.add_to(p, name)


def checkpoint_options(args: argparse.Namespace) -> LoadOptions:
    """The checkpoint flags as the engine's LoadOptions (the paths checked)."""
    return LoadOptions(model_config=args.model_config, prediction_type=args.prediction_type, zero_snr=args.zero_snr,
                       vae=args.vae, vae_upcast=args.vae_upcast, text_encoder=args.text_encoder,
                       tokenizer=args.tokenizer)


def add_compile_mode_argument(p: argparse.ArgumentParser) -> None:
    """--compile-mode (with --compile): Inductor's mode for the compile tier's code."""
    COMPILE_MODE.add_to(p, "compile_mode")


def compile_from_args(args: argparse.Namespace, cache_dir: str | None = None) -> CompileConfig | bool:
    """`Engine(compile=)` from --compile, --compile-mode and a cache folder: False without --compile; a bad mode, or a
    mode without --compile, is a ValueError naming the flag."""
    mode = getattr(args, "compile_mode", None)
    if mode is not None:
        parse_compile_mode(mode)
        if not args.compile:
            raise ValueError("--compile-mode needs --compile (it chooses how the compile tier compiles)")
    return CompileConfig(cache_dir=cache_dir, mode=mode or "default") if args.compile else False


def add_quantize_arguments(p: argparse.ArgumentParser,
                           min_features: tuple[str, ...] | None = ("--quantize-min-features",)) -> None:
    """--quantize none|fp8 (default None: not given, so serve's TOML value stands) and the least input width of an
    fp8 layer under the flags `min_features` (None leaves it out)."""
    QUANTIZE.add_to(p, "quantize")
    if min_features:
        QUANTIZE_MIN_FEATURES.add_to(p, "quantize_min_features", int, flags=min_features)


def quantize_from_args(args: argparse.Namespace) -> Any:
    """`Engine(quantize=)` from the flags: None, "fp8" or an Fp8Config; a bad value is a
    ValueError naming its flag and the choices."""
    quantize = parse_quantize(args.quantize or "none")
    return quantize_argument(quantize, getattr(args, "quantize_min_features", None))


def quantize_error(message: str, toml: bool = False) -> str:
    """The engine's fp8 refusal (ParamError "quantize": no layer is wide enough) in the words of the command line
    (`toml`: serve's, whose setting may come from a TOML file too)."""
    flag = "--quantize-min-features (TOML quantize-min-features)" if toml else "--quantize-min-features"
    return message.replace("lower min_features or pass a wider select", f"lower {flag}")
