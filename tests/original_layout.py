"""Test helper: diffusers pipeline folders turned into single-file checkpoints in the original Stable Diffusion layout.

CI has no real SD checkpoints, so the single-file loading tests make their own with the key map of
diffgraph.models.original_layout (re-exported here: `to_original`, the per-module maps, the layouts), which
inverts diffusers' single-file conversion. `write_single_file` writes a folder as an original-layout file;
the key map only renames, reshapes, concatenates and transposes, so it works on meta tensors too:
`full_size_layout` gives the key names and shapes of full-size checkpoints without allocating their weights, and
`header_only` writes them as a safetensors header with no data (kind detection reads headers, not GBs).
`variant_folder` and `write_folder` write the small test models as diffusers folders, deterministically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import torch

from diffgraph.models.original_layout import (  # noqa: F401  (the tests read the key map through this helper)
    LAYOUTS, TEXT_PREFIXES, UNET_PREFIX, VAE_PREFIX, controlnet_original, hf_clip_original, load_folder_modules,
    open_clip_original, pipeline_of, text_state, to_original, unet_original, vae_original)
from diffgraph.models.presets import RANDOM_PRESETS, SD_SCHEDULER_CONFIG, RandomPreset

REAL_VOCAB = 49408  # CLIP's BPE vocabulary, in every real SD1/SD2/SDXL text encoder

# safetensors' dtype names and their sizes in bytes
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def write_folder(model: Any, folder: str) -> str:
    """Saves a diffgraph DiffusionModel (diffgraph.models.loader.load_model) as a complete diffusers pipeline
    folder (StableDiffusion[XL][Inpaint]Pipeline by its text encoders and UNet inputs), readable by load_model and
    by diffusers' from_pretrained. Returns the folder."""
    pipeline_of(model.denoiser, model.vae, list(model.text_encoders), list(model.tokenizers), model.scheduler_config,
                model.force_zeros_for_empty_prompt).save_pretrained(folder, safe_serialization=True)
    return folder


def write_single_file(folder: str, path: str, layout: str, dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> None:
    """Writes the diffusers folder's UNet, VAE and text encoders as one original-layout .safetensors file: floating
    tensors in fp32, or cast to `dtype` if given, with safetensors `metadata`, keys starting with any of `drop`
    left out (e.g. ("first_stage_model.",) for a checkpoint without a VAE)."""
    from safetensors.torch import save_file

    state = to_original(*load_folder_modules(folder), layout)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in state.items() if not k.startswith(tuple(drop))}
    save_file(tensors, path, metadata=metadata)


def _widened_xl(preset: RandomPreset) -> RandomPreset:
    # diffusers' single-file loader tells SDXL's two encoders apart only by width (create_diffusers_clip_model_
    # from_ldm): with equal widths (random:tiny-xl, digits-xl) text_encoder_2 is filled from CLIP-L's weights
    second = {**preset.text_encoders[1], "hidden_size": 64, "intermediate_size": 128}
    unet = {**preset.unet, "cross_attention_dim": preset.text_encoders[0]["hidden_size"] + 64}
    return dataclasses.replace(preset, unet=unet, text_encoders=(preset.text_encoders[0], second))


def _sd2_shaped(preset: RandomPreset) -> RandomPreset:
    return dataclasses.replace(preset, unet={**preset.unet, "use_linear_projection": True},
                               text_encoders=({**preset.text_encoders[0], "hidden_act": "gelu"},),
                               tokenizer_pads=("!",))


# kind -> (architecture, the layout its single file is written in)
VARIANTS: dict[str, tuple[RandomPreset, str]] = {
    "sd1": (RANDOM_PRESETS["random:tiny"], "sd1"),
    "sd1-inpaint": (RANDOM_PRESETS["random:tiny-inpaint"], "sd1"),
    "sd2": (_sd2_shaped(RANDOM_PRESETS["random:tiny"]), "sd2"),
    "sdxl": (_widened_xl(RANDOM_PRESETS["random:tiny-xl"]), "sdxl"),
    "sdxl-inpaint": (_widened_xl(RANDOM_PRESETS["random:tiny-xl-inpaint"]), "sdxl"),
}


def build_modules(preset: RandomPreset, device: str | torch.device = "cpu", vocab: int | None = None
                  ) -> tuple[Any, Any, list]:
    """The preset's UNet, VAE and text encoders, random from seed 0 (the caller's RNG state is left alone); on
    torch.device("meta") nothing is allocated. `vocab` overrides the text encoders' vocabulary size."""
    from diffgraph.models.loader import preset_modules

    unet, vae, encoders = preset_modules(preset, device, vocab)
    return unet, vae, encoders


def variant_folder(dest: str, kind: str) -> str:
    """Writes the small test model `kind` (a VARIANTS key) as a diffusers folder `dest/kind` and returns it. The
    weights are random from a fixed seed: the same kind gives the same files."""
    from diffgraph.models.tokenizer import preset_tokenizer

    if kind not in VARIANTS:
        raise ValueError(f"variant {kind!r} is not one of {', '.join(VARIANTS)}")
    preset = VARIANTS[kind][0]
    unet, vae, encoders = build_modules(preset)
    folder = os.path.join(dest, kind)
    pipeline_of(unet, vae, encoders, [preset_tokenizer(p) for p in preset.tokenizer_pads], dict(SD_SCHEDULER_CONFIG),
              force_zeros=preset.family == "sdxl").save_pretrained(folder, safe_serialization=True)
    return folder


# -- full-size layouts, shapes only ----------------------------------------------------------------------------------

# SD 2.x (stabilityai/stable-diffusion-2-1): the SD1.5 UNet with head dims per block, 1024-wide cross-attention and
# linear projections; OpenCLIP ViT-H's text tower, of which diffusers keeps 23 of the 24 layers
SD2 = RandomPreset(
    name="sd2", family="sd", native_size=768, description="full-size SD 2.x architecture (shapes only)",
    unet={**RANDOM_PRESETS["random:sd15"].unet, "sample_size": 96, "cross_attention_dim": 1024,
          "attention_head_dim": (5, 10, 20, 20), "use_linear_projection": True, "upcast_attention": True},
    vae={**RANDOM_PRESETS["random:sd15"].vae, "sample_size": 768},
    text_encoders=({**RANDOM_PRESETS["random:sd15"].text_encoders[0], "hidden_size": 1024, "intermediate_size": 4096,
                    "num_hidden_layers": 23, "num_attention_heads": 16, "hidden_act": "gelu"},),
    tokenizer_pads=("!",))

FULL_SIZE = {"random:sd15": (RANDOM_PRESETS["random:sd15"], "sd1"), "sd2": (SD2, "sd2"),
             "random:sdxl": (RANDOM_PRESETS["random:sdxl"], "sdxl"),
             "random:sd15-inpaint": (RANDOM_PRESETS["random:sd15-inpaint"], "sd1")}


def full_size_modules(preset: str) -> tuple[Any, Any, list]:
    """A full-size architecture's modules on the meta device, with CLIP's real vocabulary."""
    if preset not in FULL_SIZE:
        raise ValueError(f"full-size preset {preset!r} is not one of {', '.join(FULL_SIZE)}")
    return build_modules(FULL_SIZE[preset][0], device="meta", vocab=REAL_VOCAB)


def shapes(state: dict[str, torch.Tensor], dtype: str = "F16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Key -> (safetensors dtype, shape): floating tensors as `dtype`, int64 ones (position_ids) as I64."""
    return {k: ("I64" if v.dtype == torch.int64 else dtype, tuple(v.shape)) for k, v in state.items()}


def full_size_layout(preset: str, layout: str | None = None,
                     dtype: str = "F16") -> dict[str, tuple[str, tuple[int, ...]]]:
    """The original-layout key names, dtypes and shapes of a full-size checkpoint: "random:sd15" (sd1), "sd2",
    "random:sdxl" (sdxl), "random:sd15-inpaint"; `layout` defaults to the preset's own. Built on the meta device."""
    return shapes(to_original(*full_size_modules(preset), layout or FULL_SIZE[preset][1]), dtype)


def header_only(path: str, tensors: dict[str, tuple[str, tuple[int, ...]]],
                metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file whose header describes `tensors` (key -> (dtype, shape), data offsets laid out
    as safetensors would) but which holds none of their bytes: the file ends with the header."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        size = _DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
