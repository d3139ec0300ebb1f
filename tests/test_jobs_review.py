"""Bad input to /v1/jobs that used to answer 500 (or leave a webhook pending forever) instead of a one-line 400:
query numbers Python's int() cannot read, text holding an unpaired surrogate (SQLite cannot store it), webhook URLs
that pass the allow list but that httpx refuses to send to."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from diffgraph.jobs.webhook import WebhookRefused, WebhookSender, check_webhook

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
