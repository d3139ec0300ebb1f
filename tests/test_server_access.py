"""Access control, the page's JSON endpoints, the quiet access log and the thread settings, in process. Then the
hostile edge of `diffgraph serve`, over raw sockets against real server processes: bodies limited while they stream
(a chunked 200 MiB image part), connections that never send a request or trickle their head, more idle sockets than
the descriptor limit allows, a cap on busy connections and on one client's, slow bodies, forwarded clients, secrets
in query strings, keys from a file, a port in use and the ready line."""

import contextlib
import json
import logging
import os
import re
import resource
import selectors
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from diffgraph.api.config import ServerConfig
from diffgraph.server.process import SRC, ServerProcess
from test_server import wait_for

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


# -- the hostile edge, over raw sockets against real server processes (random:tiny on the CPU) ---------------------
# Each wait is a failure bound, not a timing assumption: where a test waits for the server to close a connection,
# the lower bound is the server's own timer (it cannot close sooner) and the upper one is generous.
HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 6
KEYS = ("k-first", "k-second")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MiB = 1024 * 1024


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _connect(url: str, timeout: float = 30) -> socket.socket:
    return socket.create_connection(_host_port(url), timeout=timeout)


def _closed_by_server(sock: socket.socket, bound_s: float) -> bool:
    """Whether the server closes `sock` within `bound_s` (what it sends before closing is read and dropped)."""
    sock.settimeout(bound_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@contextlib.contextmanager
def _descriptor_limit(soft: int):
    """This process's soft RLIMIT_NOFILE set to `soft` for the block (a server started in it inherits the limit)."""
    old, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (old, hard))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"# the keys of this server\n{KEYS[0]}\n\n{KEYS[1]}  # the second\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(key_file):
    # one client may take every slot here, and its held bodies are not closed early: the bounds tested below
    s = ServerProcess("--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                      "--max-client-connections", str(MAX_CONNECTIONS), "--body-deadline", "600",
                      "--api-key-file", str(key_file), model=MODEL, log_level="info")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


# -- bodies ------------------------------------------------------------------------------------------------------
def _new_regular_files(pid: int, baseline: set[str]) -> dict[str, int]:
    """The server's open regular files (fd -> size) that were not open in `baseline`: spooled uploads."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and f"{fd}:{target}" not in baseline:
            out[f"{fd}:{target}"] = st.st_size
    return out


def test_a_chunked_200_mib_image_part_gets_413_before_25_mib_and_nothing_spooled(server):
    pid = server.proc.pid
    baseline = set(_new_regular_files(pid, set()))
    boundary = "hostileboundary"
    sock = _connect(server.url)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # what is sent is (about) what was read
    head = (f"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na fox\r\n--{boundary}\r\n"
            "Content-Disposition: form-data; name=\"image\"; filename=\"big.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    sock.sendall(head + b"%x\r\n%s\r\n" % (len(part), part))
    answer = bytearray()
    answered = threading.Event()
    spooled = {"max": 0}

    def read() -> None:
        try:
            while chunk := sock.recv(65536):
                answer.extend(chunk)
                if b"\r\n\r\n" in answer:
                    answered.set()
        except OSError:
            pass
        answered.set()

    def watch() -> None:
        while not answered.is_set():
            sizes = _new_regular_files(pid, baseline).values()
            spooled["max"] = max([spooled["max"], *sizes])
            time.sleep(0.02)

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=watch, daemon=True)]
    for t in threads:
        t.start()
    chunk = b"%x\r\n%s\r\n" % (MiB, b"\0" * MiB)
    sent = 0
    try:
        while sent < 200 * MiB and not answered.is_set():
            sock.sendall(chunk)
            sent += MiB
        if not answered.is_set():  # the whole part went through: end the form and the body
            sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(boundary) + 6, f"\r\n--{boundary}--".encode()))
    except OSError:  # the server closed after answering
        pass
    assert answered.wait(60), "no answer"
    for t in threads:
        t.join(30)
    sock.close()
    head_text, _, body = bytes(answer).partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 413"), bytes(answer[:300])
    error = json.loads(body)["error"]
    assert error["param"] == "image" and error["code"] == "image_too_large" and "--max-image-bytes" in error["message"]
    assert sent < 25 * MiB, f"{sent / MiB:.0f} MiB sent before the 413"
    assert spooled["max"] < MiB, f"{spooled['max']} bytes spooled to a file"
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200


def test_a_part_with_a_declared_length_over_its_limit_is_a_400_naming_its_size(server):
    image = b"\x89PNG" + b"\0" * (21 * MiB)  # the default --max-image-bytes is 20 MiB
    r = httpx.post(f"{server.url}/v1/images/edits", files={"image": ("a.png", image, "image/png")},
                   data={"prompt": "a fox"}, headers=AUTH, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text
    assert f"image has {len(image)} bytes; the limit is {20 * MiB}" in r.json()["error"]["message"]
    from diffgraph.server.edits import FILES, IMAGE_LIST, MAX_IMAGES  # image, mask, the control maps, the image
    # prompt's images, and up to MAX_IMAGES image[] parts: one part more is refused before it is read
    limit = len(FILES) + MAX_IMAGES
    files = [(name, (f"{name}.png", b"x", "image/png")) for name in FILES] + \
        [(IMAGE_LIST, (f"{i}.png", b"x", "image/png")) for i in range(MAX_IMAGES + 1)]
    r = httpx.post(f"{server.url}/v1/images/edits", files=files, data={"prompt": "a fox"}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and f"more than {limit} file parts" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/images/edits", files={"extra": ("e.png", b"x", "image/png")},
                   data={"prompt": "a fox"}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra", r.text


def test_a_slow_body_gets_408_after_the_body_timeout():
    """A body trickled a byte every 0.2 s is answered 408 after --body-timeout (the request timeout is 600 s)."""
    s = ServerProcess("--body-timeout", "2", "--request-timeout", "600", model=MODEL)
    try:
        s.wait_ready()
        sock = _connect(s.url)
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        answer = b""
        sock.settimeout(0.2)
        while b"body_timeout" not in answer and time.monotonic() - t0 < 60:
            try:
                sock.sendall(b" ")
                answer += sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
        assert 2 <= time.monotonic() - t0 < 60
    finally:
        s.stop(timeout=30)


# -- connections -------------------------------------------------------------------------------------------------
def test_idle_and_trickling_connections_are_closed_after_the_header_timeout(server):
    t0 = time.monotonic()
    silent = _connect(server.url)  # never sends a byte
    kept = _connect(server.url)    # one request, then idle on keep-alive
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    trickle = _connect(server.url)  # a request head, a byte every 0.2 s, never finished
    stop = threading.Event()

    def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
            if stop.wait(0.2):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return
    threading.Thread(target=drip, daemon=True).start()
    try:
        for name, sock in (("silent", silent), ("keep-alive", kept), ("trickling", trickle)):
            assert _closed_by_server(sock, 60), f"the {name} connection was never closed"
        assert time.monotonic() - t0 >= HEADER_TIMEOUT_S  # the server's timer, not anything sooner
    finally:
        stop.set()
        for sock in (silent, kept, trickle):
            sock.close()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def _busy(url: str) -> socket.socket:
    """A connection busy with a request: its head sent, its body still to come."""
    sock = _connect(url, timeout=120)
    sock.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
    return sock


def _inflight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^diffgraph_inflight_requests (\S+)$", text, re.M).group(1))


def test_past_max_connections_busy_a_newcomer_gets_503_and_idle_ones_make_room(server):
    idle = [_connect(server.url) for _ in range(MAX_CONNECTIONS)]
    busy = []
    try:
        # idle connections never keep a slot from a request: each newcomer closes the one idle longest
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        busy = [_busy(server.url) for _ in range(MAX_CONNECTIONS - 1)]
        wait_for(lambda: _inflight(server.url) == MAX_CONNECTIONS - 1, timeout=60, what="the busy requests in flight")

        def refused() -> httpx.Response | None:
            """The last slot taken by a busy request, a newcomer's answer; None (retry) when the newcomer came
            before that request's head was read, while the connection still counted as idle (it was closed)."""
            busy.append(_busy(server.url))
            r = httpx.get(f"{server.url}/v1/models", timeout=30)
            if r.status_code == 503:
                return r
            busy.pop().close()
            wait_for(lambda: _inflight(server.url) == MAX_CONNECTIONS - 1, timeout=60, what="the last one gone")
            return None
        r = wait_for(refused, timeout=60, what="a newcomer refused")
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "too_many_connections" and "--max-connections" in r.text
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # a probe is answered at the limit
    finally:
        for sock in idle + busy:
            sock.close()
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=30).status_code == 200, timeout=60, what="served again")


def _connect_from(url: str, source: str, timeout: float = 120) -> socket.socket:
    """A connection from another loopback address (127.0.0.2, ...): another client to the server."""
    return socket.create_connection(_host_port(url), timeout=timeout, source_address=(source, 0))


def _held_body(url: str, source: str = "127.0.0.1", forwarded: str = "") -> socket.socket:
    """A connection busy with a request whose body is still to come (no key: the servers below are open)."""
    sock = _connect_from(url, source)
    extra = f"X-Forwarded-For: {forwarded}\r\n" if forwarded else ""
    sock.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n{".encode())
    return sock


def _get_from(url: str, source: str, path: str, forwarded: str = "") -> tuple[int, str]:
    """(status, body) of one GET from `source` on a connection of its own."""
    extra = f"X-Forwarded-For: {forwarded}\r\n" if forwarded else ""
    with _connect_from(url, source, timeout=60) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_slow_bodies_are_closed_early_while_health_answers():
    """Bodies trickled a byte every 0.5 s on every connection slot (4 here) are closed by the body pace (--body-deadline
    2 s, a second more per 1000 bytes), long before --body-timeout (600 s), and /health answers throughout."""
    s = ServerProcess("--max-connections", "4", "--max-client-connections", "4", "--body-deadline", "2",
                      "--min-body-rate", "1000", "--body-timeout", "600", "--header-timeout", "600", model=MODEL)
    slow: list[socket.socket] = []
    stop = threading.Event()
    try:
        s.wait_ready()
        t0 = time.monotonic()
        slow = [_held_body(s.url) for _ in range(4)]
        closed: dict[int, bytes] = {}

        def drip() -> None:
            while not stop.wait(0.5) and len(closed) < len(slow):
                for i, sock in enumerate(slow):
                    if i in closed:
                        continue
                    try:
                        sock.send(b" ")
                        sock.setblocking(False)
                        try:
                            got = sock.recv(65536)
                            closed[i] = got  # b"": closed by the server (what it sent before, if anything)
                        except BlockingIOError:
                            pass
                        finally:
                            sock.setblocking(True)
                    except OSError:
                        closed[i] = b""
        threading.Thread(target=drip, daemon=True).start()
        deadline = time.monotonic() + 120  # a failure bound
        while len(closed) < len(slow) and time.monotonic() < deadline:
            assert httpx.get(f"{s.url}/health", timeout=60).status_code == 200
            time.sleep(0.2)
        assert len(closed) == len(slow), f"only {len(closed)} of the slow bodies were closed"
        assert time.monotonic() - t0 >= 2  # the server's own deadline, not anything sooner
        assert all(not answer.startswith(b"HTTP/1.1 408") for answer in closed.values())  # not the body timeout
        r = httpx.post(f"{s.url}/v1/images/generations", json={"prompt": "a fox", "num_inference_steps": 1},
                       timeout=600)
        assert r.status_code == 200, r.text
    finally:
        stop.set()
        for sock in slow:
            sock.close()
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def capped():
    """Two connections a client, 127.0.0.4 a trusted proxy; held bodies are never closed early."""
    s = ServerProcess("--max-connections", "16", "--max-client-connections", "2", "--trusted-proxies", "127.0.0.4",
                      "--body-deadline", "600", model=MODEL)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


def test_one_clients_connections_are_capped_while_another_is_served(capped):
    held = [_held_body(capped.url, "127.0.0.2") for _ in range(2)]
    try:
        wait_for(lambda: _inflight(capped.url) == 2, timeout=60, what="the held requests in flight")
        status, body = _get_from(capped.url, "127.0.0.2", "/v1/models")
        assert status == 503 and "too_many_client_connections" in body and "--max-client-connections" in body
        assert _get_from(capped.url, "127.0.0.2", "/health")[0] == 200  # its probes still answered
        assert _get_from(capped.url, "127.0.0.3", "/v1/models")[0] == 200  # another client served
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: _get_from(capped.url, "127.0.0.2", "/v1/models")[0] == 200, timeout=60, what="served again")


def test_a_forwarded_client_is_counted_only_from_a_trusted_proxy(capped):
    proxy = "127.0.0.4"
    held = [_held_body(capped.url, proxy, forwarded="10.0.0.1") for _ in range(2)]
    try:
        wait_for(lambda: _inflight(capped.url) == 2, timeout=60, what="the held requests in flight")
        # the proxy carries many clients: 10.0.0.1 is at its bound (also as the first of a chain through the proxy),
        # 10.0.0.2 is not, and the proxy's own connections count against nobody
        for forwarded in ("10.0.0.1", "10.0.0.1, 127.0.0.4"):
            status, body = _get_from(capped.url, proxy, "/v1/models", forwarded)
            assert status == 503 and "too_many_client_connections" in body, (forwarded, body)
        assert _get_from(capped.url, proxy, "/v1/models", "10.0.0.2")[0] == 200
        # anyone else's header is not believed: 127.0.0.5 naming 10.0.0.1 is itself, and served
        assert _get_from(capped.url, "127.0.0.5", "/v1/models", "10.0.0.1")[0] == 200
        held += [_held_body(capped.url, "127.0.0.5", forwarded=f"10.0.0.{i}") for i in (7, 8)]
        wait_for(lambda: _inflight(capped.url) == 4, timeout=60, what="the untrusted held requests in flight")
        status, body = _get_from(capped.url, "127.0.0.5", "/v1/models", "10.0.0.9")
        assert status == 503 and "too_many_client_connections" in body
    finally:
        for sock in held:
            sock.close()


def test_forwarded_client_takes_the_nearest_untrusted_hop():
    from diffgraph.api.config import parse_networks
    from diffgraph.server.connections import forwarded_client

    proxies = parse_networks(("10.0.0.0/8", "::1"))
    xff = [(b"x-forwarded-for", b"1.2.3.4, 5.6.7.8"), (b"X-Forwarded-For", b"10.1.1.1")]
    assert forwarded_client(xff, "10.9.9.9", proxies) == "5.6.7.8"  # 1.2.3.4 is only 5.6.7.8's word
    assert forwarded_client([(b"x-forwarded-for", b"10.0.0.2, 10.0.0.3")], "::1", proxies) == "10.0.0.2"
    assert forwarded_client([], "10.9.9.9", proxies) == "10.9.9.9"
    with pytest.raises(ValueError, match="trusted-proxies: 'a.b' is not an address"):
        parse_networks(("a.b",))


def test_more_idle_sockets_than_descriptors_lock_nobody_out():
    """1,100 idle connections against a server limited to 1,024 descriptors (fewer of both where this machine's
    hard limit is low): a new client is still served, before any header timeout (60 s here) could free a slot."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    server_limit, idle_count = (1024, 1100) if hard == resource.RLIM_INFINITY or hard >= 1700 else (256, 300)
    with _descriptor_limit(server_limit):
        s = ServerProcess("--header-timeout", "60", model=MODEL)
    sockets: list[socket.socket] = []
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        s.wait_ready()
        want = idle_count + 512  # this process's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(old[0], want if hard == resource.RLIM_INFINITY
                                                        else min(hard, want)), hard))
        for _ in range(idle_count):
            try:
                sockets.append(_connect(s.url, timeout=5))
            except OSError:  # the listen queue is full: the server has stopped accepting
                break
        t0 = time.monotonic()

        def served() -> bool:
            try:
                return httpx.get(f"{s.url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(served, timeout=30, what="a new client served")
        assert time.monotonic() - t0 < 60
        # the server holds fewer connections than its descriptors: it closed the idle ones longest idle
        selector = selectors.DefaultSelector()
        for sock in sockets:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        closed = {key.fileobj for key, _ in selector.select(timeout=5)}
        selector.close()
        assert len(sockets) == idle_count and len(closed) >= idle_count - server_limit, len(closed)
        r = httpx.post(f"{s.url}/v1/images/generations", json={"prompt": "a fox", "num_inference_steps": 1},
                       timeout=120)
        assert r.status_code == 200, r.text
    finally:
        for sock in sockets:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
        s.stop(timeout=30)


# -- secrets, start-up --------------------------------------------------------------------------------------------
def test_query_string_secrets_never_reach_the_access_log(server):
    secrets = ("QS-SECRET-1", "QS-SECRET-2", "QS-SECRET-3", "QS-SECRET-4")
    r = httpx.get(f"{server.url}/v1/models?api_key={secrets[0]}&key={secrets[1]}&x=1", timeout=30)
    assert r.status_code == 401  # a key in the query string is not a key
    httpx.get(f"{server.url}/v1/models?token={secrets[2]}&Access%5FToken={secrets[3]}", headers=AUTH, timeout=30)
    wait_for(lambda: "Access%5FToken=[redacted]" in server.output(), timeout=60, what="the access-log lines")
    out = server.output()
    assert not any(secret in out for secret in secrets), out
    assert "GET /v1/models?api_key=[redacted]&key=[redacted]&x=1 HTTP/1.1" in out


def test_keys_from_an_api_key_file(server):
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    for key in KEYS:
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
    assert "the second" not in server.output() and KEYS[0] not in server.output()


def test_api_key_file_settings(tmp_path, monkeypatch):
    from diffgraph.api.config import load_config

    path = tmp_path / "keys"
    path.write_text("one\n# a comment\ntwo, three\n")
    monkeypatch.setenv("DIFFGRAPH_API_KEY", "from-env")
    assert load_config(None, {"model": MODEL, "api_key_file": str(path)}).api_keys == ("one", "two", "three")
    both = load_config(None, {"model": MODEL, "api_key_file": str(path), "api_keys": ["flag"]})
    assert both.api_keys == ("flag", "one", "two", "three")
    toml = tmp_path / "serve.toml"
    toml.write_text(f'model = "{MODEL}"\napi-key-file = "{path}"\n')
    assert load_config(str(toml)).api_keys == ("one", "two", "three")
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(None, {"model": MODEL, "api_key_file": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_config(None, {"model": MODEL, "api_key_file": str(tmp_path / "empty")})


def test_the_ready_line_says_where_and_how_long(server):
    lines = [line for line in server.output().splitlines() if "ready: http" in line]
    assert len(lines) == 1, server.output()
    assert re.fullmatch(rf"INFO diffgraph\.server: ready: {re.escape(server.url)} serves {MODEL}; start-up took "
                        r"\d+\.\d s", lines[0]), lines[0]


def test_a_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-m", "diffgraph.server.cli", "--model", MODEL, "--device", "cpu",
                               "--port", str(port)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"port {port}" in lines[0] and "already in use" in lines[0] and "--port" in lines[0]


def test_redaction_and_connection_bounds_in_process():
    from diffgraph.server.cli import redact_query
    from diffgraph.server.connections import resolve_max_connections

    assert (redact_query("/v1/x?a=1&api_key=s&apikey=s&token&b=2")
            == "/v1/x?a=1&api_key=[redacted]&apikey=[redacted]&token=[redacted]&b=2")
    assert redact_query("/v1/x") == "/v1/x" and redact_query("/v1/x?monkey=") == "/v1/x?monkey=[redacted]"
    assert resolve_max_connections(None, 1024) == 896 and resolve_max_connections(None, 65536) == 1000
    assert resolve_max_connections(None, None) == 1000 and resolve_max_connections(10, 1024) == 10
    with pytest.raises(ValueError, match="--max-connections 896 or fewer"):
        resolve_max_connections(5000, 1024)
