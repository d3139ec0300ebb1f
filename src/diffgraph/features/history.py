"""The samplers' history slots as a row feature: the per-row state a sampler keeps beyond D_prev.

A multistep solver of third order (DPM++ 3M SDE, UniPC order 3), LMS (its last derivatives), UniPC (its corrected
sample) and the two-evaluation samplers (Heun, DPM2: the state before a step's first half) keep up to
`HISTORY_SLOTS` latent-sized values per row (sampling/table.py). The sampler declares how many its plan uses
(`SamplerPlan.history`); their update is columns of the sampler's own coefficient table, zero for every sampler that
keeps none, so rows of every sampler share one step and its replays. Fields: `hist.h1..h3` (neutral 0: a row starts
with empty history); after the base update, x_next gains E1 * H1 + E2 * H2 + E3 * H3 and the slots take their new
values (`sampling.table.apply_history`, the tested reference itself). The update costs a few elementwise passes over
the latents, nothing beside the denoiser, so it runs in every step rather than as a variant with its own graphs.
The group's step buffers hold the slots for every row (a shared replay reads them all); a request's own row state
holds only the slots its sampler declares (`FieldSpec.history_slot`): a preempted row saves and restores those alone.
"""

from __future__ import annotations

import torch

from ..sampling.table import HISTORY_SLOTS, apply_history
from .base import FieldSpec, RowFeature, StepView

SLOT_FIELDS = tuple(f"hist.h{k}" for k in range(1, HISTORY_SLOTS + 1))


class SamplerHistory(RowFeature):
    name = "hist"

    def fields(self, latent_shape: tuple[int, ...]) -> dict[str, FieldSpec]:
        return {name: FieldSpec(latent_shape, torch.float32, history_slot=k) for k, name in enumerate(SLOT_FIELDS, 1)}

    def after_update(self, view: StepView, x_next: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
        f = view.fields
        slots = [f[name] for name in SLOT_FIELDS]
        extra, updated = apply_history(view.coefs, f["x"], denoised, f["d_prev"], slots)
        for slot, value in zip(slots, updated):
            slot.copy_(value)
        return x_next + extra
