"""Model presets that need no files: architectures as diffusers configs, weights random or shipped.

`random:tiny` / `random:tiny-xl` are small SD1.5- / SDXL-architecture models for CPU tests (20 steps
at 64x64 in about a second); `random:sd15` / `random:sdxl` are the full-size true architectures with
random weights, for GPU timing (speed does not depend on weight values). Trained presets (`digits`,
`digits-xl`) are diffusers folders shipped inside the package; `shipped_preset_folder` maps their names
to the folder. Nothing here downloads anything, and importing this module loads neither torch nor
transformers (`diffgraph models` and `--help` read it).
"""

from __future__ import annotations

import dataclasses

import os
from dataclasses import dataclass
from typing import Any

from . import tokenizer as tok

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")

# The training noise schedule shared by SD1.x and SDXL (their scheduler_config.json).
SD_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "EulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "interpolation_type": "linear",
    "set_alpha_to_one": False,
    "clip_sample": False,
    "skip_prk_steps": True,
}


@dataclass(frozen=True)
class RandomPreset:
    """A random-initialised architecture: configs for each module, and the family it belongs to."""

    name: str
    family: str  # "sd" or "sdxl"
    description: str
    native_size: int
    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: tuple[dict[str, Any], ...]  # CLIPTextConfig kwargs; the SDXL second one has projection_dim
    tokenizer_pads: tuple[str, ...]


# the preset vocabulary's size and special ids, read once (not once per text-encoder config below)
_VOCAB_SIZE = tok.vocab_size()
_BOS_ID, _EOS_ID = tok.special_ids()


def _clip(hidden: int, layers: int, heads: int, inter: int, act: str = "quick_gelu", projection_dim: int | None = None,
          vocab: int | None = None) -> dict[str, Any]:
    cfg = dict(vocab_size=vocab or _VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
               hidden_act=act, bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_EOS_ID)
    if projection_dim is not None:
        cfg["projection_dim"] = projection_dim
    return cfg


_TINY_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, sample_size=64,
    block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.18215,
)

_SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, sample_size=512,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.18215,
)

RANDOM_PRESETS: dict[str, RandomPreset] = {
    "random:tiny": RandomPreset(
        name="random:tiny", family="sd", native_size=64,
        description="tiny SD1.5-architecture model, random weights (CPU tests; images are noise)",
        unet=dict(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32, attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        ),
        vae=_TINY_VAE,
        text_encoders=(_clip(32, 2, 4, 64),),
        tokenizer_pads=(tok.EOS,),
    ),
    "random:tiny-xl": RandomPreset(
        name="random:tiny-xl", family="sdxl", native_size=64,
        description="tiny SDXL-architecture model (two text encoders, pooled embeddings, time ids), random weights",
        unet=dict(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=64, attention_head_dim=(2, 4),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=32 + 6 * 8,
        ),
        vae={**_TINY_VAE, "force_upcast": True, "scaling_factor": 0.13025},
        text_encoders=(_clip(32, 2, 4, 64), _clip(32, 2, 4, 64, act="gelu", projection_dim=32)),
        tokenizer_pads=(tok.EOS, "!"),
    ),
    "random:sd15": RandomPreset(
        name="random:sd15", family="sd", native_size=512,
        description="full-size SD1.5 architecture (860M UNet), random weights, for GPU timing",
        unet=dict(
            sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        ),
        vae=_SD_VAE,
        text_encoders=(_clip(768, 12, 12, 3072, vocab=49408),),
        tokenizer_pads=(tok.EOS,),
    ),
    "random:sdxl": RandomPreset(
        name="random:sdxl", family="sdxl", native_size=1024,
        description="full-size SDXL base architecture (2.6B UNet), random weights, for GPU timing",
        unet=dict(
            sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(320, 640, 1280), cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        ),
        vae={**_SD_VAE, "sample_size": 1024, "force_upcast": True, "scaling_factor": 0.13025},
        text_encoders=(_clip(768, 12, 12, 3072, vocab=49408),
                       _clip(1280, 32, 20, 5120, act="gelu", projection_dim=1280, vocab=49408)),
        tokenizer_pads=(tok.EOS, "!"),
    ),
}

# 9-channel inpainting UNets (latents + mask + masked-image latents), as in SD's inpainting checkpoints
RANDOM_PRESETS.update({
    f"{base}-inpaint": dataclasses.replace(
        RANDOM_PRESETS[base], name=f"{base}-inpaint", unet={**RANDOM_PRESETS[base].unet, "in_channels": 9},
        description=f"{what} with a 9-channel inpainting UNet, random weights")
    for base, what in (("random:tiny", "tiny SD1.5 architecture"), ("random:tiny-xl", "tiny SDXL architecture"),
                       ("random:sd15", "full-size SD1.5 architecture"))})

# guidance-distilled UNets (LCM): the guidance scale is embedded (`time_cond_proj_dim`), one denoiser branch
RANDOM_PRESETS.update({
    f"{base}-lcm": dataclasses.replace(
        RANDOM_PRESETS[base], name=f"{base}-lcm", unet={**RANDOM_PRESETS[base].unet, "time_cond_proj_dim": 16},
        description=f"{what} with an LCM-style guidance embedding (time_cond_proj_dim), random weights")
    for base, what in (("random:tiny", "tiny SD1.5 architecture"), ("random:tiny-xl", "tiny SDXL architecture"))})

# Trained presets shipped as diffusers folders inside the package (see tools/train_digits.py).
SHIPPED_PRESETS: dict[str, str] = {
    "digits": "trained SD1.5-family model of handwritten digits (64x64), e.g. 'a handwritten digit seven'",
    "digits-xl": "trained SDXL-family model of handwritten digits (64x64), e.g. 'the number 7'",
    # listed and loadable only once its folder is in the package (tools/train_digits_zimage.py trains it on a GPU)
    "digits-zimage": "trained Z-Image-family model of handwritten digits (64x64), e.g. 'a handwritten digit seven'",
}


def _default_model() -> str:
    return "digits" if shipped_preset_folder("digits") is not None else "random:tiny"


def shipped_preset_folder(name: str) -> str | None:
    """The package folder of a shipped preset, or None when this install does not carry it."""
    folder = os.path.join(ASSETS, name)
    return folder if os.path.isfile(os.path.join(folder, "model_index.json")) else None


def builtin_lora_folder(model_name: str) -> str | None:
    """The package folder of a shipped preset's built-in LoRA adapters (tools/train_digits_lora.py), or None."""
    folder = os.path.join(ASSETS, "loras", model_name)
    if model_name in SHIPPED_PRESETS and os.path.isdir(folder) and any(
            f.endswith(".safetensors") for f in os.listdir(folder)):
        return folder
    return None


def builtin_control_folder(model_name: str) -> str | None:
    """The package folder of a shipped preset's built-in ControlNets (tools/train_digits_control.py), or None."""
    folder = os.path.join(ASSETS, "controlnets", model_name)
    return folder if model_name in SHIPPED_PRESETS and os.path.isdir(folder) else None


def available_presets() -> dict[str, str]:
    """Preset name -> one-line description, for `diffgraph models` and error messages."""
    out = {name: p.description for name, p in RANDOM_PRESETS.items()}
    for name, desc in SHIPPED_PRESETS.items():
        if shipped_preset_folder(name) is not None:
            out[name] = desc
    return out


# The default model of the CLI, the Engine and the server: the trained digits model when shipped.
DEFAULT_MODEL = _default_model()
