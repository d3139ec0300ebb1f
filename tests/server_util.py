"""Serving an engine of the test's process over HTTP (FastAPI's TestClient), once it is ready; images as bodies carry
them."""

import base64
import contextlib
import io
import threading
import time


@contextlib.contextmanager
def served(engine, config):
    """A TestClient of `create_app(config)` serving `engine` in this process, once it is ready."""
    from fastapi.testclient import TestClient

    from diffgraph.server import create_app
    with TestClient(create_app(config, engine_factory=lambda: engine), raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 300  # a failure bound: a closed engine is never ready
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            threading.Event().wait(0.05)
        yield client


def b64png(image) -> str:
    """A PIL image as a base64 PNG, as JSON bodies carry images."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@contextlib.contextmanager
def listening(config, engine_factory, sockets=None, **options):
    """`create_app(config)` served by uvicorn on a free port of 127.0.0.1 (or on `sockets`, from
    server.connections.listen) in a thread of this process, for clients that open their own connections (webuiapi's
    `requests`, the `openai` client): yields its URL once it is ready. `options`: uvicorn.Config's, e.g. its `http`
    protocol."""
    import httpx
    import uvicorn

    from diffgraph.server import create_app
    from diffgraph.server.connections import listen
    sockets = sockets or listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(config, engine_factory=engine_factory), log_level="warning",
                                           lifespan="on", ws="none", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # a failure bound: a server that never gets ready
    while True:
        try:
            if httpx.get(url + "/ready", timeout=60).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not become ready"
        threading.Event().wait(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join()


def job_first_image(client, job: str):
    """The first image of job `job` (a stored job of `client`'s server) once it has completed, as int16 pixels."""
    import numpy as np
    from PIL import Image

    deadline = time.monotonic() + 600  # a failure bound, not a timing
    while (status := client.get(f"/v1/jobs/{job}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["status"] == "completed", status
    url = client.get(f"/v1/jobs/{job}/results").json()["data"][0]["images"][0]
    return np.array(Image.open(io.BytesIO(client.get(url.split("testserver", 1)[-1]).content))).astype(np.int16)
