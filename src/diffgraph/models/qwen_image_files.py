"""Qwen-Image's split files (ComfyUI's three: the diffusion model, the Qwen2.5-VL text encoder, the VAE) as diffusers'
modules, for split_stream.py.

The transformer file holds diffusers' names (diffusers' own single-file map for QwenImageTransformer2DModel is the
identity), under `model.diffusion_model.` in some files: `transformer_from_comfy`; its config from the shapes
(`transformer_config`, RoPE's axes split as the published model's). The text encoder file holds Qwen2.5-VL's
language model (under `model.` as the causal LM saved it before transformers 4.52, or `model.language_model.`), its
vision tower (`visual.` / `model.visual.`) and maybe `lm_head`: text-to-image reads the language model alone
(`text_encoder_from_comfy`, `text_config`: Qwen2.5's 128-wide heads and mrope sections). The VAE:
ComfyUI's `qwen_image_vae.safetensors` (Wan 2.1's original layout, which the Qwen-Image VAE shares key for key: `encoder.conv1`, `encoder.downsamples.N.residual.K`, `decoder.middle.*`,
`decoder.upsamples.N`, `conv1` / `conv2` for the quant convolutions) or a file in diffusers' names, as
AutoencoderKLQwenImage's state dict. diffusers has no single-file loader for this class, but its Wan VAE converter
(`convert_wan_vae_to_diffusers`) is the map: the two diffusers classes have the same module tree. The file is read
through zimage_files' checked reading (kind `qwen_image_vae`: its header's keys and latent channels, fp8 layers
dequantised); `vae_config` derives the config from its shapes (the published layout, its width from the file)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import safe_files
from ..safe_tensors import FILE_LIMIT
from .split_files import header_shapes
from .zimage_files import FileWeights, read_file

TRANSFORMER_PREFIX = "model.diffusion_model."
QWEN25_HEAD = 128  # Qwen2.5's attention head width (2.5-VL 3B and 7B alike): its files do not say it

# Qwen/Qwen-Image's vae/config.json less the width, which a file's shapes give (`vae_config`)
QWEN_IMAGE_VAE = dict(z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)


def read_vae(path: str, config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16,
             max_bytes: int = FILE_LIMIT) -> FileWeights:
    """The VAE file at `path` as AutoencoderKLQwenImage's state dict for `config` (a VAE of other latent channels is
    refused from its header; a tensor the model has no place for is refused where it loads)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    weights = read_file(path, "qwen_image_vae", dtype, config, max_bytes)
    if any(k.startswith("decoder.mid_block.") for k in weights.state):
        return weights
    return FileWeights(path, convert_wan_vae_to_diffusers(weights.state), {}, weights.quantisation)


def vae_config(path: str) -> dict[str, Any]:
    """The AutoencoderKLQwenImage config of the file at `path`: the published layout, its base width and latent
    channels from the first and the decoder's input convolutions (either naming)."""
    try:
        shapes = header_shapes(path)
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None
    first = next((s for k, s in shapes.items() if k in ("encoder.conv1.weight", "encoder.conv_in.weight")), None)
    latent = next((s for k, s in shapes.items() if k in ("decoder.conv1.weight", "decoder.conv_in.weight")), None)
    if first is None or latent is None:
        raise ValueError(f"{path} lacks the VAE's input convolutions (encoder.conv1 / decoder.conv1): it is not a "
                         "Qwen-Image VAE file; give the VAE its model page names")
    return {**QWEN_IMAGE_VAE, "base_dim": int(first[0]), "z_dim": int(latent[1])}


def transformer_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-Image transformer file's keys as QwenImageTransformer2DModel's (its prefix dropped)."""
    return {k.removeprefix(TRANSFORMER_PREFIX): v for k, v in state.items()}


def transformer_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """QwenImageTransformer2DModel's config from its state's shapes; RoPE's axes split the head as the published
    model's (16, 56, 56 of 128: an eighth for the frame, seven sixteenths for each image axis)."""
    inner, channels = state["img_in.weight"].shape
    head = state["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    return dict(patch_size=2, in_channels=int(channels), out_channels=int(state["proj_out.weight"].shape[0]) // 4,
                num_layers=_children(state, "transformer_blocks."), attention_head_dim=int(head),
                num_attention_heads=int(inner) // int(head), joint_attention_dim=int(state["txt_in.weight"].shape[1]),
                axes_dims_rope=(head // 8, head * 7 // 16, head * 7 // 16))


def text_encoder_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2.5-VL file's language model as Qwen2_5_VLTextModel's keys; its vision tower and LM head dropped."""
    embed = next((k for k in state if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise ValueError("Qwen2.5-VL weights without embed_tokens.weight: not a Qwen2.5-VL text encoder")
    prefix = embed.removesuffix("embed_tokens.weight")
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def text_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Qwen2_5_VLTextConfig's keywords from the language model's shapes, with Qwen2.5-VL's head width, mrope
    sections, RoPE theta and norm epsilon."""
    vocab, hidden = state["embed_tokens.weight"].shape
    return dict(vocab_size=int(vocab), hidden_size=int(hidden),
                intermediate_size=int(state["layers.0.mlp.gate_proj.weight"].shape[0]),
                num_hidden_layers=_children(state, "layers."),
                num_attention_heads=int(state["layers.0.self_attn.q_proj.weight"].shape[0]) // QWEN25_HEAD,
                num_key_value_heads=int(state["layers.0.self_attn.k_proj.weight"].shape[0]) // QWEN25_HEAD,
                max_position_embeddings=128000, rope_theta=1000000.0, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})


def _children(state: Mapping[str, Any], prefix: str) -> int:
    """How many numbered children `prefix` has."""
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})
