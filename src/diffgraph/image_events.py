"""The images routes' stream events as their readers see them: the event names of OpenAI's image stream and the plain
answer joined from a request's completed events. OpenAI names a stream's events by its route: `image_generation.*` on
/v1/images/generations, `image_edit.*` on /v1/images/edits (its client reads an edit's stream as
`ImageEditStreamEvent`s and never sees an `image_generation.completed` there). Standard library only, below the server (server/stream.py writes
the events) and below the command line's readers (cli_progress.py, the jobs' remote client) that read them.
"""

from __future__ import annotations

from typing import Any

GENERATION = "image_generation"  # the events' prefix per route
EDIT = "image_edit"


def partial_event(kind: str) -> str:
    return f"{kind}.partial_image"


def completed_event(kind: str) -> str:
    return f"{kind}.completed"


PARTIAL, COMPLETED = partial_event(GENERATION), completed_event(GENERATION)
PARTIALS = (PARTIAL, partial_event(EDIT))        # what a reader of either route takes as a preview
COMPLETIONS = (COMPLETED, completed_event(EDIT))  # and as an image


def join_completed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The plain answer (as a non-streaming POST gives it) from a request's completed events."""
    first = events[0]
    body = {k: v for k, v in first.items() if k not in ("type", "b64_json", "url", "image_index", "n", "usage",
                                                        "size", "background", "quality", "created_at")}
    body["created"] = first["created_at"]
    body["data"] = [{k: e[k] for k in ("b64_json", "url", "revised_prompt") if e.get(k) is not None}
                    for e in sorted(events, key=lambda e: e["image_index"])]
    return body
