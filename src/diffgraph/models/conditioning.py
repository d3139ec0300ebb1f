"""Prompt conditioning exactly as diffusers' StableDiffusion(XL)Pipeline computes it, for many prompts at once.

SD1.x/2.x: CLIP tokens at the tokenizer's max length (77), the encoder's last hidden state (with the
attention mask only when the encoder's config asks for it). SDXL: both encoders' penultimate hidden
states concatenated, the second encoder's pooled projection, add_time_ids (original size, crop
origin, target size), and zeros for a missing negative prompt when force_zeros_for_empty_prompt is
set. Hands the engine plain tensors, one row per prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .loader import DiffusionModel

logger = logging.getLogger(__name__)


@dataclass
class PromptEmbeddings:
    """Encoder outputs for a list of prompts: embeds [n, 77, C]; pooled [n, P] for SDXL, else None."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None

    def select(self, index: int) -> "PromptEmbeddings":
        pooled = None if self.pooled is None else self.pooled[index:index + 1]
        return PromptEmbeddings(self.embeds[index:index + 1], pooled)


def truncated_token_count(tokenizer, prompt: str) -> int:
    """How many tokens CLIP drops from `prompt` (beyond max length, start/end tokens excluded)."""
    ids = tokenizer(prompt, padding=False, truncation=False).input_ids
    return max(0, len(ids) - tokenizer.model_max_length)


class PromptEncoder:
    """Encodes batches of prompts with a model's text encoder(s)."""

    def __init__(self, model: DiffusionModel):
        self.model = model

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> PromptEmbeddings:
        """One row per prompt, in the model's dtype, on its device."""
        model = self.model
        embeds_list: list[torch.Tensor] = []
        pooled = None
        for tokenizer, encoder in zip(model.tokenizers, model.text_encoders):
            for prompt in prompts:
                dropped = truncated_token_count(tokenizer, prompt)
                if dropped:
                    logger.warning("prompt truncated: CLIP reads %d tokens, %d token(s) dropped from %r",
                                   tokenizer.model_max_length, dropped, prompt[:60])
            tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                               truncation=True, return_tensors="pt")
            ids = tokens.input_ids.to(model.device)
            if model.family == "sdxl":
                out = encoder(ids, output_hidden_states=True)
                if out[0].ndim == 2:  # CLIPTextModelWithProjection: the pooled projection comes first
                    pooled = out[0]
                embeds_list.append(out.hidden_states[-2])
            else:
                mask = tokens.attention_mask.to(model.device) if getattr(encoder.config, "use_attention_mask", False) else None
                embeds_list.append(encoder(ids, attention_mask=mask)[0])
        embeds = torch.cat(embeds_list, dim=-1) if len(embeds_list) > 1 else embeds_list[0]
        embeds = embeds.to(model.dtype)
        if model.family == "sdxl":
            pooled = pooled.to(model.dtype)
        return PromptEmbeddings(embeds, pooled)

    def encode_negative(self, negative_prompts: list[str | None]) -> PromptEmbeddings:
        """Negative prompts; None means "no negative prompt" (diffusers' `negative_prompt=None`)."""
        zeros = self.model.family == "sdxl" and self.model.force_zeros_for_empty_prompt
        texts = ["" if p is None else p for p in negative_prompts]
        out = self.encode(texts)
        if zeros:
            keep = torch.tensor([p is not None for p in negative_prompts], device=out.embeds.device)
            out.embeds = torch.where(keep[:, None, None], out.embeds, torch.zeros_like(out.embeds))
            out.pooled = torch.where(keep[:, None], out.pooled, torch.zeros_like(out.pooled))
        return out


def add_time_ids(height: int, width: int) -> list[float]:
    """SDXL's micro-conditioning: original size, crop top-left, target size (diffusers' defaults)."""
    return [float(height), float(width), 0.0, 0.0, float(height), float(width)]
