"""The SD1.x / SD2.x family (StableDiffusionPipeline): one CLIP text encoder, UNet2DConditionModel, AutoencoderKL.

Conditioning as diffusers' StableDiffusionPipeline computes it: CLIP tokens at the tokenizer's max length (77),
the encoder's last hidden state (with the attention mask only when the encoder's config asks for it).
Per row: `embeds` [77, cross_attention_dim]. Epsilon and v-prediction both come from the noise schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from ...features.control import residual_kwargs
from ..model import DiffusionModel
from .base import CondSpec, Conditioning, FamilyAdapter, final_layer_norm
from .unet_cache import StepCache, family_denoise


class SDFamily(FamilyAdapter):
    name = "sd"
    pipeline_classes = ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline")
    lora_pipeline_class = "StableDiffusionPipeline"
    side_paths = ("controlnet", "ip_adapter")
    original_layouts = (("sd1", (("cond_stage_model.transformer.", "hf"),)),
                        ("sd2", (("cond_stage_model.model.", "openclip"),)))
    default_guidance = 7.5
    supports_edits = True
    sequence_fields = ("embeds",)
    # the SD1.x/SD2.x VAE's (AUTOMATIC1111's modules/sd_vae_approx.py)
    preview_factors = ((0.298, 0.207, 0.208), (0.187, 0.286, 0.173), (-0.158, 0.189, 0.264), (-0.184, -0.271, -0.473))

    def capabilities(self) -> tuple[Any, ...]:
        return (StepCache(),)  # DeepCache rows (unet_cache.py)

    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        seq = model.tokenizers[0].model_max_length
        return {"embeds": ((seq, int(model.denoiser.config.cross_attention_dim)), model.dtype)}

    def needs_attention_mask(self, model: DiffusionModel) -> bool:
        return any(getattr(e.config, "use_attention_mask", False) for e in model.text_encoders)

    def encode_ids(self, model: DiffusionModel, ids: list[torch.Tensor], clip_skip: int | None = None) -> Conditioning:
        encoder = model.text_encoders[0]
        with torch.no_grad():
            if clip_skip is None:
                return {"embeds": encoder(ids[0])[0].to(model.dtype)}
            # diffusers: the hidden state clip_skip layers before the last, through the final layer norm
            hidden = encoder(ids[0], output_hidden_states=True).hidden_states[-(clip_skip + 1)]
            return {"embeds": final_layer_norm(encoder)(hidden).to(model.dtype)}

    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        if not self.needs_attention_mask(model):
            return super().encode(model, prompts)
        # encoders whose config sets use_attention_mask get the tokenizer's own mask, as diffusers does
        tokenizer, encoder = model.tokenizers[0], model.text_encoders[0]
        tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                           truncation=True, return_tensors="pt")
        with torch.no_grad():
            out = encoder(tokens.input_ids.to(model.device), attention_mask=tokens.attention_mask.to(model.device))
        return {"embeds": out[0].to(model.dtype)}

    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        if rows.get("cache.key") is not None:  # step cache rows (unet_cache.py)
            return family_denoise(model, x, t, cond["embeds"], rows, None, residual_kwargs(rows))
        return model.denoiser(x, t, encoder_hidden_states=cond["embeds"], timestep_cond=rows.get("timestep_cond"),
                          **residual_kwargs(rows), return_dict=False)[0]

    def control(self, model: DiffusionModel, net: Any, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor], image: torch.Tensor) -> tuple:
        return net(x, t, encoder_hidden_states=cond["embeds"], controlnet_cond=image, return_dict=False)

    def diffusers_pipeline(self, model: DiffusionModel, scheduler: Any, task: str = "text") -> Any:
        import diffusers
        cls = {"text": "StableDiffusionPipeline", "img2img": "StableDiffusionImg2ImgPipeline",
               "inpaint": "StableDiffusionInpaintPipeline"}[task]
        return getattr(diffusers, cls)(
            vae=model.vae, text_encoder=model.text_encoders[0], tokenizer=model.tokenizers[0], unet=model.denoiser,
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
