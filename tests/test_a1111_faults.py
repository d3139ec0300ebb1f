"""Faults of the AUTOMATIC1111 routes found in review, in process on `digits` (CPU): an /interrupt while a request's
images are being submitted (some queued in the engine, the next one not yet accepted); hostile infotexts and prompts
(sized before they are parsed, parsed on a worker thread while /health answers)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from offloop_util import HeldParser, post_while_probing
from test_a1111_review import SMALL, client  # noqa: F401  (the module's in-process server on digits)

from diffgraph.request import GenerationResult, RequestAborted
from diffgraph.server import a1111, a1111_protocol
from diffgraph import prompt_syntax as syntax

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


LIMIT = 4096  # the default --max-prompt-bytes of the module's server


def test_the_longest_hostile_infotext_is_read_off_the_event_loop_while_health_answers(client, monkeypatch):
    """An infotext whose settings line ends in a long run with no ':' (AUTOMATIC1111's re_param rescanned it from
    every start: 96,000 characters froze every route, /health included, for minutes), at the infotext limit: read
    on a worker thread while /health answers, and its settings honoured."""
    held = HeldParser(a1111_protocol.parse_infotext)
    monkeypatch.setattr(a1111_protocol, "parse_infotext", held)
    head = "a handwritten digit three\nSteps: 2, Sampler: Euler, Seed: 5, Size: 64x64, Note"
    text = head + " x" * ((a1111_protocol.infotext_limit(LIMIT) - len(head)) // 2)
    r, health = post_while_probing(client, held, "/sdapi/v1/txt2img", {"infotext": text})
    assert (health, held.first) == (200, (False, True))
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert (info["prompt"], info["seed"], info["steps"], info["width"], info["sampler_name"]) == \
        ("a handwritten digit three", 5, 2, 64, "Euler")


def test_an_infotext_over_its_limit_is_refused_before_it_is_read(client, monkeypatch):
    held = HeldParser(a1111_protocol.parse_infotext)
    monkeypatch.setattr(a1111_protocol, "parse_infotext", held)
    r = client.post("/sdapi/v1/txt2img", json={"infotext": "a" * 96_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "infotext"
    assert f"the limit is {a1111_protocol.infotext_limit(LIMIT)}" in r.json()["error"]["message"]
    assert held.calls == 0


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_prompt_over_the_limit_is_refused_before_it_is_parsed(client, monkeypatch, field):
    """20,000 characters of '<a:' (quadratic in the tag pattern) were parsed, on the event loop, before the limit
    refused them."""
    held = HeldParser(syntax.schedule_a1111)
    monkeypatch.setattr(syntax, "schedule_a1111", held)
    r = client.post("/sdapi/v1/txt2img", json={**SMALL, field: "<a:" * 6666})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert f"has 19998 bytes (UTF-8); the limit is {LIMIT} (--max-prompt-bytes)" in r.json()["error"]["message"]
    assert held.calls == 0


@pytest.mark.parametrize("prompt,needle", [
    ("x <lora" + " " * (LIMIT - 7), "does not close"),
    ("<lora:a:" + "1" * (LIMIT - 10) + "x>", "is not a number"),
], ids=["spaces after <lora", "long scale"])
def test_the_worst_prompts_within_the_limit_are_parsed_off_the_event_loop(client, monkeypatch, prompt, needle):
    held = HeldParser(syntax.schedule_a1111)
    monkeypatch.setattr(syntax, "schedule_a1111", held)
    r, health = post_while_probing(client, held, "/sdapi/v1/txt2img", {**SMALL, "prompt": prompt})
    assert (health, held.first) == (200, (False, True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and needle in r.json()["error"]["message"]
