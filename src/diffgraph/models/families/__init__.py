"""Model-family adapters (one module per family) and the registry that maps a pipeline to its adapter."""

from .base import Conditioning, FamilyAdapter, FamilyRegistry
from .flux2 import Flux2KleinFamily
from .flux2_dev import Flux2DevFamily
from .qwen_image import QwenImageFamily
from .qwen_image_edit import QwenImageEditFamily
from .sd import SDFamily
from .sdxl import SDXLFamily
from .zimage import ZImageFamily


def default_registry() -> FamilyRegistry:
    """A fresh registry of the built-in families (SD1.x/SD2.x, SDXL, Z-Image, FLUX.2 klein and dev, Qwen-Image,
    Qwen-Image-Edit); register more on it."""
    return FamilyRegistry((SDFamily(), SDXLFamily(), ZImageFamily(), Flux2KleinFamily(), Flux2DevFamily(),
                           QwenImageFamily(), QwenImageEditFamily()))


__all__ = ["Conditioning", "FamilyAdapter", "FamilyRegistry", "Flux2DevFamily", "Flux2KleinFamily",
           "QwenImageEditFamily", "QwenImageFamily", "SDFamily", "SDXLFamily", "ZImageFamily", "default_registry"]
