"""diffgraph: serve Stable Diffusion-family models on CUDA graphs.

Public API: `Engine` / `AsyncEngine` (generate images, step-level batching), `GraphedUNet` (bucketed
UNet graphs for stock diffusers pipelines), `load_model` (presets and local diffusers folders),
`GenerationRequest` / `GenerationResult`, `GraphConfig`.
"""

from .config import GraphConfig
from .engine.async_engine import AsyncEngine, ProgressEvent
from .engine.engine import Engine, EngineStepError
from .engine.scheduler import QueueFullError, RequestAborted
from .graphs.graphed_unet import GraphedUNet
from .models.loader import load_model
from .request import GenerationRequest, GenerationResult

__all__ = ["AsyncEngine", "Engine", "EngineStepError", "GenerationRequest", "GenerationResult",
           "GraphConfig", "GraphedUNet", "ProgressEvent", "QueueFullError", "RequestAborted", "load_model"]
__version__ = "0.1.0"
