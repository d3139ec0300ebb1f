"""Image prompts (IP-Adapter) as a row feature: per row, the image tokens' keys and values of every
cross-attention layer, for both guidance branches, and a scale; rows with different IP-Adapters, images and scales,
and rows without any, share one step.

IP-Adapter adds to each cross-attention layer a second attention over image tokens (diffusers'
IPAdapterAttnProcessor2_0): `out = attn(q, text) + scale * attn(q, to_k_ip(tokens), to_v_ip(tokens))`, before the
output projection. A row's tokens do not change from step to step, so their keys and values are computed once per
request on the submitting thread (engine/ip_adapters.py) and written into the row's fields at admission:
`ip.k{j}` / `ip.v{j}` for layer j (the UNet's cross-attention layers in diffusers' order), `ip.nk{j}` / `ip.nv{j}` for
the second guidance branch (the projection of the negative image embedding, as diffusers' pipelines make it), and
`ip.mask` (1 for a row's tokens, up to `MAX_TOKENS`: several images' tokens are one attention, diffusers' way). No
adapter weights are on the device and none are shared, so any mix of adapters runs in one step. Column `ip.scale`.

The processors (installed once per UNet by `install`) wrap the UNet's own: with no image-prompt rows in the step
(the neutral variant) they call it unchanged; in the "on" variant they run AttnProcessor2_0's computation plus the
image tokens' attention, each denoiser row its own keys (a row without an image prompt attends to one zero token:
its addition is exactly 0).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..request import GenerationRequest
from .base import Admission, FieldSpec, RowFeature, StepView

MAX_TOKENS = 32  # image tokens a row may hold: IP-Adapter plus (16 a image) x 2 images, or base (4) x 8


class ImagePromptContext:
    """What the processors read during one denoiser call: per layer (keys, values) [D, heads, tokens, head_dim],
    the token mask [D, 1, 1, tokens] (bool) and the scale [D, 1, 1]; None outside the "on" variant's calls."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.mask: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None


class RowImagePromptProcessor:
    """A cross-attention layer's processor: the wrapped one, or (context set) diffusers' AttnProcessor2_0 plus the
    rows' image-token attention, as IPAdapterAttnProcessor2_0 computes it."""

    def __init__(self, base: Any, index: int, context: ImagePromptContext):
        self.base, self.index, self.context = base, index, context

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        ctx = self.context
        if ctx.kv is None:
            return self.base(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = encoder_hidden_states.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                             is_causal=False)
        out = out.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        ip_key, ip_value = ctx.kv[self.index]
        ip = F.scaled_dot_product_attention(query, ip_key, ip_value, attn_mask=ctx.mask, dropout_p=0.0,
                                            is_causal=False)
        ip = ip.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        out = out + ctx.scale.to(out.dtype) * ip
        out = attn.to_out[1](attn.to_out[0](out))
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def cross_attention_layers(unet: Any) -> list[tuple[str, Any]]:
    """(processor name, Attention module) of the UNet's cross-attention layers, in diffusers' IP-Adapter order (layer
    j is the state dict's `{1 + 2j}.to_k_ip`)."""
    modules = dict(unet.named_modules())
    return [(name, modules[name[:-len(".processor")]]) for name in unet.attn_processors
            if not name.endswith("attn1.processor") and "motion_modules" not in name]


def install(unet: Any) -> ImagePromptContext:
    """The UNet's image-prompt context, its cross-attention processors wrapped once (later calls reuse them)."""
    procs = unet.attn_processors
    layers = cross_attention_layers(unet)
    first = procs[layers[0][0]] if layers else None
    if isinstance(first, RowImagePromptProcessor):
        return first.context
    context = ImagePromptContext()
    index = {name: j for j, (name, _) in enumerate(layers)}
    unet.set_attn_processor({name: RowImagePromptProcessor(p, index[name], context) if name in index else p
                             for name, p in procs.items()})
    return context


class ImagePromptSource(Protocol):
    """What makes the image-prompt rows of an engine (engine/ip_adapters.py:IPAdapters)."""

    def feature(self) -> "ImagePromptRows": ...


class ImagePromptRows(RowFeature):
    name = "ip"

    def __init__(self, context: ImagePromptContext, dims: Sequence[int], heads: Sequence[int], dtype: torch.dtype):
        self._ctx, self._dims, self._heads, self._dtype = context, tuple(dims), tuple(heads), dtype

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        out = {"ip.mask": FieldSpec((MAX_TOKENS,), self._dtype, neutral=0.0)}
        for j, dim in enumerate(self._dims):
            for kind in ("k", "v", "nk", "nv"):
                out[f"ip.{kind}{j}"] = FieldSpec((MAX_TOKENS, dim), self._dtype)
        return out

    def columns(self) -> tuple[str, ...]:
        return ("ip.scale",)

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        prompt = request.image_prompts
        return {} if prompt is None else {"ip.scale": np.full(len(index), prompt.scale)}

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        return {name: t.to(self._dtype) for name, t in admission.image_prompts.items()}

    def variants(self) -> Sequence[Any]:
        return (None, "on")

    def part(self, admission: Admission) -> Any:
        return "on" if admission.image_prompts else None

    def variant(self, parts: Sequence[Any]) -> Any:
        return "on" if any(parts) else None

    def before_denoise(self, view: StepView, part: Any) -> None:
        if not part:
            return
        alt = view.den_alt.view(-1, 1, 1).bool()
        kv = []
        for j, heads in enumerate(self._heads):
            pair = []
            for main, second in (("k", "nk"), ("v", "nv")):
                t = torch.where(alt, view.gather(view.fields[f"ip.{second}{j}"]), view.gather(view.fields[f"ip.{main}{j}"]))
                pair.append(t.view(t.shape[0], MAX_TOKENS, heads, -1).transpose(1, 2))
            kv.append((pair[0], pair[1]))
        mask = view.gather(view.fields["ip.mask"])
        mask[:, 0] = 1.0  # a row without tokens attends to one zero token (its contribution is exactly 0)
        self._ctx.kv = kv
        self._ctx.mask = (mask > 0.5).view(-1, 1, 1, MAX_TOKENS)
        self._ctx.scale = view.gather(view.coefs[:, view.columns["ip.scale"]]).view(-1, 1, 1)

    def after_denoise(self, view: StepView, part: Any) -> None:
        self._ctx.kv = self._ctx.mask = self._ctx.scale = None
