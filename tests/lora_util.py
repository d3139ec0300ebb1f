"""Writing LoRA test files from random weights (shared by the LoRA tests): the diffusers/PEFT layout with peft and
diffusers' save_lora_weights, and the kohya / A1111 layout with alphas."""

from __future__ import annotations

import copy
import os

import torch
from safetensors.torch import save_file

from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model  # the test extra has peft

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _peft_weights(module, targets, rank, seed):
    torch.manual_seed(seed)
    m = copy.deepcopy(module)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False), m)
    return get_peft_model_state_dict(m)


def _pipeline_class(engine) -> str:
    return "StableDiffusionXLPipeline" if engine.model.family == "sdxl" else "StableDiffusionPipeline"


def _write_diffusers(engine, path, rank=4, seed=0):
    import diffusers

    m = engine.model
    parts = {"unet_lora_layers": _peft_weights(m.denoiser, UNET_TARGETS, rank, seed),
             "text_encoder_lora_layers": _peft_weights(m.text_encoders[0], TEXT_TARGETS, rank, seed + 1)}
    if m.family == "sdxl":
        parts["text_encoder_2_lora_layers"] = _peft_weights(m.text_encoders[1], TEXT_TARGETS, rank, seed + 2)
    getattr(diffusers, _pipeline_class(engine)).save_lora_weights(os.path.dirname(path), **parts,
                                                                  weight_name=os.path.basename(path))
    return parts


def _write_kohya(engine, path, rank=4, seed=0, alpha=2.0):
    """The kohya / A1111 layout: lora_unet_* / lora_te_* keys, lora_down / lora_up, and an alpha per layer."""
    parts = _write_diffusers(engine, path + ".tmp.safetensors", rank, seed)
    os.remove(path + ".tmp.safetensors")
    prefixes = {"unet_lora_layers": "lora_unet_", "text_encoder_lora_layers": "lora_te_text_model_"}
    if engine.model.family == "sdxl":
        # UNet only: with transformers 5 (CLIP models without their `text_model.` level) diffusers' own
        # load_lora_weights, the oracle here, fails on kohya SDXL text-encoder keys (an empty rank table)
        prefixes = {"unet_lora_layers": "lora_unet_"}
    out = {}
    for part, prefix in prefixes.items():
        for key, value in parts[part].items():
            module, _, kind = key.rpartition(".lora_")
            name = prefix + module.replace(".", "_")
            out[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value.contiguous()
            out[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(out, path)




def side_path_adapter(engine, seed, rank=2, scale=0.05, layers=None, dtype=torch.float32) -> dict:
    """A diffusers/PEFT-layout adapter of `rank` on the first `layers` UNet side paths of `engine` (None: every one),
    its weights random times `scale`, saved as `dtype`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path, slot in list(engine.runner.loras.banks["unet"].layers.items())[:layers]:
        a = torch.randn(rank, slot.a.shape[2], generator=g) * scale
        b = torch.randn(slot.b.shape[2], rank, generator=g) * scale
        out[f"unet.{path}.lora_A.weight"], out[f"unet.{path}.lora_B.weight"] = a.to(dtype), b.to(dtype)
    return out
