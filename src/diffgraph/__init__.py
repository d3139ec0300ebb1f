"""diffgraph: serve Stable Diffusion-family models on CUDA graphs.

Public API: `Engine` / `AsyncEngine` (generate images, step-level batching), `GraphedUNet` (bucketed
UNet graphs for stock diffusers pipelines), `load_model` (presets and local diffusers folders),
`GenerationRequest` / `GenerationResult`, `GraphConfig`.
"""

from .config import GraphConfig
from .engine.async_engine import AsyncEngine
from .engine.client import EngineClient
from .engine.engine import Engine
from .graphs.graphed_unet import GraphedUNet
from .models.loader import load_model
from .request import (EngineClosed, EngineStepError, GenerationRequest, GenerationResult, ParamError, ProgressEvent,
                      QueueFullError, RequestAborted)

__all__ = ["AsyncEngine", "Engine", "EngineClient", "EngineClosed", "EngineStepError", "GenerationRequest",
           "GenerationResult", "GraphConfig", "GraphedUNet", "ParamError", "ProgressEvent", "QueueFullError",
           "RequestAborted", "load_model"]
__version__ = "0.1.0"
