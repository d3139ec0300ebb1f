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
