"""Showing that a route parses user text off the event loop: the parser is wrapped so that its first call waits until
a GET /health sent meanwhile has answered. On a worker thread the probe answers at once; on the event loop it cannot
answer until the wait's failure bound has passed, and the call records that it ran there. No wall-clock assertion."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

BOUND_S = 60.0  # a failure bound for the waits, never a timing assumption


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class HeldParser:
    """Wraps a parser: every call counted (`calls`); the first one records (on the event loop?, /health answered
    while it waited?) in `first` and waits for `probed` before it parses."""

    def __init__(self, parse: Callable[..., Any]):
        self.parse, self.calls, self.first = parse, 0, None
        self.entered, self.probed = threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            on_loop = _on_event_loop()
            self.entered.set()
            self.first = (on_loop, self.probed.wait(BOUND_S))
        return self.parse(*args, **kwargs)


def post_while_probing(client, held: HeldParser, path: str, body: dict) -> tuple[Any, int]:
    """POSTs `body` to `path` on a thread; once `held` is parsing, GET /health. (the POST's response, /health's
    status)"""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(r=client.post(path, json=body)))
    thread.start()
    try:
        assert held.entered.wait(BOUND_S), "the route parsed nothing"
        health = client.get("/health").status_code
        held.probed.set()
    finally:
        held.probed.set()
        thread.join(BOUND_S)
    return out["r"], health
