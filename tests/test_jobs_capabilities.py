"""A job's items carry the served model's capability parameters (features/capability.py: `step_cache` on the SD
UNets), as an images body does: stored with the item, handed to the request as its extras when the candidate runs
(its image equals the same request made alone through /v1/images/generations), and checked when the job is submitted
(a value the model refuses is a 400 naming the item and the field, and nothing is stored). random:tiny on the CPU,
in this process; 64x64 images at 6 steps."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

BOUND_S = 600  # a failure bound for the wait on a job's state, never a timing assumption
CACHE = {"method": "deepcache", "interval": 2}


@pytest.fixture(scope="module")
def engine():
    """An engine of its own: the server closes its engine when it stops (the session's shared one must live on)."""
    from diffgraph import Engine
    return Engine("random:tiny", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    from diffgraph.server import ServerConfig
    from server_util import served
    config = ServerConfig(model="random:tiny", device="cpu", state_dir=str(tmp_path_factory.mktemp("state")))
    with served(engine, config) as c:
        yield c


def _item(engine, **fields):
    size = engine.info.native_size
    return {"prompt": "a red fox", "size": f"{size}x{size}", "num_inference_steps": 6, **fields}


def _pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def _jobs(client) -> list[str]:
    return [j["id"] for j in client.get("/v1/jobs").json()["data"]]


def test_an_item_s_step_cache_runs_and_its_image_is_the_same_request_made_alone(client, engine):
    items = [_item(engine, seeds=[5], step_cache=CACHE), _item(engine, seeds=[5])]
    r = client.post("/v1/jobs", json={"items": items})
    assert r.status_code == 200, r.text
    job = r.json()["id"]
    deadline = time.monotonic() + BOUND_S
    while (status := client.get(f"/v1/jobs/{job}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["status"] == "completed" and status["counts"]["done"] == 2, status
    results = client.get(f"/v1/jobs/{job}/results").json()["data"]
    stored = [_pixels(client.get(e["images"][0].split("testserver", 1)[-1]).content) for e in results]
    alone = []
    for item in items:
        body = {k: v for k, v in item.items() if k != "seeds"}
        a = client.post("/v1/images/generations", json={**body, "seed": 5})
        assert a.status_code == 200, a.text
        alone.append(_pixels(base64.b64decode(a.json()["data"][0]["b64_json"])))
    assert np.abs(stored[0] - alone[0]).max() <= 1  # the cached item is the cached request alone
    assert np.abs(stored[1] - alone[1]).max() <= 1
    assert np.abs(stored[0] - stored[1]).max() > 1  # and the cache ran: it is not the uncached image
    assert "step_cache" in client.get("/info").json()["extension_params"]  # what `diffgraph batch --url` reads


@pytest.mark.parametrize("value, param, words", [
    ({"method": "deepcache", "branch": 9}, "items[1].step_cache.branch", "skip branches 0..3"),  # the model's check
    ({"method": "deepcache", "interval": 0}, "items[1].step_cache.interval", "out of range"),
    ("sometimes", "items[1].step_cache", "unknown"),
])
def test_a_step_cache_the_model_refuses_is_a_400_naming_it_at_submit_and_nothing_is_stored(client, engine, value,
                                                                                         param, words):
    before = _jobs(client)
    r = client.post("/v1/jobs", json={"items": [_item(engine), _item(engine, step_cache=value)]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"], error
    assert error["message"].startswith("items[1]: ")
    assert _jobs(client) == before


def test_an_unknown_field_is_still_a_400_naming_it(client, engine):
    before = _jobs(client)
    r = client.post("/v1/jobs", json={"items": [_item(engine, step_cahce=CACHE)]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "items[0].step_cahce" and "unknown field 'step_cahce'" in error["message"], error
    assert "step_cache" in error["message"] and _jobs(client) == before
