"""diffusers' SD1.x / SD2.x / SDXL modules in the original Stable Diffusion layout: the key map diffusers lacks.

`to_original` inverts diffusers' single-file conversion (diffusers/loaders/single_file_utils.py:
convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint, convert_ldm_clip_checkpoint, convert_open_clip_checkpoint),
so that `from_single_file(file, config=folder)` gives back exactly the folder's parameters. The layouts are the
CompVis / SGM key names that AUTOMATIC1111 and ComfyUI read and write:

  * "sd1":  UNet `model.diffusion_model.`, VAE `first_stage_model.`, CLIP-L in transformers' layout under
            `cond_stage_model.transformer.text_model.`;
  * "sd2":  the same UNet and VAE, the text encoder in OpenCLIP's layout under `cond_stage_model.model.`;
  * "sdxl": CLIP-L under `conditioner.embedders.0.transformer.text_model.` and the second encoder (OpenCLIP
            bigG) under `conditioner.embedders.1.model.`.

Everything here only renames, reshapes, concatenates and transposes, so it works on meta tensors too.
`load_folder_modules` reads a diffusers pipeline folder's modules; `pipeline_of` puts modules back together as a
diffusers pipeline (for `save_pretrained`). `diffgraph convert` (convert.py) and the tests use both directions.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import torch

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."


def text_prefixes() -> dict[str, tuple[tuple[str, str], ...]]:
    """Per layout: where each text encoder lives, and in which layout; the built-in family adapters declare them."""
    from .families import default_registry

    return {layout: prefixes for adapter in default_registry().adapters()
            for layout, prefixes in adapter.original_layouts}


TEXT_PREFIXES = text_prefixes()
LAYOUTS = tuple(TEXT_PREFIXES)

# -- the UNet ----------------------------------------------------------------------------------------------------

# a diffusers ResnetBlock2D's parameter names -> the LDM ResBlock's
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
                "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
             "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2"}
_BLOCK = re.compile(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)")
_MID = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


def _renamed(rest: str, names: dict[str, str]) -> str:
    head, _, tail = rest.partition(".")
    return f"{names.get(head, head)}.{tail}"


def _top(key: str, names: dict[str, str], what: str) -> str:
    module, _, param = key.rpartition(".")
    if module not in names:
        raise ValueError(f"{what} parameter {key!r} has no place in the original layout")
    return f"{names[module]}.{param}"


def _unet_key(key: str, per_block: int, up_attention: set[int]) -> str:
    """One UNet parameter's LDM name. Each down block is `per_block` input_blocks (resnet .0, attention .1) plus
    one for its downsampler (`.0.op`); each up block is `per_block + 1` output_blocks, its upsampler after the
    attention in the last (`.2.conv`, or `.1.conv` in a block without attentions)."""
    m = _BLOCK.fullmatch(key)
    if m:
        side, b, kind, j, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
        if kind == "resnets":
            rest = _renamed(rest, _UNET_RESNET)
        if side == "down":
            first = 1 + b * (per_block + 1)
            if kind == "downsamplers":
                return f"input_blocks.{first + per_block}.0.op.{rest.removeprefix('conv.')}"
            return f"input_blocks.{first + j}.{0 if kind == 'resnets' else 1}.{rest}"
        first = b * (per_block + 1)
        if kind == "upsamplers":
            return f"output_blocks.{first + per_block}.{2 if b in up_attention else 1}.{rest}"
        return f"output_blocks.{first + j}.{0 if kind == 'resnets' else 1}.{rest}"
    m = _MID.fullmatch(key)
    if m:  # middle_block: resnet 0, attention 1, resnet 2
        kind, j, rest = m[1], int(m[2]), m[3]
        return (f"middle_block.{2 * j}.{_renamed(rest, _UNET_RESNET)}" if kind == "resnets"
                else f"middle_block.{2 * j + 1}.{rest}")
    return _top(key, _UNET_TOP, "UNet")


def unet_original(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A UNet2DConditionModel's state dict in the LDM UNet's key names (no prefix). Shapes are unchanged: the
    original's 1x1-conv proj_in/proj_out (SD1) and linear ones (SD2, SDXL) are what diffusers has too."""
    per_block = config["layers_per_block"]
    if not isinstance(per_block, int):
        raise ValueError(f"layers_per_block {per_block!r}: the original layout has one count for every block")
    up_attention = {int(k.split(".")[1]) for k in state if k.startswith("up_blocks.") and ".attentions." in k}
    return {_unet_key(k, per_block, up_attention): v for k, v in state.items()}


def controlnet_original(state: dict[str, torch.Tensor], config: Any, prefix: str = "control_model."
                        ) -> dict[str, torch.Tensor]:
    """A ControlNetModel's state dict in the original ControlNet layout (AUTOMATIC1111's and ComfyUI's files): its
    UNet half as the UNet's, the residual projections as `zero_convs` / `middle_block_out`, the conditioning
    embedding as `input_hint_block` (convs at 0, 2, 4, ..., the last at 14), under `prefix`."""
    per_block = config["layers_per_block"]
    out = {}
    for k, v in state.items():
        m = re.fullmatch(r"controlnet_down_blocks\.(\d+)\.(weight|bias)", k)
        if m:
            name = f"zero_convs.{m[1]}.0.{m[2]}"
        elif k.startswith("controlnet_mid_block."):
            name = "middle_block_out.0." + k.split(".")[-1]
        elif k.startswith("controlnet_cond_embedding."):
            part, leaf = k.split(".")[1], k.split(".")[-1]
            index = {"conv_in": 0, "conv_out": 14}.get(part)
            name = f"input_hint_block.{2 * (int(k.split('.')[2]) + 1) if index is None else index}.{leaf}"
        else:
            name = _unet_key(k, per_block, set())
        out[prefix + name] = v
    return out


# -- the VAE -----------------------------------------------------------------------------------------------------

_VAE_TOP = {name: name for name in ("encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out",
                                    "quant_conv", "post_quant_conv")}
_VAE_TOP.update({"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"})
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}
_VAE_BLOCK = re.compile(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.+)")
_VAE_MID = re.compile(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


def vae_original(state: dict[str, torch.Tensor], n_blocks: int) -> dict[str, torch.Tensor]:
    """An AutoencoderKL's state dict in the LDM autoencoder's key names (no prefix). The decoder's up blocks are
    numbered the other way round (LDM's `up.0` is the last one run), and the mid-block attention's q/k/v/proj_out
    are 1x1 convolutions there: (C, C, 1, 1), where diffusers has linear layers."""
    out = {}
    for key, value in state.items():
        m, mid = _VAE_BLOCK.fullmatch(key), _VAE_MID.fullmatch(key)
        if m:
            coder, b, kind, j, rest = m[1], int(m[3]), m[4], int(m[5]), m[6]
            rest = _renamed(rest, {"conv_shortcut": "nin_shortcut"})
            if coder == "encoder":
                name = f"encoder.down.{b}." + (f"block.{j}.{rest}" if kind == "resnets" else f"downsample.{rest}")
            else:
                name = f"decoder.up.{n_blocks - 1 - b}." + (f"block.{j}.{rest}" if kind == "resnets"
                                                             else f"upsample.{rest}")
        elif mid and mid[2] == "resnets":
            name = f"{mid[1]}.mid.block_{int(mid[3]) + 1}.{_renamed(mid[4], {'conv_shortcut': 'nin_shortcut'})}"
        elif mid:
            rest = mid[4].replace("to_out.0.", "to_out.")
            name = f"{mid[1]}.mid.attn_1.{_renamed(rest, _VAE_ATTENTION)}"
            if value.ndim == 2:
                value = value[:, :, None, None]
        else:
            name = _top(key, _VAE_TOP, "VAE")
        out[name] = value
    return out


# -- the text encoders ---------------------------------------------------------------------------------------------

def text_state(encoder: Any) -> dict[str, torch.Tensor]:
    """The encoder's parameters, `text_model.`-prefixed whatever the transformers version: CLIPTextModel lost its
    `text_model` wrapper in transformers 5.6, CLIPTextModelWithProjection kept it."""
    return {k if k.startswith(("text_model.", "text_projection.")) else f"text_model.{k}": v
            for k, v in encoder.state_dict().items()}


def hf_clip_original(state: dict[str, torch.Tensor], extras: bool = True) -> dict[str, torch.Tensor]:
    """transformers' CLIP layout (what SD1 and SDXL's first embedder store), plus the int64 `position_ids` buffer
    real checkpoints carry (diffusers drops it: not a parameter)."""
    out = dict(state)
    if extras:
        positions = state["text_model.embeddings.position_embedding.weight"]
        out["text_model.embeddings.position_ids"] = torch.arange(
            positions.shape[0], dtype=torch.int64, device=positions.device)[None]
    return out


_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                    "self_attn.out_proj": "attn.out_proj"}


def open_clip_original(state: dict[str, torch.Tensor], extra_layer: bool = False,
                       extras: bool = True) -> dict[str, torch.Tensor]:
    """OpenCLIP's text-tower layout: q, k, v fused into `attn.in_proj_*` (in that order), `text_projection` as
    OpenCLIP multiplies by it, (width, projection_dim): the transpose of diffusers' Linear weight. Extras: the
    `logit_scale` real checkpoints carry, and with `extra_layer` (SD2) the tower's last resblock, which diffusers'
    23-layer SD2 encoder leaves out (SD2 conditions on the penultimate layer); diffusers ignores both."""
    state = dict(state)
    token = state.pop("text_model.embeddings.token_embedding.weight")
    out = {"token_embedding.weight": token,
           "positional_embedding": state.pop("text_model.embeddings.position_embedding.weight"),
           "ln_final.weight": state.pop("text_model.final_layer_norm.weight"),
           "ln_final.bias": state.pop("text_model.final_layer_norm.bias")}
    projection = state.pop("text_projection.weight", None)
    if projection is not None:
        out["text_projection"] = projection.T.contiguous()
    layers = len({k.split(".")[3] for k in state if k.startswith("text_model.encoder.layers.")})
    for n in range(layers):
        src, dst = f"text_model.encoder.layers.{n}.", f"transformer.resblocks.{n}."
        for param in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{param}"] = torch.cat(
                [state.pop(f"{src}self_attn.{x}_proj.{param}") for x in "qkv"])
            for ours, theirs in _OPEN_CLIP_LAYER.items():
                out[f"{dst}{theirs}.{param}"] = state.pop(f"{src}{ours}.{param}")
    if state:
        raise ValueError(f"text encoder parameters with no place in OpenCLIP's layout: {sorted(state)[:5]}")
    if extras:
        out["logit_scale"] = torch.full((), math.log(100.0), dtype=token.dtype, device=token.device)
        if extra_layer:
            last = f"transformer.resblocks.{layers - 1}."
            out.update({k.replace(last, f"transformer.resblocks.{layers}."): torch.zeros_like(v)
                        for k, v in list(out.items()) if k.startswith(last)})
            if "text_projection" not in out:  # SD2's, unused by its conditioning
                out["text_projection"] = torch.zeros(token.shape[1], token.shape[1], dtype=token.dtype,
                                                     device=token.device)
    return out


# -- whole checkpoints ---------------------------------------------------------------------------------------------

def to_original(unet: Any, vae: Any, text_encoders: list, layout: str, extras: bool = True) -> dict[str, torch.Tensor]:
    """The modules' parameters as one state dict in `layout` ("sd1", "sd2" or "sdxl"). `extras` adds what real
    checkpoints carry beyond diffusers' parameters (position_ids, logit_scale, SD2's last OpenCLIP layer and
    text_projection); diffusers' conversion ignores them, so the round trip is exact either way."""
    if layout not in TEXT_PREFIXES:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if len(text_encoders) != len(TEXT_PREFIXES[layout]):
        raise ValueError(f"layout {layout!r} has {len(TEXT_PREFIXES[layout])} text encoder(s), "
                         f"not {len(text_encoders)}")
    out = {UNET_PREFIX + k: v for k, v in unet_original(unet.state_dict(), unet.config).items()}
    out.update({VAE_PREFIX + k: v for k, v in vae_original(vae.state_dict(), len(vae.config.up_block_types)).items()})
    for encoder, (prefix, kind) in zip(text_encoders, TEXT_PREFIXES[layout]):
        state = text_state(encoder)
        part = (hf_clip_original(state, extras) if kind == "hf"
                else open_clip_original(state, extra_layer=layout == "sd2", extras=extras))
        out.update({prefix + k: v for k, v in part.items()})
    return out


def load_folder_modules(folder: str) -> tuple[Any, Any, list]:
    """An SD1.x / SD2.x / SDXL pipeline folder's UNet, VAE and CLIP text encoders, streamed (`stream_load`), in fp32
    (exact for fp16/bf16 files)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from .stream_load import load_part

    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    label, fp32 = f"model folder {folder!r}", torch.float32
    classes = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}
    encoders = []
    for sub in ("text_encoder", "text_encoder_2"):
        if (index.get(sub) or [None])[0]:
            name = index[sub][1]
            if name not in classes:
                raise ValueError(f"{label}: its {sub} is a {name!r}, not a CLIP text encoder "
                                 f"({' or '.join(classes)}); give an SD1.x, SD2.x or SDXL folder")
            encoders.append(load_part(classes[name], folder, label, sub, fp32))
    unet = load_part(UNet2DConditionModel, folder, label, "unet", fp32)
    vae = load_part(AutoencoderKL, folder, label, "vae", fp32)
    return unet, vae, encoders


# -- diffusers pipelines ----------------------------------------------------------------------------------------------

def pipeline_of(unet: Any, vae: Any, encoders: list, tokenizers: list, scheduler_config: dict[str, Any],
                force_zeros: bool) -> Any:
    """The modules as a StableDiffusion[XL][Inpaint]Pipeline (by their text encoders and UNet inputs)."""
    import diffusers

    scheduler = getattr(diffusers, scheduler_config["_class_name"]).from_config(scheduler_config)
    inpaint = "Inpaint" if unet.config.in_channels == 9 else ""
    if len(encoders) == 1:
        return getattr(diffusers, f"StableDiffusion{inpaint}Pipeline")(
            vae=vae, text_encoder=encoders[0], tokenizer=tokenizers[0], unet=unet, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return getattr(diffusers, f"StableDiffusionXL{inpaint}Pipeline")(
        vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1], tokenizer=tokenizers[0],
        tokenizer_2=tokenizers[1], unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=force_zeros)
