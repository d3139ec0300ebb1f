"""FLUX.2 klein's single files as ComfyUI users download them, read into the state dicts of the classes the FLUX.2
family builds: the transformer (`diffusion_models/flux-2-klein-4b.safetensors`, BFL's original layout) for diffusers'
Flux2Transformer2DModel, the VAE (`vae/flux2-vae.safetensors`) for AutoencoderKLFlux2; the Qwen3 text encoder is read
as Z-Image's is (zimage_files.read_text_encoder).

Layouts read (each file through zimage_files.read_file: the checked reader, its header's kind and ComfyUI's fp8
conventions, fp8 layers dequantised):
  * transformer: BFL's names (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, `img_in`, `txt_in`, ...),
    bare or under `model.diffusion_model.`, converted by diffusers' own
    `convert_flux2_transformer_checkpoint_to_diffusers` (the fused qkv split in thirds, the final modulation's shift
    and scale swapped); a file in diffusers' names (`transformer_blocks.`) is read as it is.
  * VAE: diffusers has no single-file map for the FLUX.2 VAE. BFL's layout is the LDM one with the latent
    convolutions inside the coders (`encoder.quant_conv`, `decoder.post_quant_conv`) and the latents' batch-norm
    statistics (`bn.running_mean` / `bn.running_var`) at the top: those are moved to diffusers' places
    (`vae_from_original`), the rest goes through `convert_ldm_vae_checkpoint`, the converter diffgraph's single-file
    VAEs go through.

Configs come from the weights' shapes (a split file carries none): `transformer_config`, and zimage_files'
`qwen3_config` and `vae_config`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .split_files import GGUF_SUFFIX
from .zimage_files import TRANSFORMER_PREFIX, FileWeights, read_file

# BFL's places of the FLUX.2 VAE's tensors that the LDM layout keeps elsewhere -> diffusers' (AutoencoderKLFlux2's)
VAE_MOVED = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
VAE_STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


# diffusers' names -> BFL's (the inverse of diffusers' converter, for writing files): top-level modules, and a double
# block's and a single block's (q, k and v are fused: FUSED); norms' `weight` is BFL's `scale`
TOP_ORIGINAL = {"x_embedder": "img_in", "context_embedder": "txt_in",
                "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
                "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
                "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
                "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
                "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
                "single_stream_modulation.linear": "single_stream_modulation.lin", "proj_out": "final_layer.linear",
                "norm_out.linear": "final_layer.adaLN_modulation.1"}
DOUBLE_ORIGINAL = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                   "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
                   "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
                   "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0",
                   "ff_context.linear_out": "txt_mlp.2"}
SINGLE_ORIGINAL = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
                   "attn.norm_k": "norm.key_norm"}
FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
         "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def read_transformer(path: str, dtype: torch.dtype = torch.bfloat16) -> FileWeights:
    """A FLUX.2 transformer file as Flux2Transformer2DModel's state dict."""
    refuse_gguf(path)
    weights = read_file(path, "flux2_transformer", dtype)
    return FileWeights(path, transformer_from_original(weights.state), {}, weights.quantisation)


def refuse_gguf(path: str) -> None:
    if path.endswith(GGUF_SUFFIX):
        raise ValueError(f"{path} is a GGUF file; FLUX.2 transformers are read from safetensors files (bf16, or "
                         "ComfyUI's fp8): use one of those")


def transformer_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL's keys (bare or under `model.diffusion_model.`) as Flux2Transformer2DModel's, by diffusers' converter (its
    fused qkv chunks are views; the final modulation's swap computes a new tensor from that one tensor alone); a
    state in diffusers' names as it is."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    state = {k.removeprefix(TRANSFORMER_PREFIX): v for k, v in state.items()}
    if not any(k.startswith("transformer_blocks.") for k in state):
        state = convert_flux2_transformer_checkpoint_to_diffusers(state)
    return state


def read_vae(path: str, config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16) -> FileWeights:
    """A FLUX.2 VAE file as AutoencoderKLFlux2's state dict for `config` (a VAE of other latent channels is refused
    from its header)."""
    weights = read_file(path, "vae", dtype, config)
    if any(".down_blocks." in k for k in weights.state):
        return weights
    return FileWeights(path, vae_from_original(weights.state, config), {}, weights.quantisation)


def vae_from_original(state: dict[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """BFL's FLUX.2 VAE keys (bare or under `vae.` / `first_stage_model.`) as AutoencoderKLFlux2's: the latent
    convolutions and batch-norm statistics moved (`VAE_MOVED`, `VAE_STATS`), the coders by convert_ldm_vae_checkpoint;
    a file without the batch norm's step count gets 0 (it is not read: the statistics are fixed)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    prefix = next((p for p in ("first_stage_model.", "vae.") if any(k.startswith(p) for k in state)), "")
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    moved, rest = {}, {}
    for key, value in state.items():
        old = next((o for o in VAE_MOVED if key.startswith(o)), None)
        if old is not None:
            moved[VAE_MOVED[old] + key[len(old):]] = value
        elif key in VAE_STATS:
            moved[key] = value
        else:
            rest[key] = value
    if not all(k in moved for k in VAE_STATS[:2]):
        raise ValueError("a VAE without bn.running_mean / bn.running_var: not a FLUX.2 VAE (its latents are "
                         "normalised by those statistics); give the FLUX.2 VAE file")
    moved.setdefault("bn.num_batches_tracked", torch.tensor(0))
    return {**convert_ldm_vae_checkpoint(rest, dict(config)), **moved}


def vae_to_original(state: dict[str, torch.Tensor], coders: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AutoencoderKLFlux2's state dict in BFL's layout (`vae_from_original`'s inverse, for writing files): `coders`
    is the rest of `state` (its `bn.` statistics left out) in the LDM layout, as original_layout.vae_original writes
    it; the latent convolutions go to BFL's places and the statistics are added."""
    out = {}
    for key, value in coders.items():
        old = next((o for o, n in VAE_MOVED.items() if key.startswith(n)), None)
        out[key if old is None else old + key[len(VAE_MOVED[old]):]] = value
    out.update({k: state[k] for k in VAE_STATS[:2]})
    return out


def transformer_to_original(state: dict[str, torch.Tensor], prefix: str = TRANSFORMER_PREFIX
                            ) -> dict[str, torch.Tensor]:
    """Flux2Transformer2DModel's state dict in BFL's layout under `prefix` (ComfyUI's): diffusers' converter
    inverted (q, k and v fused, the final modulation's scale and shift swapped back, norms' weights as `scale`)."""
    out = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        blocks, _, rest = module.partition(".")
        index, _, inner = rest.partition(".")
        if blocks == "transformer_blocks" and inner in DOUBLE_ORIGINAL:
            name = f"double_blocks.{index}.{DOUBLE_ORIGINAL[inner]}"
        elif blocks == "single_transformer_blocks":
            name = f"single_blocks.{index}.{SINGLE_ORIGINAL[inner]}"
        elif blocks == "transformer_blocks":
            continue  # a fused projection's part, below
        else:
            name = TOP_ORIGINAL[module]
            if module == "norm_out.linear":
                value = torch.cat(value.chunk(2)[::-1])
        out[f"{prefix}{name}.{'scale' if '_norm' in name else param}"] = value
    for index in range(_count(state, "transformer_blocks.")):
        for fused, parts in FUSED.items():
            out[f"{prefix}double_blocks.{index}.{fused}.weight"] = torch.cat(
                [state[f"transformer_blocks.{index}.{p}.weight"] for p in parts])
    return out


def _count(state: Mapping[str, Any], prefix: str) -> int:
    return len({k[len(prefix):].split(".", 1)[0] for k in state if k.startswith(prefix)})


def transformer_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Flux2Transformer2DModel's config for a state dict in its names (`read_transformer`'s): widths, blocks and
    heads from the shapes; RoPE's four axes split the head in quarters and its theta is 2000, as the published
    models' are."""
    inner, channels = state["x_embedder.weight"].shape
    head = state["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    return dict(patch_size=1, in_channels=channels, num_layers=_count(state, "transformer_blocks."),
                num_single_layers=_count(state, "single_transformer_blocks."), attention_head_dim=head,
                num_attention_heads=inner // head, joint_attention_dim=state["context_embedder.weight"].shape[1],
                timestep_guidance_channels=state["time_guidance_embed.timestep_embedder.linear_1.weight"].shape[1],
                mlp_ratio=state["transformer_blocks.0.ff.linear_in.weight"].shape[0] / (2 * inner),
                axes_dims_rope=(head // 4,) * 4, rope_theta=2000,
                guidance_embeds=any(k.startswith("time_guidance_embed.guidance_embedder.") for k in state))
