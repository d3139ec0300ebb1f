"""Faults of the AUTOMATIC1111 routes found in review, in process on `digits` (CPU): an /interrupt while a request's
images are being submitted (some queued in the engine, the next one not yet accepted)."""

from __future__ import annotations

import asyncio
import threading

from test_a1111_review import SMALL, client  # noqa: F401  (the module's in-process server on digits)

from diffgraph.request import GenerationResult, RequestAborted
from diffgraph.server import a1111

BOUND_S = 300  # a failure bound for waits on a state, never a timing assumption


class HeldHandle:
    """An image in the engine that runs until it is aborted (or the test lets it finish): its end is an event of
    the test, never a step count racing the interrupt."""

    def __init__(self, request, finish: threading.Event):
        self.request, self.request_id, self.finish = request, request.request_id, finish
        self.aborted = threading.Event()
        self.dropped_previews = 0

    def abort(self) -> bool:
        self.aborted.set()
        return True

    async def events(self):
        while not (self.aborted.is_set() or self.finish.is_set()):
            await asyncio.sleep(0.01)
        if self.aborted.is_set():
            raise RequestAborted(self.request_id)
        yield GenerationResult(self.request_id, None, self.request.seed, {}, self.request, [b"png"])


def test_an_interrupt_while_a_requests_images_are_submitted_stops_all_of_them(client, monkeypatch):
    """The request became the key's job only once every image was queued: an /interrupt after its first image was in
    the engine (the job had begun, AUTOMATIC1111's state.begin) but before the last was accepted found no job, and
    every image ran to the end."""
    second_entered, accept_second, finish = threading.Event(), threading.Event(), threading.Event()
    handles: list[HeldHandle] = []

    async def submit(state, request, progress, client=None, deadline=None, http=None):
        if handles:  # the second image: the engine answers when the test says
            second_entered.set()
            await asyncio.to_thread(accept_second.wait, BOUND_S)
        handles.append(HeldHandle(request, finish))
        return handles[-1]

    monkeypatch.setattr(a1111, "submit", submit)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=client.post("/sdapi/v1/txt2img",
                                                                      json={**SMALL, "batch_size": 2})))
    thread.start()
    try:
        assert second_entered.wait(BOUND_S), "the second image is being submitted"
        assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 1  # the job has begun
        assert client.post("/sdapi/v1/interrupt").status_code == 200
        accept_second.set()
        thread.join(BOUND_S)
    finally:
        accept_second.set()
        finish.set()  # before the fix nothing aborted them: they end here, not at the request timeout
        thread.join(BOUND_S)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert [h.aborted.is_set() for h in handles] == [True, True]
    assert r.json()["images"] == [] and "2 of 2 images were stopped" in r.json()["warnings"][0]
    assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0
