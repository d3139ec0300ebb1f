"""AUTOMATIC1111's emphasis on encoded prompt windows: each token's hidden state times its weight.

"original" (AUTOMATIC1111's default): the window's mean is restored after weighting (z * w, then times
mean(z) / mean(z * w)); "no_norm": weights only (its advice for SDXL). The mean is taken per window of one prompt,
where AUTOMATIC1111 takes it per window over its batch, so a row never depends on the rows encoded beside it (equal
for a batch of one). SDXL's two encoders are weighted apart (`widths`: the slices of the concatenated states), as
AUTOMATIC1111 weights each embedder's output before concatenating them. A window whose weighted mean is numerically
0 (states centred by a final layer norm without bias, as a random-initialised encoder's are) keeps the weights alone:
restoring a mean of 0 divides rounding noise by rounding noise, which AUTOMATIC1111 lets overflow.
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
            weighted = weighted * _restored(part, weighted)
        parts.append(weighted)
        start += width
    return torch.cat(parts, dim=-1).to(z.dtype)


def _restored(part: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    """Per window, mean(part) / mean(weighted); 1 where the weighted mean is under 1e-4 of its mean magnitude."""
    mean = weighted.mean(dim=(1, 2), keepdim=True)
    centred = mean.abs() <= 1e-4 * weighted.abs().mean(dim=(1, 2), keepdim=True)
    return torch.where(centred, torch.ones_like(mean), part.mean(dim=(1, 2), keepdim=True) / mean)
