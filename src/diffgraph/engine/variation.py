"""A request's initial noise: normal draws from its generator, or AUTOMATIC1111's variation seed over them
(`Variation`: its `create_random_tensors` and `slerp`, row by row)."""
from __future__ import annotations

import torch

from ..request import GenerationRequest, Size, Variation


def slerp(val: float, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """AUTOMATIC1111's slerp of one image's noise [C, H, W]: normalised along dim 1 (each channel's column), one
    angle per (channel, column); near-parallel noises (mean cosine above 0.9995) are interpolated linearly."""
    low_norm = low / torch.norm(low, dim=1, keepdim=True)
    high_norm = high / torch.norm(high, dim=1, keepdim=True)
    dot = (low_norm * high_norm).sum(1).clamp(-1.0, 1.0)
    if dot.mean() > 0.9995:
        return low * (1 - val) + high * val
    omega = torch.acos(dot)
    so = torch.sin(omega)
    return (torch.sin((1.0 - val) * omega) / so).unsqueeze(1) * low + (torch.sin(val * omega) / so).unsqueeze(1) * high


def paste_centred(noise: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`noise` [.., C, h, w] pasted centred into `target` [.., C, H, W] (cropped centred where larger), in place."""
    (h0, w0), (h1, w1) = noise.shape[-2:], target.shape[-2:]
    dy, dx = (h1 - h0) // 2, (w1 - w0) // 2
    h, w = (h0 if dy >= 0 else h0 + 2 * dy), (w0 if dx >= 0 else w0 + 2 * dx)
    ty, tx, sy, sx = max(dy, 0), max(dx, 0), max(-dy, 0), max(-dx, 0)
    target[..., ty:ty + h, tx:tx + w] = noise[..., sy:sy + h, sx:sx + w]
    return target


def _from_shape(variation: Variation, shape: tuple[int, ...], size: Size) -> tuple[int, ...]:
    """The latent shape the variation's noises are drawn at: its resize_from image size's, else `shape`."""
    if variation.resize_from is None or tuple(variation.resize_from) == (size[1], size[0]):
        return shape
    factor = size[0] // shape[-2]  # pixels per latent cell
    width, height = variation.resize_from
    return (*shape[:-2], max(1, height // factor), max(1, width // factor))


def initial_noise(request: GenerationRequest, generator: torch.Generator, rows: int, shape: tuple[int, ...],
                  dtype: torch.dtype, size: Size) -> torch.Tensor:
    """`rows` of the request's initial noise in image latent `shape` [C, H, W] at image `size` (height, width):
    draws from its `generator`; with a variation, those drawn at its from-shape, each row slerped towards the same
    rows drawn from a generator seeded with its subseed, and (resized) pasted centred into a fresh draw of the
    request's seed at `shape` (AUTOMATIC1111's order). Computed in float32, returned in `dtype`."""
    variation = request.variation
    if variation is None:
        return torch.randn((rows, *shape), generator=generator, dtype=dtype)
    drawn = _from_shape(variation, shape, size)
    noise = torch.randn((rows, *drawn), generator=generator, dtype=dtype).float()
    if variation.strength > 0:
        sub = torch.Generator("cpu").manual_seed(variation.subseed)
        subnoise = torch.randn((rows, *drawn), generator=sub, dtype=dtype).float()
        noise = torch.stack([slerp(variation.strength, a, b) for a, b in zip(noise, subnoise)])
    if tuple(drawn) != tuple(shape):
        fresh = torch.Generator("cpu").manual_seed(request.seed)
        noise = paste_centred(noise, torch.randn((rows, *shape), generator=fresh, dtype=dtype).float())
    return noise.to(dtype)
