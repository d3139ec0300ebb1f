"""Access control, the page's JSON endpoints, the quiet access log and the thread settings, in process."""

import logging
import time

import pytest
import torch

from diffgraph.api.config import ServerConfig

MODEL = "random:tiny"


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app

    app = create_app(ServerConfig(model=MODEL, device="cpu", api_keys=("k-one", "k-two")))
    with TestClient(app) as c:
        for _ in range(6000):  # the engine is built on a background thread (a failure bound, not a timing)
            if c.get("/ready").status_code == 200:
                break
            time.sleep(0.05)
        yield c


def test_v1_routes_need_a_key(client):
    body = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 1}
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error" and "requires an API key" in r.json()["error"]["message"]
    r = client.post("/v1/images/generations", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "not valid" in r.json()["error"]["message"]
    assert "wrong" not in r.text and "k-one" not in r.text
    assert client.get("/v1/models").status_code == 401
    for key in ("k-one", "k-two"):
        r = client.post("/v1/images/generations", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    assert client.get("/v1/models", headers={"Authorization": "bearer k-two"}).status_code == 200
    # open: health, readiness, the page's JSON, metrics (unless --protect-metrics)
    for path in ("/health", "/ready", "/info", "/status", "/metrics"):
        assert client.get(path).status_code == 200, path


def test_info_and_status_describe_the_server(client):
    info = client.get("/info").json()
    assert info["model"] == MODEL and info["auth_required"] is True and info["ready"] is True
    assert info["graphed_resolutions"] == [] and info["max_images"] == 16  # eager on the CPU: nothing graphed
    assert info["native_size"] == 64 and info["default_steps"] == 20
    assert "dpmpp_2m" in info["samplers"] and "karras" in info["schedules"]
    client.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 3},
                headers={"Authorization": "Bearer k-one"})
    status = client.get("/status").json()
    assert status["ready"] is True and status["queue_depth"] == 0 and status["steps"] >= 3
    assert status["step_ms_mean"] > 0 and status["live_rows"] == {}


def test_protect_metrics_guards_metrics_and_status():
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app

    app = create_app(ServerConfig(model=MODEL, device="cpu", api_keys=("k",), protect_metrics=True),
                     engine_factory=lambda: (_ for _ in ()).throw(RuntimeError("not needed")))
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 401 and c.get("/status").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        # open without a key (once the engine's build fails, /health says "down": 503, never 401)
        assert c.get("/health").status_code in (200, 503) and c.get("/info").status_code == 200


def test_polls_never_reach_the_access_log():
    from diffgraph.server.cli import _QuietPolls

    def record(path):
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "GET", path, "1.1", 200), None)
    f = _QuietPolls()
    assert [f.filter(record(p)) for p in ("/health", "/ready?x=1", "/metrics", "/status")] == [False] * 4
    assert f.filter(record("/v1/images/generations")) and f.filter(record("/"))


def test_the_access_log_holds_no_key_and_no_signature():
    """uvicorn's access log of a server with an API key, as `serve` sets it up: a key given as `?k=`, one in the path
    and a signed image URL's `sig` are redacted (they were logged whole), the rest of each line is kept."""
    import socket
    import threading

    import httpx
    import uvicorn

    from diffgraph.server.app import create_app
    from diffgraph.server.cli import quiet_access_log

    key, sig = "k-8f3a9c1d77", "5e0b6c2a9d41f7aa"
    config = ServerConfig(model=MODEL, device="cpu", api_keys=(key,))
    app = create_app(config, engine_factory=lambda: (_ for _ in ()).throw(RuntimeError("not needed")))
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    access, handler = logging.getLogger("uvicorn.access"), Lines()
    quiet = quiet_access_log(config)
    access.addHandler(handler)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="info", lifespan="on", ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(6000):  # a failure bound, not a timing
            if server.started:
                break
            time.sleep(0.05)
        paths = [f"/v1/models?k={key}", f"/v1/images/files/abc.png?exp=99&sig={sig}", f"/{key}/v1/models",
                 f"/v1/models?a=1&K={key}&SIG={sig}"]
        for path in paths:
            assert httpx.get(url + path, timeout=60).status_code in (401, 404)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        access.removeHandler(handler)
        access.removeFilter(quiet)
    logged = [line for line in lines if '"GET ' in line]
    assert len(logged) == len(paths) and not [line for line in logged if key in line or sig in line], logged
    assert any("/v1/images/files/abc.png?exp=99&sig=[redacted] " in line for line in logged)
    assert any("/v1/models?a=1&K=[redacted]&SIG=[redacted] " in line for line in logged)
    assert any('"GET /[redacted]/v1/models ' in line for line in logged)


def test_an_open_server_on_all_interfaces_warns():
    from diffgraph.server.cli import open_server_warning

    assert "anyone who can reach port 8000" in open_server_warning(ServerConfig(model=MODEL, host="0.0.0.0"))
    assert open_server_warning(ServerConfig(model=MODEL, host="0.0.0.0", api_keys=("k",))) is None
    assert open_server_warning(ServerConfig(model=MODEL)) is None


def test_cpu_thread_settings():
    from diffgraph.server.cli import apply_thread_settings

    before = torch.get_num_threads()
    try:
        applied = apply_thread_settings(ServerConfig(model=MODEL, device="cpu"), cpu_count=2)
        assert applied["torch_threads"] == 1 == torch.get_num_threads() and applied["image_threads"] == 2
        assert apply_thread_settings(ServerConfig(model=MODEL, device="cpu"), cpu_count=16)["torch_threads"] == 15
        assert apply_thread_settings(ServerConfig(model=MODEL, device="cpu", torch_threads=2),
                                     cpu_count=2)["torch_threads"] == 2
    finally:
        torch.set_num_threads(before)


def test_keys_fail_closed_also_under_a_root_path_or_a_mount():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app

    def app():
        return create_app(ServerConfig(model=MODEL, device="cpu", api_keys=("k",)),
                          engine_factory=lambda: (_ for _ in ()).throw(RuntimeError("not needed")))
    parent = FastAPI()
    parent.mount("/api", app())
    with TestClient(parent) as c:
        assert c.get("/api/v1/models").status_code == 401
        assert c.get("/api/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.get("/api/health").status_code in (200, 503)  # open (a failed build makes it "down"), never 401
    with TestClient(app(), root_path="/api") as c:
        assert c.get("/api/v1/models").status_code == 401 and c.get("/v1/models").status_code == 401
        assert c.get("/v1/loras").status_code == 401  # anything not listed as open needs the key
        assert c.get("/openapi.json").status_code == 200  # the docs page's schema is public (its calls are not)
        assert c.get("/health").status_code in (200, 503) and c.get("/").status_code == 200


def test_an_empty_api_key_is_refused_not_an_open_server(monkeypatch):
    from diffgraph.api.config import load_config

    for given in ([""], ["  "], " , "):
        with pytest.raises(ValueError, match="api-key is empty"):
            load_config(None, {"model": MODEL, "api_keys": given})
    monkeypatch.setenv("DIFFGRAPH_API_KEY", " , ")
    with pytest.raises(ValueError, match="api-key is empty"):
        load_config(None, {"model": MODEL})


def test_docs_are_served_from_local_files_not_a_cdn():
    """/docs (issue 34, point 6): Swagger UI's script and styles come from this server (fastapi-offline's), so the
    page works offline; only its three files can be named."""
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app

    client = TestClient(create_app(ServerConfig(model=MODEL, device="cpu")))  # no lifespan: the engine is not built
    page = client.get("/docs")
    assert page.status_code == 200 and "docs/assets/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower() and "http" not in page.text.split("<body>")[1].split("openapi.json")[0]
    js = client.get("/docs/assets/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 500_000 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/docs/assets/swagger-ui.css").status_code == 200
    for bad in ("../pages.py", "swagger-ui-bundle.js.map", "index.html"):
        assert client.get(f"/docs/assets/{bad}").status_code == 404
    schema = client.get("/openapi.json").json()
    assert schema["info"]["title"] == "diffgraph" and "securitySchemes" not in schema.get("components", {})


def test_docs_are_public_with_keys_and_their_calls_carry_the_key(client):
    """/docs with --api-key: the page, its files and its schema open; the schema declares the keys (Bearer, Basic)
    on each operation that needs one, so Swagger UI's Authorize button sends the key with its calls."""
    page = client.get("/docs")
    assert page.status_code == 200 and "openapi.json" in page.text
    assert client.get("/docs/assets/swagger-ui.css").status_code == 200
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key of this server"},
        "basic": {"type": "http", "scheme": "basic",
                  "description": "any user name, an API key as the password (as AUTOMATIC1111's clients send it)"}}
    paths, keyed = schema["paths"], [{"bearer": []}, {"basic": []}]
    for path, method in (("/v1/images/generations", "post"), ("/sdapi/v1/txt2img", "post"), ("/v1/models", "get")):
        assert paths[path][method]["security"] == keyed, path
    for path in ("/health", "/ready", "/info", "/metrics", "/status"):
        assert paths[path]["get"]["security"] == [], path
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k-two"}).status_code == 200  # as Swagger sends
