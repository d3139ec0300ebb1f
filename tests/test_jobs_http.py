"""Batch jobs over HTTP on `diffgraph serve --model digits --state-dir DIR` (issue 35): a 60-item job whose every
image equals the same request made alone through /v1/images/generations (within the engine's isolation tolerance:
a row's pixels may differ by 1e-6 with its batch's size on the CPU, so by one level of 255 in a few pixels after
rounding, never more); two jobs interleaving
(round-robin) within --batch-inflight; cancel stopping a job within one step; jobs private to the key that made
them; bad job files refused with their line and field before anything is stored; the webhook receiver (a local
http.server on 127.0.0.1, allowed by --webhook-allow) called once per job, retried after a 500, with a valid HMAC.

One module server (two API keys, --batch-inflight 4); images are 64x64 at 2-3 steps, except the job that is
cancelled, whose 200-step items are still running when it is cancelled. Waits are on states, bounded only to fail.

Bad input that used to answer 500 (or leave a webhook pending forever) instead of a one-line 400, against an
in-process server on random:tiny: query numbers Python's int() cannot read, text holding an unpaired surrogate (SQLite
cannot store it), webhook URLs that pass the allow list but that httpx refuses to send to, a LoRA the server cannot
serve, a grid over the candidate limit, a damaged store (a 503), a failed commit leaving no transaction open.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
import json
import os
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from diffgraph.jobs.webhook import WebhookRefused, WebhookSender, check_webhook
from diffgraph.server.process import ServerProcess

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
SECRET = "webhook-secret-for-tests"
INFLIGHT = 4
BOUND_S = 600  # a failure bound for waits on a state, never a timing assumption
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class Receiver(BaseHTTPRequestHandler):
    """Records every call; answers 500 to the first call of a job named "flaky"."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        calls = self.server.calls
        summary = json.loads(body)
        first = not any(json.loads(b)["id"] == summary["id"] for _, b in calls)
        calls.append((dict(self.headers), body))
        status = 500 if summary["name"] == "flaky" and first else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.calls = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    s = ServerProcess("--state-dir", str(state), "--batch-inflight", str(INFLIGHT), "--api-key", KEY_A, "--api-key",
                      KEY_B, "--webhook-allow", "127.0.0.1", "--webhook-secret", SECRET, model="digits")
    s.state = state
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


def call(server, method: str, path: str, key: str = KEY_A, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {key}",
                                                            **kwargs.pop("headers", {})}, timeout=BOUND_S, **kwargs)


def post_job(server, body=None, key: str = KEY_A, **kwargs) -> dict:
    r = call(server, "POST", "/v1/jobs", key, json=body, **kwargs) if body is not None else \
        call(server, "POST", "/v1/jobs", key, **kwargs)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "job" and r.json()["status"] == "queued"
    return r.json()


def wait_job(server, job: str, done=lambda j: j["status"] not in ("queued", "running")) -> dict:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        j = call(server, "GET", f"/v1/jobs/{job}").json()
        if done(j):
            return j
        time.sleep(0.05)
    raise AssertionError(f"job {job} did not get there within {BOUND_S} s: {j}")


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def finish_order(server, *jobs: str) -> list[str]:
    """The jobs of the done candidates in the order they were stored (the store's own timestamps)."""
    db = sqlite3.connect(f"file:{os.path.join(str(server.state), 'jobs.sqlite3')}?mode=ro", uri=True)
    try:
        marks = ",".join("?" * len(jobs))
        return [r[0] for r in db.execute(f"SELECT job FROM candidates WHERE job IN ({marks}) AND status = 'done' "
                                         "ORDER BY finished", jobs)]
    finally:
        db.close()


# -- a job's images are the images of the same requests alone -------------------------------------------------
def test_a_60_item_job_makes_the_images_each_request_makes_alone(server):
    items = [{"prompt": f"a handwritten digit {WORDS[i % 10]}", "num_inference_steps": 2 + i % 2,
              "seeds": [100 + i] if i % 6 else [100 + i, 500 + i], **({"guidance_scale": 5} if i % 4 == 0 else {})}
             for i in range(60)]
    body = "\n".join(json.dumps(i) for i in items).encode()
    job = post_job(server, content=body, headers={"Content-Type": "application/x-ndjson"},
                   params={"name": "sixty"})
    assert job["name"] == "sixty" and job["counts"] == {"items": 60, "candidates": 70, "done": 0, "failed": 0,
                                                        "pending": 70}
    final = wait_job(server, job["id"])
    assert final["status"] == "completed" and final["counts"]["done"] == 70 and final["eta_s"] is None
    assert final["images_per_s"] > 0
    results = call(server, "GET", f"/v1/jobs/{job['id']}/results").json()
    worst = 0
    assert results["total"] == 60 and not results["has_more"] and len(results["data"]) == 60
    for item, entry in zip(items, results["data"]):
        assert entry["status"] == "done" and entry["seeds"] == item["seeds"] and entry["error"] is None
        assert entry["prompt"] == item["prompt"]
        for seed, url in zip(item["seeds"], entry["images"]):
            assert url.endswith(f"/v1/jobs/{job['id']}/images/{entry['item']}-{item['seeds'].index(seed)}.png")
            stored = call(server, "GET", url.removeprefix(server.url))
            assert stored.status_code == 200 and stored.headers["content-type"] == "image/png"
            alone = call(server, "POST", "/v1/images/generations", json={
                **{k: v for k, v in item.items() if k != "seeds"}, "seed": seed})
            assert alone.status_code == 200, alone.text
            expected = base64.b64decode(alone.json()["data"][0]["b64_json"])
            diff = np.abs(pixels(stored.content).astype(int) - pixels(expected).astype(int))
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (entry["item"], seed, diff.max(), (diff > 0).sum())
            worst = max(worst, int(diff.max()))
    assert worst <= 1
    page = call(server, "GET", f"/v1/jobs/{job['id']}/results", params={"offset": 58, "limit": 5}).json()
    assert [d["item"] for d in page["data"]] == [58, 59] and not page["has_more"]
    page = call(server, "GET", f"/v1/jobs/{job['id']}/results", params={"offset": 0, "limit": 2}).json()
    assert [d["item"] for d in page["data"]] == [0, 1] and page["has_more"]


def test_two_jobs_interleave_round_robin(server):
    """The second job does not wait for the first: once it arrives the two alternate within the in-flight bound."""
    def items(word, n):
        return [{"prompt": f"a handwritten digit {word}", "num_inference_steps": 4, "seeds": [i]} for i in range(n)]
    first = post_job(server, {"items": items("four", 30)})["id"]
    second = post_job(server, {"items": items("seven", 15)})["id"]
    assert wait_job(server, second)["counts"]["done"] == 15
    wait_job(server, first)
    order = finish_order(server, first, second)
    assert len(order) == 45
    start, end = order.index(second), len(order) - 1 - order[::-1].index(second)
    assert order[end:].count(first) > 0, "the first job was done before the second arrived: make it longer"
    window = order[start:end + 1]  # while both had pending images
    runs, run = [], 1
    for a, b in zip(window, window[1:]):
        run = run + 1 if a == b else 1
        runs.append(run)
    assert max(runs, default=1) <= INFLIGHT, window  # alternating, not one job's 15 before the other's
    assert window.count(first) >= 15 - INFLIGHT  # the first kept its share


def test_cancel_stops_a_job_within_one_step_and_an_interactive_request_is_served_meanwhile(server):
    job = post_job(server, {"items": [{"prompt": "a handwritten digit one", "num_inference_steps": 200,
                                       "seeds": [i]} for i in range(30)], "name": "long"})["id"]

    def status():
        return httpx.get(server.url + "/status", timeout=BOUND_S).json()

    deadline = time.monotonic() + BOUND_S
    while sum(status()["live_rows"].values()) == 0:  # its rows run
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert status()["queue_depth"] <= INFLIGHT  # the job never fills the waiting queue
    alone = call(server, "POST", "/v1/images/generations", json={"prompt": "a handwritten digit two",
                                                                  "num_inference_steps": 2, "seed": 3})
    assert alone.status_code == 200  # served beside the job
    cancelled = call(server, "POST", f"/v1/jobs/{job}/cancel")
    steps_at_cancel = status()["steps"]
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    while sum(status()["live_rows"].values()) or status()["queue_depth"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert status()["steps"] - steps_at_cancel <= 1  # at most the step that was running
    final = call(server, "GET", f"/v1/jobs/{job}").json()
    assert final["status"] == "cancelled" and final["counts"]["done"] == 0 and final["counts"]["pending"] == 30
    results = call(server, "GET", f"/v1/jobs/{job}/results").json()
    assert {d["status"] for d in results["data"]} == {"cancelled"}
    assert call(server, "POST", f"/v1/jobs/{job}/cancel").json()["status"] == "cancelled"  # idempotent
    assert call(server, "DELETE", f"/v1/jobs/{job}").json() == {"id": job, "object": "job", "deleted": True}
    assert call(server, "GET", f"/v1/jobs/{job}").status_code == 404
    assert not os.path.exists(os.path.join(str(server.state), "images", job))


def test_a_job_belongs_to_its_key(server):
    job = post_job(server, {"items": [{"prompt": "a handwritten digit five", "num_inference_steps": 2,
                                       "seeds": [1]}]})["id"]
    wait_job(server, job)
    name = "0-0.png"
    for method, path in (("GET", f"/v1/jobs/{job}"), ("GET", f"/v1/jobs/{job}/results"),
                         ("GET", f"/v1/jobs/{job}/images/{name}"), ("POST", f"/v1/jobs/{job}/cancel"),
                         ("DELETE", f"/v1/jobs/{job}")):
        r = call(server, method, path, KEY_B)
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (method, path, r.text)
        assert call(server, method, path, "no-such-key").status_code == 401
    assert job not in [j["id"] for j in call(server, "GET", "/v1/jobs", KEY_B).json()["data"]]
    assert job in [j["id"] for j in call(server, "GET", "/v1/jobs").json()["data"]]
    assert call(server, "GET", f"/v1/jobs/{job}/images/{name}").status_code == 200  # still there for its owner
    assert call(server, "GET", f"/v1/jobs/{job}/images/..%2F..%2Fjobs.sqlite3").status_code == 404
    assert call(server, "GET", "/v1/jobs/job_../results").status_code == 404


@pytest.mark.parametrize("body, content_type, needle, param", [
    (b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",\n', "application/x-ndjson", "line 3 is not valid JSON",
     "line 3"),
    (b'{"prompt": "a"}\n{"prompt": "b", "cfg": 7}\n', "application/jsonl", "line 2: unknown field 'cfg'",
     "line 2.cfg"),
    (json.dumps({"items": [{"prompt": "a"}, {"prompt": "b", "size": "4096x4096"}]}).encode(), "application/json",
     "items[1]: width 4096 is outside the supported range", "items[1].size"),
    (json.dumps({"items": [{"prompt": "a", "n": 2}], "webhook": "http://example.com/hook"}).encode(),
     "application/json", "webhook host 'example.com' is not allowed; this server calls only 127.0.0.1", "webhook"),
    (b'{"prompt": "a handwritten digit three"}\n' * 1_000_001, "application/x-ndjson",
     "the job has more than 100000 items", "items"),
])
def test_a_bad_job_is_refused_naming_its_line_and_field_and_nothing_is_stored(server, body, content_type, needle,
                                                                                 param):
    before = len(call(server, "GET", "/v1/jobs").json()["data"])
    r = call(server, "POST", "/v1/jobs", content=body, headers={"Content-Type": content_type})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_job"
    assert len(call(server, "GET", "/v1/jobs").json()["data"]) == before


def test_the_webhook_is_called_once_per_job_retried_after_a_500_and_signed(server, receiver):
    hook = f"http://127.0.0.1:{receiver.server_address[1]}/done"
    jobs = {name: post_job(server, {"items": [{"prompt": "a handwritten digit six", "num_inference_steps": 2,
                                               "seeds": [1, 2]}], "name": name, "webhook": hook})["id"]
            for name in ("steady", "flaky")}
    for job in jobs.values():
        final = wait_job(server, job, lambda j: j["webhook"]["state"] not in ("pending", None))
        assert final["webhook"] == {"url": hook, "state": "sent", "error": None}
    calls = {name: [(h, b) for h, b in receiver.calls if json.loads(b)["id"] == job] for name, job in jobs.items()}
    assert len(calls["steady"]) == 1 and len(calls["flaky"]) == 2  # the 500 retried once, then one delivery
    assert calls["flaky"][0][1] == calls["flaky"][1][1]  # the same body, the same delivery id
    for name, job in jobs.items():
        for headers, body in calls[name]:
            expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(headers["X-Diffgraph-Signature"], expected)
            assert headers["X-Diffgraph-Event"] == "job.completed" and headers["X-Diffgraph-Delivery"] == job
            summary = json.loads(body)
            assert summary["status"] == "completed" and summary["counts"]["done"] == 2 and summary["name"] == name


def test_jobs_need_a_state_dir():
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig

    client = TestClient(create_app(ServerConfig(model="digits")))  # no lifespan: no engine is built
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/job_x/results")):
        r = client.request(method, path)
        assert r.status_code == 404 and "start it with --state-dir DIR" in r.json()["error"]["message"]


def test_diffgraph_batch_url_makes_the_job_on_the_server_and_downloads_it(server, tmp_path, capsys):
    """`diffgraph batch FILE --out DIR --url URL`: the missing candidates sent as one job, followed, downloaded; a
    re-run finds them all in DIR (the server's defaults from GET /info) and makes no job."""
    from diffgraph.cli import main
    from diffgraph.image_metadata import read_request

    job, out = tmp_path / "grid.json", tmp_path / "out"
    job.write_text(json.dumps({"grid": {"prompts": ["a handwritten digit eight", "a handwritten digit nine"],
                                        "seeds": [5, 6], "vary": {"num_inference_steps": [2, 3]}}}))
    argv = ["batch", str(job), "--out", str(out), "--url", server.url, "--api-key", KEY_A, "--grid"]
    jobs_before = len(call(server, "GET", "/v1/jobs").json()["data"])
    assert main(argv) == 0
    assert "8 of 8 images (8 made, 0 already there), 0 failed" in capsys.readouterr().err
    names = sorted(n for n in os.listdir(out) if n.endswith(".png"))
    assert names == sorted([f"{i:05d}-{k}.png" for i in range(4) for k in range(2)] +
                           [f"{i:05d}-sheet.png" for i in range(4)])
    saved = read_request(str(out / "00003-1.png"))
    assert (saved["prompt"], saved["num_inference_steps"], saved["seed"]) == ("a handwritten digit nine", 3, 6)
    assert len(call(server, "GET", "/v1/jobs").json()["data"]) == jobs_before + 1
    assert main(argv) == 0
    assert "8 of 8 images (0 made, 8 already there)" in capsys.readouterr().err
    assert len(call(server, "GET", "/v1/jobs").json()["data"]) == jobs_before + 1  # no second job


# -- bad input that used to answer 500, in process on random:tiny ----------------------------------------------
BAD_URL = "http://127.0.0.1:9/done\x01"  # the allowed host, a control character in the path


@pytest.fixture(scope="module")
def engine():
    """An engine of its own: the server closes its engine when it stops (the session's shared one must live on)."""
    from diffgraph import Engine
    return Engine("random:tiny", device="cpu")


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    from diffgraph.server import ServerConfig
    from server_util import served
    config = ServerConfig(model="random:tiny", device="cpu", state_dir=str(tmp_path_factory.mktemp("state")),
                          webhook_allow=("127.0.0.1",), webhook_secret="s3cret")
    with served(engine, config) as c:
        yield c


@pytest.mark.parametrize("limit", ["\u00b2", "9" * 5000])
def test_a_query_number_int_cannot_read_is_a_400(client, limit):
    r = client.get("/v1/jobs", params={"limit": limit})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "limit"


def test_a_job_name_with_an_unpaired_surrogate_is_a_400(client, engine):
    size = engine.info.native_size
    body = '{"name": "shots \\ud800", "items": [{"prompt": "a fox", "size": "%dx%d"}]}' % (size, size)
    r = client.post("/v1/jobs", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"] and r.json()["error"]["param"] == "name"


def test_a_webhook_url_httpx_cannot_send_to_is_a_400(client, engine):
    size = engine.info.native_size
    body = json.dumps({"webhook": BAD_URL, "items": [{"prompt": "a fox", "size": f"{size}x{size}"}]})
    r = client.post("/v1/jobs", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "webhook"


def test_a_stored_webhook_httpx_cannot_send_to_fails_with_a_reason_rather_than_raising():
    """A job stored before the check (or by an older server): its delivery must end as failed, with why, not raise
    (the coordinator would then start it again at every poll, forever)."""
    with pytest.raises(WebhookRefused):
        check_webhook(BAD_URL, ("127.0.0.1",))
    sender = WebhookSender(("127.0.0.1",), None, attempts=1)
    error = asyncio.run(sender.deliver(BAD_URL, {"id": "job_x", "status": "completed"}))
    assert isinstance(error, str) and "webhook" in error


def test_a_failed_commit_leaves_no_transaction_open(tmp_path):
    """When COMMIT itself fails SQLite may keep the transaction open; the store rolls it back, so the next write
    works (before, every later BEGIN IMMEDIATE failed: 'cannot start a transaction within a transaction')."""
    import sqlite3

    from diffgraph.jobs.spec import JobItem, JobSpec
    from diffgraph.jobs.store import JobStore, StoreError

    class CommitFailsOnce:
        def __init__(self, db):
            self.db, self.failed = db, False

        def commit(self):
            if not self.failed:
                self.failed = True
                raise sqlite3.OperationalError("disk I/O error")
            self.db.commit()

        def __getattr__(self, name):
            return getattr(self.db, name)

    store = JobStore(str(tmp_path))
    spec = JobSpec((JobItem({"prompt": "a cat"}, (1,), False),), "shots", None)
    store._db = CommitFailsOnce(store._db)
    with pytest.raises(StoreError, match="could not be written: disk I/O error"):
        store.create("me", spec, "digits")
    job = store.create("me", spec, "digits")  # the next write works
    assert [j.id for j in store.jobs("me")] == [job.id]


def test_a_job_naming_a_lora_the_server_cannot_serve_is_refused_whole_before_it_is_stored(client, engine):
    """It was accepted and its items failed one by one in the engine (the README says a bad job is refused whole)."""
    size = engine.info.native_size
    before = client.get("/v1/jobs").json()["data"]
    items = [{"prompt": "a fox", "size": f"{size}x{size}"},
             {"prompt": "an owl", "size": f"{size}x{size}", "loras": [["ink", 0.5]]}]
    r = client.post("/v1/jobs", json={"items": items})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("items[1]: adapter 'ink': this server has no adapter slots")
    assert error["param"] == "items[1].loras"
    assert client.get("/v1/jobs").json()["data"] == before  # nothing stored


def test_a_grid_over_the_candidate_limit_is_a_400_and_stores_nothing(client, engine):
    size = engine.info.native_size
    before = client.get("/v1/jobs").json()["data"]
    grid = {"grid": {"prompts": [f"p{i}" for i in range(316)], "seeds": list(range(64)),
                     "vary": {"guidance_scale": [1 + i / 100 for i in range(316)]}, "base": {"size": f"{size}x{size}"}}}
    r = client.post("/v1/jobs", json=grid)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "grid" and "(--max-job-candidates)" in r.json()["error"]["message"]
    assert client.get("/v1/jobs").json()["data"] == before


def test_a_damaged_store_is_a_503_saying_what_to_do_never_a_500(tmp_path):
    """Reads raised sqlite3.DatabaseError through the routes: a 500 with a traceback in the log."""
    from fastapi.testclient import TestClient
    from test_jobs_store import damage, spec

    from diffgraph import Engine
    from diffgraph.jobs.store import JobStore
    from diffgraph.server import ServerConfig, create_app

    store = JobStore(str(tmp_path))
    store.create("", spec(20), "random:tiny")
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    damage(str(tmp_path))
    engine = Engine("random:tiny", device="cpu")
    config = ServerConfig(model="random:tiny", device="cpu", state_dir=str(tmp_path))
    with TestClient(create_app(config, engine_factory=lambda: engine), raise_server_exceptions=False) as c:
        deadline = time.monotonic() + 300
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, c.get("/ready").text
            threading.Event().wait(0.05)
        size = engine.info.native_size
        for r in (c.get("/v1/jobs"), c.post("/v1/jobs", json={"items": [{"prompt": "a", "size": f"{size}x{size}"}]})):
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "job_store_damaged" and "database disk image is malformed" in error["message"]
            assert "move jobs.sqlite3" in error["message"] and "Traceback" not in r.text
