"""Embedded guidance as a row feature: the guidance value goes into the denoiser (one branch), as guidance-distilled
models take it: LCM-distilled SD / SDXL UNets (`unet.config.time_cond_proj_dim` set: diffusers' pipelines then run no
classifier-free guidance and pass `timestep_cond`, an embedding of `guidance_scale - 1`), or a flow transformer's
`guidance` input (Flux-dev). One field per row, written at admission; the family's denoiser reads it by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import Admission, FieldSpec, RowFeature, StepView


def lcm_embedding(guidance_scale: float, dim: int) -> torch.Tensor:
    """diffusers' `get_guidance_scale_embedding` of w = guidance_scale - 1: [dim] fp32 (sin then cos of w * 1000
    over `dim // 2` log-spaced frequencies, zero-padded to an odd `dim`)."""
    w = torch.tensor([guidance_scale - 1.0]) * 1000.0
    half = dim // 2
    step = torch.log(torch.tensor(10000.0)) / (half - 1)  # in fp32, as diffusers computes it
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)
    emb = w[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if dim % 2 == 1:
        emb = torch.nn.functional.pad(emb, (0, 1))
    return emb[0]


class EmbeddedGuidance(RowFeature):
    """`input_name`: the denoiser input it feeds; `encode`: guidance scale -> the per-row value [*shape]."""

    name = "embedded_guidance"

    def __init__(self, input_name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 encode: Callable[[float], torch.Tensor]):
        self.input_name, self._shape, self._dtype, self._encode = input_name, shape, dtype, encode

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {f"embedded.{self.input_name}": FieldSpec(self._shape, self._dtype)}

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        value = self._encode(admission.request.guidance_scale).to(self._dtype)
        return {f"embedded.{self.input_name}": value.reshape(1, *self._shape)}

    def denoiser_inputs(self, view: StepView, part: Any = None) -> dict[str, torch.Tensor]:
        return {self.input_name: view.gather(view.fields[f"embedded.{self.input_name}"])}
