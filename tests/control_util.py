"""Test helpers: ControlNets made from the presets' UNets, and control images (tests/test_controlnet.py and
tests/test_ip_adapter.py), and the check that requests submitted together equal each alone.

A ControlNet is made as diffusers' `ControlNetModel.from_unet` starts one, with its zero-initialised parts (the
residual projections and the conditioning embedding's last conv) re-initialised with seeded random weights: a
ControlNet left at zeros would add nothing, and an engine ignoring it would pass."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def make_controlnet(unet, folder: str, seed: int) -> None:
    from diffusers import ControlNetModel
    net = ControlNetModel.from_unet(unet)
    g = torch.Generator().manual_seed(seed)
    zeroed = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for m in zeroed:
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    net.save_pretrained(folder, safe_serialization=True)


def control_image(size: int, seed: int) -> Image.Image:
    """An edge-map-like control image: white strokes on black."""
    rng = np.random.default_rng(seed)
    a = np.zeros((size, size, 3), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, size - 8, 2)
        a[y:y + 8, x:x + 2] = 255
        a[y:y + 2, x:x + 8] = 255
    return Image.fromarray(a)


def assert_together_equals_alone(engine, reqs) -> list[np.ndarray]:
    """Runs each request alone, then all of them queued between two steps (admitted at one step boundary, so they
    share every step they can), and asserts each image equals its solo run within 1 uint8 level; returns the solo
    images."""
    alone = [engine.run(r).arrays for r in reqs]
    futures: list = []
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in reqs)).result()
    together = [f.result().arrays for f in futures]
    for i, (a, t) in enumerate(zip(alone, together)):
        assert np.abs(a - t).max() * 255 <= 1.0, (i, np.abs(a - t).max() * 255)
    return alone
