"""Review of live previews and streams over HTTP: the preview settings a client can give (every 0 needs the limit it
asks for; an unknown preview field names the preview's fields) and a streaming client that stops reading (its
connection is reset once its writes have been paused for the send timeout, not held for ever).

One server in this process (uvicorn with the connection guard, as `serve` runs it) on an engine of its own; its
listening socket has a small send buffer, so that a client that reads nothing fills the buffers with a small image.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from sse_util import read_stream

MODEL = "random:tiny"
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def served():
    """(the server's URL, the peers of the connections its guard let go of)"""
    import uvicorn

    from diffgraph import Engine
    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig
    from diffgraph.server.connections import ConnectionGuard, guarded_protocol, listen

    config = ServerConfig(model=MODEL, device="cpu", header_timeout=HEADER_TIMEOUT_S, request_timeout=600,
                          max_pixels=0)
    app = create_app(config, engine_factory=lambda: Engine(MODEL, device="cpu", dtype="fp32"))
    sockets = listen("127.0.0.1", 0)
    sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by the accepted sockets
    port = sockets[0].getsockname()[1]
    class Guard(ConnectionGuard):  # records the peers of the connections it let go of
        def closed(self, conn):
            released.add(conn.transport.get_extra_info("peername"))
            super().closed(conn)

    released: set = set()
    uv = uvicorn.Config(app, log_level="warning", lifespan="on", ws="none", timeout_keep_alive=HEADER_TIMEOUT_S,
                        http=guarded_protocol(Guard(100, HEADER_TIMEOUT_S, HEADER_TIMEOUT_S)))
    s = uvicorn.Server(uv)
    thread = threading.Thread(target=s.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/ready", timeout=30).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.2)
    try:
        yield url, released
    finally:
        s.should_exit = True
        thread.join(timeout=60)


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/images/generations", json=body, timeout=600)


def test_preview_every_zero_takes_the_limit_its_error_asks_for(served):
    server = served[0]
    """`preview: {"every": 0}` is refused saying it needs a limit; the limit it asks for must then be accepted
    (it was refused as an unknown parameter: the error's fix could not be followed)."""
    body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 1, "stream": True}
    r = _post(server, {**body, "preview": {"every": 0}})
    assert r.status_code == 400 and "needs a limit" in r.json()["error"]["message"]
    with httpx.stream("POST", server + "/v1/images/generations", timeout=600,
                      json={**body, "preview": {"every": 0, "limit": 2, "format": "png"}}) as r:
        assert r.status_code == 200, r.read()
        stream = read_stream(r.iter_lines())
    assert [p["step"] for p in stream.partials] == [1, 3] and stream.events[-1] == "image_generation.completed"
    with httpx.stream("POST", server + "/v1/images/generations", timeout=600,
                      json={**body, "preview": {"every": 1, "limit": 1}}) as r:
        assert [p["step"] for p in read_stream(r.iter_lines()).partials] == [1]


def test_an_unknown_preview_field_lists_the_preview_fields(served):
    server = served[0]
    """An unknown field inside `preview` names the fields `preview` takes, not the body's top-level fields."""
    r = _post(server, {"prompt": "a red fox", "stream": True, "preview": {"every": 2, "size": 5}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "preview.size"
    assert error["message"] == "unknown parameter 'preview.size'; accepted: every, format, limit"


def test_a_stream_whose_client_reads_nothing_is_reset_after_the_send_timeout(served):
    """A streaming client that stops reading (its connection open, its receive window full) held its connection
    for ever, the response's bytes buffered behind it: neither the request timeout nor the header timeout applies
    to a response being written, and the guard never evicts a busy connection. Its connection is reset once the
    server's writes have been paused for the send timeout (1 s here, 60 s by default)."""
    server, released = served
    body = json.dumps({"prompt": "a red fox", "size": "256x256", "n": 2, "num_inference_steps": 2, "seed": 3,
                       "stream": True, "output_format": "png"}).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    client.connect(("127.0.0.1", int(server.rsplit(":", 1)[1])))
    try:
        client.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 180  # a bound that fails instead of hanging; no timing is measured
        while client.getsockname() not in released:  # the server holds the connection
            assert time.monotonic() < deadline, "the server still holds the stalled stream's connection"
            time.sleep(0.2)
        received = b""
        client.settimeout(60)
        try:
            while chunk := client.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        assert not received.endswith(b"0\r\n\r\n"), \
            f"the whole stream ({len(received)} bytes) fit in the buffers: nothing was stalled"
    finally:
        client.close()


def test_a_bad_preview_is_refused_whether_the_request_streams_or_not(served):
    """A request that does not stream gets no previews, but a bad `preview` was silently ignored there (a 200)
    while the same body with stream true was a 400."""
    server, _ = served
    for stream in (True, False):
        body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "stream": stream,
                "preview": {"every": 0}}
        r = httpx.post(server + "/v1/images/generations", json=body, timeout=600)
        assert r.status_code == 400, (stream, r.text)
        assert r.json()["error"]["param"] == "preview" and "needs a limit" in r.json()["error"]["message"]
    ok = httpx.post(server + "/v1/images/generations", timeout=600, json={
        "prompt": "a red fox", "size": "64x64", "num_inference_steps": 1, "preview": {"every": 1, "format": "png"}})
    assert ok.status_code == 200, ok.text
