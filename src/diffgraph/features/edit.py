"""Image-to-image and inpainting rows as a row feature (the per-row part of engine/edits.py's admission work).

An edit's rows start later in their plan from the image's latents (the sampler plan's `start_plan`; nothing here).
Inpainting with a 4-channel denoiser blends the known region back after each update: x <- (1 - mask) * (KNOWN *
image latents + KNOWN_NOISE * initial noise) + mask * x (the sampler plan's KNOWN columns: the known region noised
to the row's next state); a row without a mask has mask 1, which leaves x exactly as updated. A 9-channel inpainting
denoiser instead reads extra input channels (the mask and the masked image's latents; neutral: mask 1, latents 0).
"""

from __future__ import annotations

import torch

from ..sampling.samplers import Coef
from .base import Admission, FieldSpec, RowFeature, StepView


def edit_rows(extra_channels: int, dtype: torch.dtype) -> "EditRows":
    """The edit feature of a denoiser with `extra_channels` input channels beyond the latents' (an inpainting UNet's
    mask and masked image: `InpaintChannels`, which appends them to the step's input), or none (`EditRows`)."""
    return (InpaintChannels if extra_channels else EditRows)(extra_channels, dtype)


class EditRows(RowFeature):
    name = "edit"
    asked_by = ("edit", (None,))  # a text-to-image request writes no edit fields (they keep their neutral values)

    def __init__(self, extra_channels: int, dtype: torch.dtype):
        self.extra_channels, self._dtype = extra_channels, dtype

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        spatial = latent_shape[1:]
        out = {"edit.mask": FieldSpec((1, *spatial), torch.float32, 1.0),
               "edit.known": FieldSpec(latent_shape, torch.float32),
               "edit.noise0": FieldSpec(latent_shape, torch.float32)}
        if self.extra_channels:
            out["edit.extra"] = FieldSpec((self.extra_channels, *spatial), self._dtype,
                                          (1.0,) + (0.0,) * (self.extra_channels - 1))
        return out

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        return {f"edit.{k}": v for k, v in admission.edit.items()}


    def after_update(self, view: StepView, x_next: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
        n, co, f = view.n, view.coefs, view.fields
        m, ones = f["edit.mask"], (1,) * (x_next.dim() - 1)
        known = (co[:, int(Coef.KNOWN)].view(n, *ones) * f["edit.known"]
                 + co[:, int(Coef.KNOWN_NOISE)].view(n, *ones) * f["edit.noise0"])
        return (1 - m) * known + m * x_next


class InpaintChannels(EditRows):
    """`EditRows` of an inpainting denoiser: its input is the latents with the row's extra channels after them."""

    def model_input(self, view: StepView, x_in: torch.Tensor) -> torch.Tensor:
        return torch.cat([x_in, view.fields["edit.extra"]], dim=1)
