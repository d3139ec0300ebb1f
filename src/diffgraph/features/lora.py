"""LoRA adapter rows as a row feature: per row, the device slots (0 = none) and scales of its UNet adapters.

The denoiser's side paths (lora/sidepath.py) read the slots of each denoiser row, set just before the denoiser call
and cleared after it. The variant part is the stack depth the step's side paths read: 0 (no side path: adapter-free
traffic pays nothing), 1, 4 (where more may stack: stacks of 2 to 4 pay no deeper side path) or the most a request
may stack (--max-request-loras); a step takes the smallest that covers its live rows.
Which slots a request gets is the adapter manager's business (the admission gate); this feature only writes them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from .base import Admission, FieldSpec, RowFeature, StepView


class SidePathRows(Protocol):
    """What the denoiser's side paths read (lora.sidepath.RowLoras)."""

    max_stack: int  # the most adapters a row may stack

    def set(self, idx: torch.Tensor | None, scale: torch.Tensor | None) -> None: ...


SHALLOW_STACK = 4  # the depth below the deepest that gets its own variant


class LoraRows(RowFeature):
    name = "lora"

    def __init__(self, side_paths: SidePathRows, max_stack: int):
        self._rows, self._max = side_paths, max_stack

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {"lora.idx": FieldSpec((self._max,), torch.int64), "lora.scale": FieldSpec((self._max,), torch.float32)}

    def rows(self, admission: Admission) -> dict[str, torch.Tensor | float]:
        if not admission.loras:
            return {}
        pad = list(admission.loras) + [(0, 0.0)] * (self._max - len(admission.loras))
        return {"lora.idx": torch.tensor([[s for s, _ in pad]]),
                "lora.scale": torch.tensor([[c for _, c in pad]], dtype=torch.float32)}

    def variants(self) -> Sequence[Any]:
        return tuple(sorted({0, 1, min(SHALLOW_STACK, self._max), self._max}))

    def part(self, admission: Admission) -> Any:
        return len(admission.loras)

    def variant(self, parts: Sequence[Any]) -> Any:
        need = max(parts, default=0)
        return next(k for k in self.variants() if k >= need)

    def before_denoise(self, view: StepView, part: Any) -> None:
        if part:
            self._rows.set(view.gather(view.fields["lora.idx"][:, :part]),
                           view.gather(view.fields["lora.scale"][:, :part]))

    def after_denoise(self, view: StepView, part: Any) -> None:
        if part:
            self._rows.set(None, None)
