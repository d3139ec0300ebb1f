"""Classifier-free guidance as a row feature, per row and per step.

A row guides at step i of its request's N steps when its scale is above 1 and, with `guidance_interval` (lo, hi)
("Applying Guidance in a Limited Interval Improves Sample and Distribution Quality", Kynkaanniemi et al., 2024),
lo <= i / N < hi. A guiding row costs two denoiser rows (its text branch and its negative prompt's); any other row
one: diffusers' pipelines skip the unconditional branch when the scale is <= 1, so those rows equal theirs exactly.
`guidance_rescale` is diffusers' rescaled CFG (Lin et al., 2023, for zero-SNR / v-prediction models), applied
where the row guides. Fields: the negative prompt's conditioning (`uncond.*`); columns: the scale this step (1 where
the row runs one branch) and the rescale factor.

A CFG++ sampler (sampling/names.py `CFGPP_SAMPLERS`: DDIM CFG++) steps along the unconditional branch's output, which
the step hands it beside the guided one, so its rows run both branches at every step the interval guides whatever
the scale, as AUTOMATIC1111 runs them: the guided output's weight is the scale times the sampler's factor (1 / 12.5),
so guidance_scale 0 walks the unconditional branch alone and no scale turns the second branch off. Outside the
interval a row runs one branch and its update is plain DDIM's on the text branch (the unguided output then is the
main one).
"""

from __future__ import annotations

import numpy as np
import torch

from ..request import GenerationRequest
from ..sampling.names import CFGPP_SAMPLERS
from .base import Admission, FieldSpec, RowFeature, StepView


def guiding_steps(request: GenerationRequest, index: np.ndarray) -> np.ndarray:
    """[rows] bool: where the request runs both branches (`index`: the step of each plan row)."""
    n = request.num_inference_steps
    i = np.asarray(index)
    on = np.full(len(i), request.guidance_scale > 1.0 or request.sampler in CFGPP_SAMPLERS)
    if request.guidance_interval is not None:
        lo, hi = request.guidance_interval
        on &= (lo * n <= i) & (i < hi * n)
    return on


class ClassifierFreeGuidance(RowFeature):
    name = "cfg"

    def __init__(self, cond_spec: dict[str, tuple[tuple[int, ...], torch.dtype]], sequence: tuple[str, ...] = ()):
        self._cond, self._sequence = cond_spec, sequence

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {f"uncond.{k}": FieldSpec(shape, dtype, tokens=k in self._sequence)
                for k, (shape, dtype) in self._cond.items()}

    def columns(self) -> tuple[str, ...]:
        return ("guidance", "guidance_rescale")

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        on = guiding_steps(request, index)
        weight = request.guidance_scale * CFGPP_SAMPLERS.get(request.sampler, 1.0)
        return {"guidance": np.where(on, weight, 1.0),
                "guidance_rescale": np.where(on, request.guidance_rescale, 0.0)}

    def branches(self, request: GenerationRequest, index: np.ndarray) -> np.ndarray:
        return np.where(guiding_steps(request, index), 2, 1)

    def has_alt_branch(self) -> bool:
        return True

    def alt_cond(self, view: StepView, name: str) -> torch.Tensor:
        return view.fields[f"uncond.{name}"]

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        return {f"uncond.{k}": v for k, v in admission.uncond.items()}

    def combine(self, view: StepView, main: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
        # a row with one branch reads the same denoiser row twice: alt + g * (main - alt) == main exactly
        guided = alt + view.column("guidance") * (main - alt)
        phi = view.column("guidance_rescale")
        dims = list(range(1, main.dim()))
        rescaled = guided * (main.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
        # where() keeps rows without rescale (phi 0) exact, and padding rows (std 0: NaN ratios) out of it
        return torch.where(phi > 0, phi * rescaled + (1 - phi) * guided, guided)
