"""Qwen-Image's VAE from a single file: ComfyUI's `qwen_image_vae.safetensors` (Wan 2.1's original layout, which the
Qwen-Image VAE shares key for key: `encoder.conv1`, `encoder.downsamples.N.residual.K`, `decoder.middle.*`,
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
