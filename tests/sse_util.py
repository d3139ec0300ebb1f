"""Reads diffgraph's image streams (server/stream.py) in tests: progress comment lines, previews, the completed
events joined into the plain answer, or the error event."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from diffgraph.image_events import COMPLETIONS, PARTIALS, join_completed


@dataclass
class Stream:
    progress: list[dict[str, Any]] = field(default_factory=list)
    partials: list[dict[str, Any]] = field(default_factory=list)
    completed: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    events: list[str] = field(default_factory=list)  # every event's name in order ("progress" for comment lines)

    @property
    def answer(self) -> dict[str, Any]:
        assert self.completed, f"the stream ended without an image: events {self.events}, error {self.error}"
        return join_completed(self.completed)


def read_stream(lines: Iterable[str]) -> Stream:
    out, event = Stream(), None
    for line in lines:
        if line.startswith(": progress "):
            out.progress.append(json.loads(line[len(": progress "):]))
            out.events.append("progress")
        elif line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            out.events.append(event)
            if event in PARTIALS:
                out.partials.append(data)
            elif event in COMPLETIONS:
                out.completed.append(data)
            if event == "error":
                out.error = data
    return out
