"""The SDXL family (StableDiffusionXLPipeline): two CLIP text encoders, UNet with added conditions, fp32 decode.

Conditioning as diffusers' StableDiffusionXLPipeline computes it: both encoders' penultimate hidden states
concatenated, the second encoder's pooled projection, add_time_ids (original size, crop origin, target size),
and zeros for a missing negative prompt when force_zeros_for_empty_prompt is set. Per row: `embeds`
[77, 2048] and `pooled` [1280] per CFG branch, and `time_ids` [6] per resolution. The VAE decodes in fp32 when
the model is fp16 and its config says force_upcast (SDXL's VAE overflows in fp16), from a copy, as diffusers
upcasts it.
"""

from __future__ import annotations

from typing import Any

import torch

from ...request import GroupKey, Size
from ...features.control import residual_kwargs
from ..model import DiffusionModel
from .base import CondSpec, Conditioning, FamilyAdapter
from .unet_cache import StepCache, family_denoise


def add_time_ids(height: int, width: int) -> list[float]:
    """SDXL's micro-conditioning: original size, crop top-left, target size (diffusers' defaults)."""
    return [float(height), float(width), 0.0, 0.0, float(height), float(width)]


class SDXLFamily(FamilyAdapter):
    name = "sdxl"
    side_paths = ("controlnet", "ip_adapter")
    pipeline_classes = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                        "StableDiffusionXLInpaintPipeline")
    lora_pipeline_class = "StableDiffusionXLPipeline"
    original_layouts = (("sdxl", (("conditioner.embedders.0.transformer.", "hf"),
                                  ("conditioner.embedders.1.model.", "openclip"))),)
    default_guidance = 5.0
    supports_edits = True
    edit_strength = (0.3, 0.9999)  # diffusers' StableDiffusionXLImg2ImgPipeline / StableDiffusionXLInpaintPipeline
    schedule_variants = {"align_your_steps": "align_your_steps_sdxl"}  # NVIDIA's SDXL list, as AUTOMATIC1111 picks
    text_parts = (("text_encoder", "tokenizer", "CLIPTextModel"),
                  ("text_encoder_2", "tokenizer_2", "CLIPTextModelWithProjection"))
    force_zeros_default = True
    sequence_fields = ("embeds",)
    embedding_keys = ("clip_l", "clip_g")
    preview_factors = ((0.3448, 0.4168, 0.4395), (-0.1953, -0.0290, 0.0250), (0.1074, 0.0886, -0.0163),
                       (-0.3730, -0.2499, -0.2088))  # the SDXL VAE's (AUTOMATIC1111's modules/sd_vae_approx.py)

    def capabilities(self) -> tuple[Any, ...]:
        return (StepCache(),)  # DeepCache rows (unet_cache.py)

    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        seq = model.tokenizers[0].model_max_length
        return {"embeds": ((seq, int(model.denoiser.config.cross_attention_dim)), model.dtype),
                "pooled": ((int(model.text_encoders[-1].config.projection_dim),), model.dtype)}

    def row_spec(self, model: DiffusionModel, key: GroupKey, size: Size | None = None) -> dict[str, torch.Tensor]:
        return {"time_ids": torch.tensor(add_time_ids(*(size or key)), dtype=model.dtype, device=model.device)}

    def encode_ids(self, model: DiffusionModel, ids: list[torch.Tensor], clip_skip: int | None = None) -> Conditioning:
        embeds_list: list[torch.Tensor] = []
        pooled = None
        layer = -2 - (clip_skip or 0)  # diffusers: SDXL counts from the penultimate layer
        with torch.no_grad():
            for token_ids, encoder in zip(ids, model.text_encoders):
                out = encoder(token_ids, output_hidden_states=True)
                if out[0].ndim == 2:  # CLIPTextModelWithProjection: the pooled projection comes first
                    pooled = out[0]
                embeds_list.append(out.hidden_states[layer])
        embeds = torch.cat(embeds_list, dim=-1) if len(embeds_list) > 1 else embeds_list[0]
        return {"embeds": embeds.to(model.dtype), "pooled": pooled.to(model.dtype)}

    def negative(self, model: DiffusionModel, cond: Conditioning, prompts: list[str | None]) -> Conditioning:
        if model.force_zeros_for_empty_prompt:
            for i, p in enumerate(prompts):  # per-row fills: no host-to-device copy, no sync
                if p is None:
                    for t in cond.values():
                        t[i].zero_()
        return cond

    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        added = {"text_embeds": cond["pooled"], "time_ids": rows["time_ids"]}
        if rows.get("cache.key") is not None:  # step cache rows (unet_cache.py)
            return family_denoise(model, x, t, cond["embeds"], rows, added, residual_kwargs(rows))
        return model.denoiser(x, t, encoder_hidden_states=cond["embeds"], timestep_cond=rows.get("timestep_cond"),
                          added_cond_kwargs=added, **residual_kwargs(rows), return_dict=False)[0]

    def control(self, model: DiffusionModel, net: Any, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor], image: torch.Tensor) -> tuple:
        added = {"text_embeds": cond["pooled"], "time_ids": rows["time_ids"]}
        return net(x, t, encoder_hidden_states=cond["embeds"], controlnet_cond=image, added_cond_kwargs=added,
                   return_dict=False)

    def vae_dtype(self, model: DiffusionModel) -> torch.dtype:
        if model.dtype == torch.float16 and getattr(model.vae.config, "force_upcast", False):
            return torch.float32
        return model.dtype

    def diffusers_pipeline(self, model: DiffusionModel, scheduler: Any, task: str = "text") -> Any:
        import diffusers
        cls = {"text": "StableDiffusionXLPipeline", "img2img": "StableDiffusionXLImg2ImgPipeline",
               "inpaint": "StableDiffusionXLInpaintPipeline"}[task]
        return getattr(diffusers, cls)(
            vae=model.vae, text_encoder=model.text_encoders[0], text_encoder_2=model.text_encoders[1],
            tokenizer=model.tokenizers[0], tokenizer_2=model.tokenizers[1], unet=model.denoiser, scheduler=scheduler,
            force_zeros_for_empty_prompt=model.force_zeros_for_empty_prompt, add_watermarker=False)
