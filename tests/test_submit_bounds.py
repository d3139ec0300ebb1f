"""Time bounds on the submission itself (issue 28 point 5): an engine client whose `submit` does not return (a
replica stopped with SIGSTOP, a saturated remote deployment) answers the HTTP request 504 at the request timeout
instead of holding it forever, and the request, if it is queued after all, is aborted at once."""

import asyncio
import threading
import time

import pytest

from diffgraph.engine.async_engine import AsyncEngine
from diffgraph.request import RequestAborted


class StuckSubmit(AsyncEngine):
    """Its submissions wait until `release` is set (on a worker thread, as a stalled pipe would)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.release = threading.Event()
        self.late: list = []  # the errors the late submissions ended with
        self.landed = threading.Event()

    async def submit(self, request, progress=False):
        if not request.prompt.startswith("stuck"):
            return await super().submit(request, progress)
        await asyncio.to_thread(self.release.wait)
        handle = await super().submit(request, progress)
        finish = handle.finish

        def recorded(result, error):
            self.late.append(error)
            self.landed.set()
            finish(result, error)
        handle.finish = recorded  # the core answers through this sink
        return handle

    def close(self) -> None:
        """The app closes the engine it serves; the suite's shared engine stays open for later files (conftest
        closes it at the end)."""
        self._closed = True


@pytest.fixture(scope="module")
def stuck(tiny_engine):
    from fastapi.testclient import TestClient

    from diffgraph.server import ServerConfig, create_app
    engine = StuckSubmit(tiny_engine)
    app = create_app(ServerConfig(model="random:tiny", device="cpu", request_timeout=1.5, max_pixels=0),
                     engine_factory=lambda: engine)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200 or _wait_ready(client)
        yield client, engine
    engine.release.set()


def _wait_ready(client):
    deadline = time.monotonic() + 300  # a failure bound: a closed engine is never ready
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/ready").text
        threading.Event().wait(0.05)
    return True


def test_a_submission_that_does_not_return_is_a_504_at_the_request_timeout_and_aborted_when_it_lands(stuck):
    client, engine = stuck
    size = engine.info.native_size
    r = client.post("/v1/images/generations", json={"prompt": "stuck", "size": f"{size}x{size}",
                                                    "num_inference_steps": 2})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "timeout" and "did not accept the request" in r.json()["error"]["message"]
    # the server still serves, and the stuck submission, once it lands, is aborted rather than run for nobody
    ok = client.post("/v1/images/generations", json={"prompt": "fine", "size": f"{size}x{size}",
                                                     "num_inference_steps": 2})
    assert ok.status_code == 200, ok.text
    engine.release.set()
    ok = client.post("/v1/images/generations", json={"prompt": "fine again", "size": f"{size}x{size}",
                                                     "num_inference_steps": 1})
    assert ok.status_code == 200
    assert engine.landed.wait(60)
    assert len(engine.late) == 1 and isinstance(engine.late[0], RequestAborted)
