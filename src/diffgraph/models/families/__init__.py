"""Model-family adapters (one module per family) and the registry that maps a pipeline to its adapter."""

from .base import Conditioning, FamilyAdapter, FamilyRegistry
from .sd import SDFamily
from .sdxl import SDXLFamily


def default_registry() -> FamilyRegistry:
    """A fresh registry of the built-in families (SD1.x/SD2.x, SDXL); register more on it."""
    return FamilyRegistry((SDFamily(), SDXLFamily()))


__all__ = ["Conditioning", "FamilyAdapter", "FamilyRegistry", "SDFamily", "SDXLFamily", "default_registry"]
