"""diffgraph: serve Stable Diffusion-family models on CUDA graphs.

Public API: `Engine` (generate images), `load_model` (presets and local diffusers folders),
`GenerationRequest` / `GenerationResult`.
"""

from .engine.engine import Engine
from .models.loader import load_model
from .request import GenerationRequest, GenerationResult

__all__ = ["Engine", "GenerationRequest", "GenerationResult", "load_model"]
__version__ = "0.1.0"
