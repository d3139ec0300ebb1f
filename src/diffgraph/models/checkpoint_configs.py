"""The diffusers config folders that single-file checkpoints are read with, written here, never downloaded.

diffusers' `from_single_file` needs a diffusers config folder for the pipeline it builds; without one it downloads
it, even offline. This module holds the published configs of the architectures AUTOMATIC1111 and
ComfyUI checkpoints come in, transcribed from their diffusers repositories: SD1.5 (runwayml/stable-diffusion-v1-5),
SD2-base (stabilityai/stable-diffusion-2-1-base: 512, epsilon), SD2 (stabilityai/stable-diffusion-2-1: 768,
v-prediction), SDXL base (stabilityai/stable-diffusion-xl-base-1.0) and the 9-channel inpainting variants
(runwayml/stable-diffusion-inpainting, stabilityai/stable-diffusion-2-inpainting,
diffusers/stable-diffusion-xl-1.0-inpainting-0.1). Their text encoders keep `eos_token_id: 2` as shipped (then
transformers pools at the highest token id, CLIP's end-of-text token). Tokenizer folders come from CLIP's real
vocabulary (`clip_vocab.py`). `config_folder(kind, cache_root)` writes one folder per kind once (to a temporary
name, then renamed into place) and returns it. Standard library only: `diffgraph models` lists kinds without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from . import clip_vocab

_EOS = "<|endoftext|>"

_BETAS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
          "trained_betas": None, "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1}

_SCHEDULERS: dict[str, dict[str, Any]] = {
    "sd1": {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "prediction_type": "epsilon"},
    "sd2-base": {"_class_name": "PNDMScheduler", **_BETAS, "skip_prk_steps": True, "prediction_type": "epsilon"},
    "sd2-v": {"_class_name": "DDIMScheduler", **_BETAS, "skip_prk_steps": True, "prediction_type": "v_prediction"},
    "sdxl-base": {"_class_name": "EulerDiscreteScheduler", **_BETAS, "skip_prk_steps": True, "prediction_type": "epsilon",
             "interpolation_type": "linear", "sample_max_value": 1.0, "timestep_spacing": "leading",
             "use_karras_sigmas": False},
}

_UNET_COMMON = {"_class_name": "UNet2DConditionModel", "act_fn": "silu", "center_input_sample": False,
                "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
                "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
                "out_channels": 4}
_SD_BLOCKS = {"block_out_channels": [320, 640, 1280, 1280],
              "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                   "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
_UNETS: dict[str, dict[str, Any]] = {
    "sd1": {**_UNET_COMMON, **_SD_BLOCKS, "attention_head_dim": 8, "cross_attention_dim": 768, "sample_size": 64},
    "sd2-base": {**_UNET_COMMON, **_SD_BLOCKS, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
                 "use_linear_projection": True, "upcast_attention": False, "sample_size": 64},
    "sd2-v": {**_UNET_COMMON, **_SD_BLOCKS, "attention_head_dim": [5, 10, 20, 20], "cross_attention_dim": 1024,
              "use_linear_projection": True, "upcast_attention": True, "sample_size": 96},
    "sdxl-base": {**_UNET_COMMON, "block_out_channels": [320, 640, 1280],
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
             "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048, "transformer_layers_per_block": [1, 2, 10],
             "use_linear_projection": True, "upcast_attention": None, "addition_embed_type": "text_time",
             "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
             "projection_class_embeddings_input_dim": 2816, "sample_size": 128},
}

_VAE = {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32}
_VAES: dict[str, dict[str, Any]] = {
    "sd1": {**_VAE, "sample_size": 512, "scaling_factor": 0.18215},
    "sd2-base": {**_VAE, "sample_size": 512, "scaling_factor": 0.18215},
    "sd2-v": {**_VAE, "sample_size": 768, "scaling_factor": 0.18215},
    "sdxl-base": {**_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
}


def _clip_text(hidden: int, layers: int, heads: int, inter: int, act: str, projection: int,
               cls: str = "CLIPTextModel") -> dict[str, Any]:
    return {"architectures": [cls], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2,
            "hidden_act": act, "hidden_size": hidden, "initializer_factor": 1.0, "initializer_range": 0.02,
            "intermediate_size": inter, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
            "model_type": "clip_text_model", "num_attention_heads": heads, "num_hidden_layers": layers,
            "pad_token_id": 1, "projection_dim": projection, "vocab_size": 49408}


_CLIP_L = _clip_text(768, 12, 12, 3072, "quick_gelu", 768)
_OPEN_CLIP_H = _clip_text(1024, 23, 16, 4096, "gelu", 512)  # diffusers keeps 23 of its 24 layers (SD2's penultimate)
_OPEN_CLIP_BIGG = _clip_text(1280, 32, 20, 5120, "gelu", 1280, cls="CLIPTextModelWithProjection")

# kind -> (base architecture, pipeline class, inpainting)
KINDS: dict[str, tuple[str, str, bool]] = {
    "sd1": ("sd1", "StableDiffusionPipeline", False),
    "sd1-inpaint": ("sd1", "StableDiffusionInpaintPipeline", True),
    "sd2-base": ("sd2-base", "StableDiffusionPipeline", False),
    "sd2-v": ("sd2-v", "StableDiffusionPipeline", False),
    "sd2-inpaint": ("sd2-base", "StableDiffusionInpaintPipeline", True),
    "sdxl-base": ("sdxl-base", "StableDiffusionXLPipeline", False),
    "sdxl-inpaint": ("sdxl-base", "StableDiffusionXLInpaintPipeline", True),
}
DESCRIPTIONS = {
    "sd1": "SD1.x (512, epsilon)", "sd1-inpaint": "SD1.x inpainting (9-channel UNet)",
    "sd2-base": "SD2.x base (512, epsilon)", "sd2-v": "SD2.x (768, v-prediction)",
    "sd2-inpaint": "SD2.x inpainting (512, epsilon, 9-channel UNet)", "sdxl-base": "SDXL base (1024, epsilon)",
    "sdxl-inpaint": "SDXL inpainting (1024, epsilon, 9-channel UNet)",
}


def folder_files(kind: str) -> dict[str, Any]:
    """The JSON files of a kind's config folder (relative path -> content), tokenizers aside."""
    base, pipeline, inpaint = KINDS[kind]
    unet = {**_UNETS[base], "in_channels": 9 if inpaint else 4}
    files: dict[str, Any] = {"scheduler/scheduler_config.json": _SCHEDULERS[base], "unet/config.json": unet,
                             "vae/config.json": _VAES[base]}
    index: dict[str, Any] = {"_class_name": pipeline, "_diffusers_version": "0.30.0",
                             "scheduler": ["diffusers", _SCHEDULERS[base]["_class_name"]],
                             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
                             "text_encoder": ["transformers", "CLIPTextModel"],
                             "tokenizer": ["transformers", "CLIPTokenizer"]}
    if base == "sdxl-base":
        files["text_encoder/config.json"] = _CLIP_L
        files["text_encoder_2/config.json"] = _OPEN_CLIP_BIGG
        index.update(text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
                     tokenizer_2=["transformers", "CLIPTokenizer"], force_zeros_for_empty_prompt=True)
        if inpaint:
            index["requires_aesthetics_score"] = False
    else:
        files["text_encoder/config.json"] = _OPEN_CLIP_H if base.startswith("sd2") else _CLIP_L
        index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    files["model_index.json"] = index
    return files


def tokenizer_pads(kind: str) -> dict[str, str]:
    """Tokenizer subfolder -> its pad token: SD2's tokenizer and SDXL's second pad with "!" as diffusers' do."""
    base = KINDS[kind][0]
    if base == "sdxl-base":
        return {"tokenizer": _EOS, "tokenizer_2": "!"}
    return {"tokenizer": "!" if base.startswith("sd2") else _EOS}


def config_folder(kind: str, cache_root: str) -> str:
    """The kind's config folder under `cache_root` (written once; concurrent writers race harmlessly)."""
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; one of {', '.join(KINDS)}")
    files, pads = folder_files(kind), tokenizer_pads(kind)
    digest = hashlib.sha256(json.dumps([files, pads, clip_vocab.VOCAB_SHA256], sort_keys=True).encode()).hexdigest()
    target = os.path.join(cache_root, "configs", f"{kind}-{digest[:12]}")
    if os.path.isfile(os.path.join(target, "model_index.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{kind}-", dir=os.path.dirname(target))
    try:
        for rel, content in files.items():
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2)
        for sub, pad in pads.items():
            clip_vocab.write_clip_tokenizer(os.path.join(tmp, sub), pad_token=pad)
        try:
            os.rename(tmp, target)  # model_index.json is inside: a reader sees the whole folder or none
        except OSError:
            if not os.path.isfile(os.path.join(target, "model_index.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
