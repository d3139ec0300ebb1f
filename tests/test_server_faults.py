"""Review of suspected server faults, in process on `digits` (CPU): a streamed request (server-sent events) is
counted by how its stream ends, not as a success when the response hands over to the stream."""

from __future__ import annotations

from test_a1111_review import client  # noqa: F401  (the module's in-process server on digits)

from diffgraph.server import image_routes
from diffgraph.api.protocol import APIError

BODY = {"prompt": "a handwritten digit three", "size": "64x64", "num_inference_steps": 2, "seed": 1}


def _outcomes(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("diffgraph_requests_total{"):
            name, value = line.split(" ")
            out[name.split('"')[1]] = float(value)
    return out


def test_a_stream_that_fails_after_the_handoff_is_counted_by_its_failure(client, monkeypatch):
    before = _outcomes(client)
    r = client.post("/v1/images/generations", json={**BODY, "stream": True})
    assert r.status_code == 200 and "event: image_generation.completed" in r.text
    done = _outcomes(client)
    assert done["success"] == before["success"] + 1

    def full(*args, **kwargs):
        raise APIError(507, "the image store is full", code="image_store_full")

    monkeypatch.setattr(image_routes, "_response", full)  # the image made, its answer not: after the handoff
    r = client.post("/v1/images/generations", json={**BODY, "stream": True})
    assert r.status_code == 200 and "event: error" in r.text and "image_store_full" in r.text
    after = _outcomes(client)
    assert after["success"] == done["success"]  # not counted a success
    assert after["error"] == done["error"] + 1
