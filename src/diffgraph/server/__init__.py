"""The HTTP server: OpenAI-shaped image generation over one Engine (`diffgraph serve`)."""

from .app import create_app
from .config import ServerConfig, load_config

__all__ = ["ServerConfig", "create_app", "load_config"]
