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

    def tokenize(self, prompts: list[str]) -> list[torch.Tensor]:
        """Token ids per tokenizer, [n, 77] int64 on the CPU; warns when a prompt is truncated."""
        ids = []
        for tokenizer in self.model.tokenizers:
            for prompt in prompts:
                dropped = truncated_token_count(tokenizer, prompt)
                if dropped:
                    logger.warning("prompt truncated: CLIP reads %d tokens, %d token(s) dropped from %r",
                                   tokenizer.model_max_length, dropped, prompt[:60])
            tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                               truncation=True, return_tensors="pt")
            ids.append(tokens.input_ids)
        return ids

    @property
    def needs_attention_mask(self) -> bool:
        return any(getattr(e.config, "use_attention_mask", False) for e in self.model.text_encoders)

    @torch.no_grad()
    def encode_ids(self, ids: list[torch.Tensor]) -> PromptEmbeddings:
        """The encoders on token ids (on the model's device): a pure tensor function, so it can be captured."""
        model = self.model
        embeds_list: list[torch.Tensor] = []
        pooled = None
        for token_ids, encoder in zip(ids, model.text_encoders):
            if model.family == "sdxl":
                out = encoder(token_ids, output_hidden_states=True)
                if out[0].ndim == 2:  # CLIPTextModelWithProjection: the pooled projection comes first
                    pooled = out[0]
                embeds_list.append(out.hidden_states[-2])
            else:  # encoders that need the attention mask go through _encode_with_mask
                embeds_list.append(encoder(token_ids)[0])
        embeds = torch.cat(embeds_list, dim=-1) if len(embeds_list) > 1 else embeds_list[0]
        return PromptEmbeddings(embeds.to(model.dtype), None if pooled is None else pooled.to(model.dtype))

    def encode(self, prompts: list[str]) -> PromptEmbeddings:
        """One row per prompt, in the model's dtype, on its device (eager)."""
        if self.needs_attention_mask:
            return self._encode_with_mask(prompts)
        return self.encode_ids([i.to(self.model.device) for i in self.tokenize(prompts)])  # eager path

    @torch.no_grad()
    def _encode_with_mask(self, prompts: list[str]) -> PromptEmbeddings:
        # SD encoders whose config sets use_attention_mask get the tokenizer's own mask, as diffusers does
        tokenizer, encoder = self.model.tokenizers[0], self.model.text_encoders[0]
        tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                           truncation=True, return_tensors="pt")
        out = encoder(tokens.input_ids.to(self.model.device), attention_mask=tokens.attention_mask.to(self.model.device))
        return PromptEmbeddings(out[0].to(self.model.dtype), None)

    def zero_missing(self, out: PromptEmbeddings, negative_prompts: list[str | None]) -> PromptEmbeddings:
        """Negative prompts' embeddings (encoded with "" for None) as diffusers uses them: with SDXL's
        force_zeros_for_empty_prompt a missing negative prompt (None) is all zeros, embeds and pooled."""
        if self.model.family == "sdxl" and self.model.force_zeros_for_empty_prompt:
            for i, p in enumerate(negative_prompts):  # per-row fills: no host-to-device copy, no sync
                if p is None:
                    out.embeds[i].zero_()
                    out.pooled[i].zero_()
        return out


def add_time_ids(height: int, width: int) -> list[float]:
    """SDXL's micro-conditioning: original size, crop top-left, target size (diffusers' defaults)."""
    return [float(height), float(width), 0.0, 0.0, float(height), float(width)]
