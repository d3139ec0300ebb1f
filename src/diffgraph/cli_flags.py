"""Command-line flags shared by `diffgraph generate` and `diffgraph serve` (argparse only: nothing heavy is imported,
so `--help` stays fast)."""

from __future__ import annotations

import argparse


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """How the model's files are read (serve and generate): a VAE override, a single file's config folder, the
    prediction type and zero-SNR overrides."""
    p.add_argument("--vae", default=None, metavar="FILE_OR_DIR",
                   help="a VAE (.safetensors file or diffusers folder) in place of the model's, e.g. the fp16-safe "
                        "SDXL VAE")
    p.add_argument("--vae-upcast", default=None, action=argparse.BooleanOptionalAction,
                   help="decode in fp32 when the model runs in fp16 (default: the VAE config's force_upcast, which "
                        "SDXL's sets); --no-vae-upcast for an fp16-safe VAE given as a single file, e.g. "
                        "sdxl-vae-fp16-fix, whose file carries no config")
    p.add_argument("--model-config", default=None, metavar="DIR",
                   help="a checkpoint file's diffusers config folder (default: detected from the file's keys; "
                        "diffgraph writes the SD1.5, SD2, SDXL configs itself, nothing is downloaded)")
    p.add_argument("--prediction-type", default=None, choices=("epsilon", "v_prediction"),
                   help="what the model predicts (default: the model's scheduler config, or the checkpoint's marks; "
                        "SD2 checkpoints that do not say: v_prediction)")
    p.add_argument("--zero-snr", default=None, action=argparse.BooleanOptionalAction,
                   help="zero terminal SNR betas and trailing timesteps, as v-prediction / ztsnr fine-tunes train "
                        "(default: the model's, or the checkpoint's ztsnr mark)")
