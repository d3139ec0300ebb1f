"""Pinned host staging for the step's per-step inputs (two slots per resolution group, used in turn) and for a
decode's pixels on their way back (`DecodedPixels`).

Each step the model runner fills one slot (the coefficient table, the denoiser-row index table, ancestral noise
rows) and issues asynchronous copies to the device; the slot is reused two steps later, after the event of its last
copy has passed, so the host never overwrites what the GPU has not read yet and never waits for the GPU otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
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


class DecodedPixels:
    """A decode's float pixels [n, H, W, 3] in host memory (pinned on a GPU), copied chunk by chunk (the VAE's
    replays) on the device's stream: reading rows waits only for the chunk that holds the last of them (the chunks
    before it are in by stream order), so the requests of a decode's first chunks are answered while its later chunks
    decode. Calling it waits for every row. Read on the image threads, from several at once."""

    def __init__(self, host: torch.Tensor, chunks: list[tuple[int, torch.cuda.Event | None]],
                 on_device: Callable[[], ContextManager]):
        """`chunks`: in order, each chunk's end row and the event after its copy (None: copied already, on the CPU)."""
        self.host, self._chunks, self._on_device = host, chunks, on_device

    def rows(self, first: int, count: int) -> np.ndarray:
        """Rows [first, first + count), waiting for the copy of the chunk holding the last of them."""
        chunk = next((c for c in self._chunks if c[0] >= first + count), None)
        if chunk is None or first < 0 or count < 1:
            raise IndexError(f"rows [{first}, {first + count}) are not in this decode's {self.host.shape[0]} rows")
        event = chunk[1]
        if event is not None:
            with self._on_device():  # on an image thread: the runner's device current there, not GPU 0
                event.synchronize()
        return self.host.numpy()[first:first + count]

    def __call__(self) -> np.ndarray:
        return self.rows(0, self.host.shape[0])
