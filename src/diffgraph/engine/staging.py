"""Pinned host staging for the step's per-step inputs: two slots per resolution group, used in turn.

Each step the model runner fills one slot (the coefficient table, the denoiser-row index table, ancestral noise
rows) and issues asynchronous copies to the device; the slot is reused two steps later, after the event of its last
copy has passed, so the host never overwrites what the GPU has not read yet and never waits for the GPU otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StagingSlot:
    """One pinned host slot: coefficient table, index table and noise rows, with the event of its last copy."""

    coefs: torch.Tensor
    noise: torch.Tensor
    index: torch.Tensor
    event: torch.cuda.Event | None = None


class StagingPair:
    def __init__(self, rows: int, columns: int, latent_shape: tuple[int, ...], pin: bool):
        self._slots = [StagingSlot(torch.zeros((rows, columns), pin_memory=pin),
                                   torch.zeros((rows, *latent_shape), pin_memory=pin),
                                   torch.zeros((rows, 4), dtype=torch.int64, pin_memory=pin)) for _ in range(2)]
        self._turn = 0

    def nbytes(self) -> int:
        """Its (pinned, on a GPU) host bytes."""
        return sum(t.numel() * t.element_size() for s in self._slots for t in (s.coefs, s.noise, s.index))

    def next(self) -> StagingSlot:
        slot = self._slots[self._turn]
        self._turn = 1 - self._turn
        if slot.event is not None:
            slot.event.synchronize()  # the copy issued from this slot two steps ago has been consumed
        return slot
