"""diffgraph: serve Stable Diffusion-family models on CUDA graphs.

Public API: `Engine` / `AsyncEngine` (generate images, step-level batching), `GraphedUNet` (bucketed
UNet graphs for stock diffusers pipelines), `load_model` (presets and local diffusers folders),
`GenerationRequest` / `GenerationResult`, `GraphConfig`.

The names load on first access (PEP 562): `import diffgraph.cli` (the `diffgraph` command) imports this
package first, and `diffgraph --help`, `diffgraph models` and `generate --url` must not pay for torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import GraphConfig
    from .engine.async_engine import AsyncEngine
    from .engine.client import EngineClient
    from .engine.engine import Engine
    from .graphs.graphed_unet import GraphedUNet
    from .models.loader import load_model
    from .request import (EngineClosed, EngineStepError, GenerationRequest, GenerationResult, ParamError,
                          ProgressEvent, QueueFullError, RequestAborted)

__all__ = ["AsyncEngine", "Engine", "EngineClient", "EngineClosed", "EngineStepError", "GenerationRequest",
           "GenerationResult", "GraphConfig", "GraphedUNet", "ParamError", "ProgressEvent", "QueueFullError",
           "RequestAborted", "load_model"]
__version__ = "0.1.0"


# public name -> the module that defines it (imported on first access)
_HOMES = {"GraphConfig": ".config", "AsyncEngine": ".engine.async_engine", "EngineClient": ".engine.client",
          "Engine": ".engine.engine", "GraphedUNet": ".graphs.graphed_unet", "load_model": ".models.loader"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_HOMES.get(name, ".request"), __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
