"""The images routes' server-sent events (a request with "stream": true), in OpenAI's image stream shape.

    : progress {"type": "progress", "id": ..., "step": 3, "total": 20}     an SSE comment line per step
    event: image_generation.partial_image                                  a live preview (the request's
    data: {"type": ..., "b64_json": ..., "partial_image_index": 0, ...}     `preview` or `partial_images`)
    event: image_generation.completed                                      one per image of the request
    data: {"type": ..., "b64_json": ... | "url": ..., "image_index": 0, "n": 2, "id", "seed", "timings", ...}
    event: error
    data: {"error": {"message", "type", "param", "code"}, "status": 503}

On /v1/images/edits the same events are named `image_edit.partial_image` and `image_edit.completed` (OpenAI's
names there; `kind` below, image_events.py). OpenAI's client (`client.images.generate(..., stream=True)`,
`client.images.edit(..., stream=True)`) skips the comment lines and reads each event as its typed
`ImageGenPartialImageEvent` / `ImageGenCompletedEvent` (`ImageEditPartialImageEvent` / `ImageEditCompletedEvent`;
diffgraph's extra fields ride along), and raises on an event whose data holds `error`. diffgraph's own readers (the
playground, `diffgraph generate`, the benchmarks) parse the comment lines for progress and join the completed events
into the plain answer (image_events.py `join_completed`).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from ..image_events import COMPLETED, EDIT, GENERATION, PARTIAL, completed_event, join_completed, partial_event
from ..request import GenerationRequest, ProgressEvent

__all__ = ["COMPLETED", "EDIT", "GENERATION", "PARTIAL", "completed", "error", "event", "join_completed", "partials",
           "progress"]

_IMAGE_FIELDS = {"background": "opaque", "quality": "auto"}
_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
          "total_tokens": 0}  # OpenAI bills tokens for its GPT image models; diffgraph counts none


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def progress(ev: ProgressEvent) -> bytes:
    """A step done, as an SSE comment line (no event: OpenAI's client never sees it)."""
    body = {"type": "progress", "id": ev.request_id, "step": ev.step, "total": ev.total}
    return f": progress {json.dumps(body)}\n\n".encode()


def partials(ev: ProgressEvent, index: int, request: GenerationRequest, kind: str = GENERATION) -> bytes:
    """A preview event per image of the request; `index` counts the request's previews so far; `kind` names the
    route's events (image_events.py)."""
    out, name = b"", partial_event(kind)
    for i, image in enumerate(ev.previews):
        out += event(name, {"type": name, "b64_json": base64.b64encode(image).decode("ascii"),
                            "partial_image_index": index, "created_at": int(time.time()),
                            "size": f"{request.width}x{request.height}", "output_format": ev.preview_format,
                            **_IMAGE_FIELDS, "id": ev.request_id, "image_index": i, "step": ev.step,
                            "total": ev.total})
    return out


def completed(body: dict[str, Any], request: GenerationRequest, kind: str = GENERATION) -> bytes:
    """The answer (`app._response`'s body) as one completed event per image."""
    data, n, name = body["data"], len(body["data"]), completed_event(kind)
    extra = {k: v for k, v in body.items() if k not in ("data", "created")}
    return b"".join(event(name, {"type": name, "created_at": body["created"],
                                 "size": f"{request.width}x{request.height}", **_IMAGE_FIELDS, "usage": _USAGE,
                                 **image, **extra, "image_index": i, "n": n})
                    for i, image in enumerate(data))


def error(status: int, body: dict[str, Any]) -> bytes:
    return event("error", {"type": "error", "status": status, **body})
