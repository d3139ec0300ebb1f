"""A tiny ESRGAN upscaler file for the upscaler tests: spandrel's own RRDBNet (8 filters, 1 block, 2x), randomly
initialised with a fixed seed, saved as .safetensors; and running it through spandrel directly, the reference."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from diffgraph.upscaler_models import import_spandrel


def tiny_esrgan(path, seed: int = 0, scale: int = 2) -> str:
    """Writes the tiny model (`scale`x) to `path` (a .safetensors file) and returns it."""
    import_spandrel()
    from spandrel.architectures.ESRGAN import ESRGAN  # spandrel's RRDBNet

    torch.manual_seed(seed)
    net = ESRGAN(num_filters=8, num_blocks=1, scale=scale)
    with torch.no_grad():  # larger weights than the default init, so the picture shows through
        for p in net.parameters():
            p.mul_(2.0)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return str(path)


def spandrel_upscale(path, image: Image.Image) -> np.ndarray:
    """`image` through the model at `path` as spandrel loads and runs it, whole: uint8 pixels."""
    spandrel = import_spandrel()
    model = spandrel.ModelLoader("cpu").load_from_state_dict(load_file(str(path))).eval()
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)[None]
    with torch.no_grad():
        y = model(x)[0].clamp(0, 1).permute(1, 2, 0).numpy()
    return (y * 255).round().astype(np.uint8)
