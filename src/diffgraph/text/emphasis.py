"""AUTOMATIC1111's emphasis on encoded prompt windows: each token's hidden state times its weight.

"original" (AUTOMATIC1111's default): the window's mean is restored after weighting (z * w, then times
mean(z) / mean(z * w)); "no_norm": weights only (its advice for SDXL). The mean is taken per window of one prompt,
where AUTOMATIC1111 takes it per window over its batch, so a row never depends on the rows encoded beside it (equal
for a batch of one). SDXL's two encoders are weighted apart (`widths`: the slices of the concatenated states), as
AUTOMATIC1111 weights each embedder's output before concatenating them.
"""

from __future__ import annotations

import torch


def emphasize(z: torch.Tensor, weights: torch.Tensor, widths: list[int], mode: str) -> torch.Tensor:
    """z [windows, tokens, sum(widths)], weights [windows, tokens] -> weighted z (z's dtype; fp32 inside)."""
    if bool((weights == 1).all()):
        return z
    parts, start = [], 0
    w = weights.to(device=z.device, dtype=torch.float32).unsqueeze(-1)
    for width in widths:
        part = z[..., start:start + width].float()
        weighted = part * w
        if mode == "original":
            weighted = weighted * (part.mean(dim=(1, 2), keepdim=True) / weighted.mean(dim=(1, 2), keepdim=True))
        parts.append(weighted)
        start += width
    return torch.cat(parts, dim=-1).to(z.dtype)
