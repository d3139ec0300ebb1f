"""What every router of the app is built from: the server state (requests.py: the engine, its model's `ModelInfo`,
the drain flags, the metrics), the model routing of --model-dir (server/models.py; None without it), the API keys as
bytes (auth.py) and the textual-inversion embeddings folder. app.py builds one `AppContext` and hands it to each
router factory; the routes read it and keep no state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from ..api.protocol import APIError
from .models import ModelRouting
from .requests import ServerState

if TYPE_CHECKING:
    from ..text.embeddings import EmbeddingDir


@dataclass(frozen=True)
class AppContext:
    """The server state and what the routers share beside it."""

    state: ServerState
    routing: ModelRouting | None
    keys: tuple[bytes, ...]
    embedding_dir: EmbeddingDir | None


def error_response(e: APIError) -> JSONResponse:
    """An APIError as its JSON answer."""
    # a body refused while it arrives (too long, too slow): close, rather than read the rest of it to keep the
    # connection
    headers = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
