"""The HTTP server: OpenAI-shaped image generation over one Engine (`diffgraph serve`).

Imported lazily: `create_app` needs the `serve` extras (fastapi, uvicorn, prometheus_client), while the
CLI's argument parsing does not.
"""

from typing import Any

from ..api.config import ServerConfig, load_config

__all__ = ["ServerConfig", "create_app", "load_config"]


def create_app(*args: Any, **kwargs: Any):
    from .app import create_app as _create_app
    return _create_app(*args, **kwargs)
