"""The images routes' stream events as their readers see them: the event names of OpenAI's image stream and the plain
answer joined from a request's completed events. Standard library only, below the server (server/stream.py writes
the events) and below the command line's readers (cli_progress.py, the jobs' remote client) that read them.
"""

from __future__ import annotations

from typing import Any

PARTIAL = "image_generation.partial_image"
COMPLETED = "image_generation.completed"


def join_completed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The plain answer (as a non-streaming POST gives it) from a request's completed events."""
    first = events[0]
    body = {k: v for k, v in first.items() if k not in ("type", "b64_json", "url", "image_index", "n", "usage",
                                                        "size", "background", "quality", "created_at")}
    body["created"] = first["created_at"]
    body["data"] = [{k: e[k] for k in ("b64_json", "url", "revised_prompt") if e.get(k) is not None}
                    for e in sorted(events, key=lambda e: e["image_index"])]
    return body
