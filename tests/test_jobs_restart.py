"""A job survives SIGKILL (issue 35, point 2): `diffgraph serve --model digits --state-dir DIR` killed at five points
of its write path (tests/jobs_crash_server.py: while an image's bytes are written to its temporary name, before
its rename, just after it, during a commit; and once from outside at a moment the test does not choose), restarted
each time: the job completes, the stored images are exactly the items' candidates, none was stored twice (every
final name renamed once across all the runs), none is half written (each decodes, carrying its own seed), and the
temporary files the crashes left are gone. Six server starts in all (each costs seconds)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time

import httpx
from PIL import Image

from diffgraph.image_metadata import read_request
from diffgraph.server.process import SRC

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs_crash_server.py")
BOUND_S = 600  # a failure bound for waits on a state, never a timing assumption
ITEMS, SEEDS = 16, (11, 22)


class Server:
    """One run of the wrapped server on the state folder."""

    def __init__(self, state: str, log: str, point: str = "none", nth: int = 0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.out = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, WRAPPER, point, str(nth), log, "--", "--model", "digits", "--device", "cpu", "--port",
             str(port), "--log-level", "warning", "--state-dir", state, "--batch-inflight", "2",
             "--max-pixels", "0"],  # no second warm-up image to time the CPU's pixel limit: a quicker start
            env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.out.seek(0)
        return self.out.read().decode(errors="replace")

    def ready(self) -> "Server":
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"not ready within {BOUND_S} s:\n{self.output()}")

    def killed(self) -> None:
        """Waits for the wrapper's SIGKILL (a failure bound only)."""
        assert self.proc.wait(BOUND_S) == -signal.SIGKILL, self.output()


def job_state(state: str, job: str) -> tuple[str, int, list[str]]:
    db = sqlite3.connect(f"file:{os.path.join(state, 'jobs.sqlite3')}?mode=ro", uri=True)
    try:
        status, done = db.execute("SELECT status, done FROM jobs WHERE id = ?", (job,)).fetchone()
    finally:
        db.close()
    folder = os.path.join(state, "images", job)
    return status, done, sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_a_job_survives_sigkill_at_five_points_and_completes_exactly(tmp_path):
    state, log = str(tmp_path / "state"), str(tmp_path / "renames.log")
    open(log, "w").close()
    server = Server(state, log, "write", 3).ready()
    items = [{"prompt": f"a handwritten digit {w}", "num_inference_steps": 2, "seeds": [s + i for s in SEEDS]}
             for i, w in enumerate(["zero", "one", "two", "three"] * (ITEMS // 4))]
    r = httpx.post(server.url + "/v1/jobs", json={"items": items}, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    job = r.json()["id"]

    server.killed()  # 1: while the third image's bytes were fsynced under its temporary name
    _, done, names = job_state(state, job)
    assert any(n.endswith(".tmp") for n in names) and done <= 2

    Server(state, log, "renamed", 2).killed()  # 2: an image renamed into place, not yet committed
    _, done, names = job_state(state, job)
    assert len([n for n in names if n.endswith(".png")]) > done  # stored, not marked: adopted by the next run

    Server(state, log, "commit", 6).killed()  # 3: during a commit
    Server(state, log, "replace", 3).killed()  # 4: an image made, before its rename
    _, done, names = job_state(state, job)
    assert any(n.endswith(".tmp") for n in names)

    server = Server(state, log).ready()  # 5: from outside, once it has made a few more images
    deadline = time.monotonic() + BOUND_S
    while job_state(state, job)[1] < done + 3:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGUSR1)  # the wrapper's SIGKILL from outside (not between a rename and its log)
    server.killed()
    assert job_state(state, job)[0] == "running"

    server = Server(state, log).ready()  # the last start: the job completes
    try:
        deadline = time.monotonic() + BOUND_S
        while job_state(state, job)[0] == "running":
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        summary = httpx.get(f"{server.url}/v1/jobs/{job}", timeout=BOUND_S).json()
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(BOUND_S)
    assert summary["status"] == "completed" and summary["counts"] == {
        "items": ITEMS, "candidates": 2 * ITEMS, "done": 2 * ITEMS, "failed": 0, "pending": 0}
    expected = sorted(f"{i}-{k}.png" for i in range(ITEMS) for k in range(2))
    assert job_state(state, job)[2] == expected  # exactly the candidates: no temporary file, nothing else
    renames = [os.path.basename(line) for line in open(log).read().split()]
    assert sorted(renames) == expected  # each stored once: none made again after it was stored
    for i, item in enumerate(items):
        for k, seed in enumerate(item["seeds"]):
            path = os.path.join(state, "images", job, f"{i}-{k}.png")
            with Image.open(path) as im:
                im.load()  # every pixel: not half written
                assert im.size == (64, 64)
            saved = read_request(path)
            assert (saved["seed"], saved["prompt"]) == (seed, item["prompt"]), json.dumps(saved)
