"""FLUX.2 klein's single files as ComfyUI users download them, read into the state dicts of the classes the FLUX.2
family builds: the transformer (`diffusion_models/flux-2-klein-4b.safetensors`, BFL's original layout) for diffusers'
Flux2Transformer2DModel, the VAE (`vae/flux2-vae.safetensors`) for AutoencoderKLFlux2; the Qwen3 text encoder is read
as Z-Image's is (zimage_files.read_text_encoder).

Layouts read (each file through zimage_files.read_file: the checked reader, its header's kind and ComfyUI's fp8
conventions, fp8 layers dequantised):
  * transformer: BFL's names (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, `img_in`, `txt_in`, ...),
    bare or under `model.diffusion_model.`, converted by diffusers' own
    `convert_flux2_transformer_checkpoint_to_diffusers` (the fused qkv split in thirds, the final modulation's shift
    and scale swapped); a file in diffusers' names (`transformer_blocks.`) is read as it is. Its GGUF quantisations
    (city96 / ComfyUI-GGUF's converter, as orabazes' and unsloth's FLUX.2 files are made: BFL's names with the prefix
    stripped, architecture `flux`, 1-D and small tensors F32, the rest the file's type) are the same names, each
    tensor dequantised to the compute dtype on the device (gguf_files.py), then converted as above; a GGUF of another
    model (a Z-Image one, FLUX.1's) is refused naming what it is, from its header.
  * VAE: diffusers has no single-file map for the FLUX.2 VAE. BFL's layout is the LDM one with the latent
    convolutions inside the coders (`encoder.quant_conv`, `decoder.post_quant_conv`) and the latents' batch-norm
    statistics (`bn.running_mean` / `bn.running_var`) at the top: those are moved to diffusers' places
    (`vae_from_original`), the rest goes through `convert_ldm_vae_checkpoint`, the converter diffgraph's single-file
    VAEs go through.

Configs come from the weights' shapes (a split file carries none): `transformer_config`, and zimage_files'
`qwen3_config` and `vae_config`. The text encoders' `.gguf` files (llama.cpp's Qwen3 and Mistral) are read in
transformers' names (gguf_llm.py) and then as their safetensors files are.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .zimage_files import TRANSFORMER_PREFIX, FileWeights, embeddings_prefix, read_file

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


def read_transformer(path: str, dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | str | None = None) -> FileWeights:
    """A FLUX.2 transformer file (safetensors, or `.gguf`: its tensors dequantised to `dtype` on `device`, default
    the CPU) as Flux2Transformer2DModel's state dict."""
    weights = read_file(path, "flux2_transformer", dtype, device=device)
    return FileWeights(path, transformer_from_original(weights.state), {}, weights.quantisation)


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


# -- FLUX.2 dev's text encoder: Mistral Small 3.1's language model -------------------------------------------------

MISTRAL_HEAD = 128  # Mistral Small 3.1's attention head width (text_config.head_dim): its files do not say it
MISTRAL_READ = 30   # the language-model layers FLUX.2 dev runs: its last hidden state read is layer 30's input
# Mistral Small 3.1's text_config (mistralai/Mistral-Small-3.1-24B-Instruct-2503, FLUX.2-dev's text_encoder/)
MISTRAL_SMALL_31 = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=MISTRAL_HEAD,
                        max_position_embeddings=131072, rope_theta=1000000000.0, rms_norm_eps=1e-5,
                        sliding_window=None)
# what a Mistral 3 file holds beside its language model: ComfyUI's tokenizer (tekken.json as bytes), the LM head, and
# the vision side of a whole Mistral3ForConditionalGeneration
MISTRAL_OTHER = ("tekken_model", "lm_head.", "vision_tower.", "multi_modal_projector.")


def mistral_from_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Mistral 3 text encoder's keys (ComfyUI's file: Llama's names under `model.`; a Mistral3 checkpoint's
    language model under `language_model.model.` or `model.language_model.`) as MistralModel's, layers 0 to 29 and
    the embeddings only: the final norm and the later layers never reach a hidden state FLUX.2 dev reads (ComfyUI's
    pruned file has neither), and `MISTRAL_OTHER` is not read."""
    prefix = embeddings_prefix(state, "Mistral")
    out, stray = {}, []
    for key, value in state.items():
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name is None:
            if not any(key.startswith(o) or f".{o}" in key for o in MISTRAL_OTHER):
                stray.append(key)
        elif name.startswith("layers."):
            if int(name.split(".", 2)[1]) < MISTRAL_READ:
                out[name] = value
        elif name != "norm.weight":
            out[name] = value
    if stray:
        raise ValueError(f"Mistral weights with {len(stray)} tensors outside {prefix!r} (e.g. {stray[0]!r}): more than "
                         "a text encoder")
    return out


def mistral_config(state: Mapping[str, torch.Tensor], head: int = MISTRAL_HEAD) -> dict[str, Any]:
    """MistralConfig's keywords for `mistral_from_comfy`'s state: widths from the shapes, `head` the attention head
    width (a file does not hold it: the folder's config, else Mistral Small 3.1's); the rest Mistral Small 3.1's."""
    vocab, hidden = state["embed_tokens.weight"].shape
    rows = (state["layers.0.self_attn.q_proj.weight"].shape[0], state["layers.0.self_attn.k_proj.weight"].shape[0])
    if rows[0] % head or rows[1] % head:
        raise ValueError(f"the text encoder's attention projections have {rows[0]} and {rows[1]} rows, not whole "
                         f"heads of {head}: give the tokenizer as the checkpoint's diffusers folder, whose "
                         "text_encoder/config.json says its head width")
    return {**MISTRAL_SMALL_31, "vocab_size": int(vocab), "hidden_size": int(hidden),
            "intermediate_size": int(state["layers.0.mlp.gate_proj.weight"].shape[0]),
            "num_hidden_layers": _count(state, "layers."), "num_attention_heads": rows[0] // head,
            "num_key_value_heads": rows[1] // head, "head_dim": head}


def mistral_reader(config: Mapping[str, Any]) -> torch.nn.Module:
    """The MistralModel FLUX.2 dev runs for `config`: its first `MISTRAL_READ` layers and no final norm, so that its
    last hidden state is layer 30's input as the pipeline reads it (transformers normalises the last one it returns)."""
    from transformers import MistralConfig, MistralModel

    model = MistralModel(MistralConfig(**{**config, "num_hidden_layers": min(int(config["num_hidden_layers"]),
                                                                            MISTRAL_READ)}))
    model.norm = torch.nn.Identity()
    return model
