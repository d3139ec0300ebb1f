"""Qwen-Image's and Qwen-Image-Edit's split files (ComfyUI's three: the diffusion model, the Qwen2.5-VL text encoder,
the VAE) as diffusers' and transformers' modules, for split_stream.py.

The transformer file (safetensors, or a city96 / QuantStack GGUF: split_stream reads either) holds diffusers' names
(diffusers' own single-file map for QwenImageTransformer2DModel is the identity), under `model.diffusion_model.` in
some files, and in ComfyUI's Edit-2511 repack an empty `__index_timestep_zero__` marker (the kind split_files.py
reads it as; not a weight): `transformer_from_comfy`; its config from the shapes (`transformer_config`, RoPE's axes
split as the published model's). The text encoder file holds Qwen2.5-VL's language model (under `model.` as the
causal LM saved it before transformers 4.52, or `model.language_model.`), its vision tower (`visual.` /
`model.visual.`) and maybe `lm_head`: text-to-image reads the language model alone (`text_encoder_from_comfy`,
`text_config`: Qwen2.5's 128-wide heads and mrope sections), Edit reads both as Qwen2_5_VLModel (`vl_from_comfy`,
`vl_config`: the vision tower's 80-wide heads, its window and full-attention blocks as the published model's), and a
file without the tower is refused for it (`check_vision`). The VAE:
ComfyUI's `qwen_image_vae.safetensors` (Wan 2.1's original layout, which the Qwen-Image VAE shares key for key: `encoder.conv1`, `encoder.downsamples.N.residual.K`, `decoder.middle.*`,
`decoder.upsamples.N`, `conv1` / `conv2` for the quant convolutions) or a file in diffusers' names, as
AutoencoderKLQwenImage's state dict. diffusers has no single-file loader for this class, but its Wan VAE converter
(`convert_wan_vae_to_diffusers`) is the map: the two diffusers classes have the same module tree. The file is read
through zimage_files' checked reading (kind `qwen_image_vae`: its header's keys and latent channels, fp8 layers
dequantised); `vae_config` derives the config from its shapes (its width, levels, blocks per level and temporal
downsampling from the encoder's flat list of blocks, which both namings number alike; diffusers' map of Wan 2.1's
names knows the published layout alone, so a file of another layout is read in diffusers' names)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .. import safe_files
from ..safe_tensors import FILE_LIMIT
from .split_files import header_shapes
from .zimage_files import FileWeights, read_file

TRANSFORMER_PREFIX = "model.diffusion_model."
ZERO_COND_MARKER = "__index_timestep_zero__"  # ComfyUI's Edit-2511 repack: an empty tensor, no weight
QWEN25_HEAD = 128  # Qwen2.5's attention head width (2.5-VL 3B and 7B alike): its files do not say it
VISION_HEAD = 80   # Qwen2.5-VL's vision tower's head width (1280 / 16 in 3B, 7B, 32B and 72B)
VISION_FULL = (7, 15, 23, 31)  # the published towers' full-attention blocks (the others attend in 112 px windows)
VISION_PREFIXES = ("visual.", "model.visual.")

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
    """The AutoencoderKLQwenImage config of the file at `path`: its base width and latent channels from the first and
    the decoder's input convolutions, its levels from the encoder's blocks (`_vae_levels`; either naming)."""
    try:
        shapes = header_shapes(path)
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None
    first = next((s for k, s in shapes.items() if k in ("encoder.conv1.weight", "encoder.conv_in.weight")), None)
    latent = next((s for k, s in shapes.items() if k in ("decoder.conv1.weight", "decoder.conv_in.weight")), None)
    if first is None or latent is None:
        raise ValueError(f"{path} lacks the VAE's input convolutions (encoder.conv1 / decoder.conv1): it is not a "
                         "Qwen-Image VAE file; give the VAE its model page names")
    return {**QWEN_IMAGE_VAE, "base_dim": int(first[0]), "z_dim": int(latent[1]),
            **_vae_levels(shapes, int(first[0]))}


def _vae_levels(shapes: Mapping[str, tuple[int, ...]], base: int) -> dict[str, Any]:
    """dim_mult, num_res_blocks and temperal_downsample from the encoder's flat list of blocks (`downsamples.N` /
    `down_blocks.N`): each level's residual blocks (their second convolution's width), then a resample between
    levels (with a `time_conv` where it halves time); the published layout where the file shows no list."""
    blocks: dict[int, tuple[str, int]] = {}
    for key, shape in shapes.items():
        for prefix in ("encoder.downsamples.", "encoder.down_blocks."):
            if key.startswith(prefix):
                index, rest = key[len(prefix):].split(".", 1)
                if rest in ("residual.6.weight", "conv2.weight"):
                    blocks[int(index)] = ("block", int(shape[0]))
                elif rest == "time_conv.weight" or (rest == "resample.1.weight" and int(index) not in blocks):
                    blocks[int(index)] = ("time" if rest == "time_conv.weight" else "space", 0)
    if not blocks:
        return {}
    levels: list[list[int]] = [[]]
    temporal = []
    for _, (what, width) in sorted(blocks.items()):
        if what == "block":
            levels[-1].append(width)
        else:
            temporal.append(what == "time")
            levels.append([])
    return {"dim_mult": [level[-1] // base for level in levels], "num_res_blocks": len(levels[0]),
            "temperal_downsample": temporal}


def transformer_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-Image transformer file's keys as QwenImageTransformer2DModel's (its prefix and Edit-2511's marker
    dropped)."""
    return {k.removeprefix(TRANSFORMER_PREFIX): v for k, v in state.items() if not k.endswith(ZERO_COND_MARKER)}


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


def vl_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen2.5-VL file's language model and vision tower as Qwen2_5_VLModel's keys (`language_model.*`,
    `visual.*`); its LM head dropped."""
    tower = {k.split("visual.", 1)[1]: v for k, v in state.items() if k.startswith(VISION_PREFIXES)}
    language = text_encoder_from_comfy({k: v for k, v in state.items() if not k.startswith(VISION_PREFIXES)})
    return {**{f"language_model.{k}": v for k, v in language.items()}, **{f"visual.{k}": v for k, v in tower.items()}}


def vl_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Qwen2_5_VLConfig's keywords from Qwen2_5_VLModel's state's shapes: `text_config` and the vision tower's (its
    patches from the patch embedding, its merge from the merger's input width; 80-wide heads, 112 px windows and the
    published full-attention blocks, which the file does not say)."""
    text = text_config({k.removeprefix("language_model."): v for k, v in state.items()
                        if k.startswith("language_model.")})
    embed = state["visual.patch_embed.proj.weight"].shape  # [hidden, channels, frames, patch, patch]
    hidden = int(embed[0])
    depth = _children(state, "visual.blocks.")
    vision = dict(depth=depth, hidden_size=hidden, num_heads=hidden // VISION_HEAD, in_channels=int(embed[1]),
                  intermediate_size=int(state["visual.blocks.0.mlp.gate_proj.weight"].shape[0]),
                  out_hidden_size=int(state["visual.merger.mlp.2.weight"].shape[0]), patch_size=int(embed[3]),
                  spatial_merge_size=math.isqrt(int(state["visual.merger.mlp.0.weight"].shape[1]) // hidden),
                  temporal_patch_size=int(embed[2]), window_size=112,
                  fullatt_block_indexes=[i for i in VISION_FULL if i < depth])
    return dict(text_config=text, vision_config=vision)


def check_vision(path: str) -> None:
    """A one-line ValueError unless the text encoder file at `path` holds Qwen2.5-VL's vision tower (Edit reads its
    input images with it), from its header before any tensor is read."""
    try:
        shapes = header_shapes(path)
    except safe_files.UnusableFile as e:
        raise ValueError(f"{path} {e}") from None
    if not any(k.startswith(VISION_PREFIXES) for k in shapes):
        raise ValueError(f"{path} holds Qwen2.5-VL's language model without its vision tower (no visual.* tensors), "
                         "which Qwen-Image-Edit reads its input images with; use a text encoder file with it "
                         "(ComfyUI's qwen_2.5_vl_7b.safetensors or qwen_2.5_vl_7b_fp8_scaled.safetensors)")


def _children(state: Mapping[str, Any], prefix: str) -> int:
    """How many numbered children `prefix` has."""
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})
