"""The server's engine in its own process on one device as on many (issue 28 point 2): the HTTP process never
imports torch or the model stack while it serves every kind of request, and an engine process killed mid-request
on a one-device server answers its client 503, restarts, and serves the next request."""

import json
import os
import signal
import subprocess
import sys

import shutil

import httpx
import pytest

from diffgraph.models.presets import shipped_preset_folder
from diffgraph.server.process import SRC, ServerProcess
from lora_util import _write_kohya
from test_server import generate, metrics, wait_for

# Runs in a fresh interpreter: `diffgraph serve`'s own entry point (cli.main, on this main thread until drained),
# driven from a thread through every front end (OpenAI generations with and without a LoRA, streaming and edits,
# AUTOMATIC1111 txt2img, jobs, listings, metrics), then SIGTERM; last it reports which heavy modules it imported.
HTTP_PROCESS = r'''
import io, json, os, signal, socket, sys, threading, time
import httpx
from PIL import Image
from diffgraph.server import cli

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url, answers = f"http://127.0.0.1:{port}", {}

def drive():
    try:
        deadline = time.monotonic() + 600  # a failure bound: the replica process loads the model meanwhile
        while True:
            try:
                if httpx.get(url + "/ready", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)
        c = httpx.Client(base_url=url, timeout=600)
        body = {"prompt": "a cat", "num_inference_steps": 2, "size": "64x64"}
        answers["generations"] = c.post("/v1/images/generations", json=body).status_code
        answers["lora"] = c.post("/v1/images/generations", json={**body, "loras": [{"name": "ink", "scale": 0.8}]}
                                 ).status_code
        answers["stream"] = c.post("/v1/images/generations", json={**body, "stream": True}).status_code
        png = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 40, 40)).save(png, "PNG")
        answers["edits"] = c.post("/v1/images/edits", data={"prompt": "a dog", "num_inference_steps": "2"},
                                  files={"image": ("a.png", png.getvalue(), "image/png")}).status_code
        answers["txt2img"] = c.post("/sdapi/v1/txt2img", json={"prompt": "a cat", "steps": 2, "width": 64,
                                                                "height": 64}).status_code
        job = c.post("/v1/jobs", json={"items": [{**body, "n": 1}]}).json()["id"]
        while c.get(f"/v1/jobs/{job}").json()["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.05)
        answers["job"] = c.get(f"/v1/jobs/{job}").json()["status"]
        for path in ("/v1/loras", "/v1/embeddings", "/v1/models", "/metrics", "/status", "/info",
                     "/sdapi/v1/samplers", "/sdapi/v1/loras", "/sdapi/v1/progress", "/ready"):
            answers[path] = c.get(path).status_code
        answers["loaded"] = c.get("/v1/loras").json()
        if len(sys.argv) > 3:  # --model-dir: a model of the folder, loaded in the engine's process on first use
            answers["other model"] = c.post("/v1/images/generations", json={**body, "model": "digits-copy"}
                                            ).status_code
            answers["resident"] = sorted(m["id"] for m in c.get("/v1/models").json()["data"] if m["resident"])
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # the drain: cli.main returns

threading.Thread(target=drive).start()
rc = cli.main(["--model", "random:tiny", "--port", str(port), "--max-pixels", "0", "--lora-dir", sys.argv[1],
               "--embeddings-dir", sys.argv[1], "--state-dir", sys.argv[2], "--log-level", "warning",
               *(["--model-dir", sys.argv[3]] if len(sys.argv) > 3 else [])])
heavy = ("torch", "diffusers", "transformers", "safetensors.torch", "diffgraph.engine.engine")
print(json.dumps({"rc": rc, "answers": answers, "imported": [m for m in heavy if m in sys.modules]}))
'''


@pytest.mark.parametrize("models", ["one model", "model dir"])
def test_the_http_process_never_imports_torch(tmp_path, tiny_engine, models):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "loras").mkdir()
    _write_kohya(tiny_engine, str(tmp_path / "loras" / "ink.safetensors"), rank=4, seed=10)
    folder = []
    if models == "model dir":  # the model set lives in the engine's process too
        shutil.copytree(shipped_preset_folder("digits"), tmp_path / "models" / "digits-copy")
        folder = [str(tmp_path / "models")]
    run = subprocess.run([sys.executable, "-c", HTTP_PROCESS, str(tmp_path / "loras"), str(tmp_path / "state"),
                          *folder], env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    answers = report.pop("answers")
    listing = answers.pop("loaded")  # the replica engine's own listing, over the pipe: it knows what its slots hold
    assert [(a["name"], a["loaded"]) for a in listing["data"]] == [("ink", True)] and listing["max_loras"] == 8
    assert answers.pop("job") == "completed"
    if folder:
        assert answers.pop("resident") == ["digits-copy", "random:tiny"]
    assert set(answers.values()) == {200}, answers
    assert report == {"rc": 0, "imported": []}


# `diffgraph serve` whose engine loop breaks on a request for "break the loop" (in the engine's process: spawned, it
# runs this file as __mp_main__; the server itself has no test hooks)
BREAKING_SERVER = '''
import sys
from diffgraph.engine import core
poll = core.EngineCore.poll
def breaking(self):
    if any("break the loop" in s.request.prompt for g in self.scheduler.groups.values() for s in g.waiting):
        raise RuntimeError("a bug in the loop (a test)")
    return poll(self)
core.EngineCore.poll = breaking
if __name__ == "__main__":
    from diffgraph.server.cli import main
    sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the tests that end its engine process (each waits for the restart it caused): its engine loop
    breaks on a request for "break the loop" (BREAKING_SERVER), and serves every other request as `diffgraph serve`."""
    script = tmp_path_factory.mktemp("breaking") / "breaking_server.py"
    script.write_text(BREAKING_SERVER)
    s = ServerProcess("--max-pixels", "0", "--request-timeout", "600", entry=(str(script),))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_a_killed_engine_process_on_one_device_answers_503_restarts_and_serves_again(server):
    import threading
    s = server
    wait_for(lambda: httpx.get(s.url + "/ready", timeout=60).status_code == 200, timeout=600, what="ready")
    [replica] = httpx.get(s.url + "/ready", timeout=60).json()["replicas"]
    assert replica["replica"] == "cpu" and replica["pid"] not in (None, s.proc.pid)
    warm = httpx.get(s.url + "/status", timeout=60).json()["steps"]
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=generate(s.url, num_inference_steps=200, size="256x256")))
    t.start()
    wait_for(lambda: metrics(s.url).get("diffgraph_inflight_requests") == 1.0 and
             httpx.get(s.url + "/status", timeout=60).json()["steps"] > warm, what="the long request stepping")
    os.kill(replica["pid"], signal.SIGKILL)
    t.join(600)
    r = answer["r"]
    assert r.status_code == 503, r.text
    assert "stopped (exit code -9) before this request finished; retry it" in r.json()["error"]["message"]
    wait_for(lambda: httpx.get(s.url + "/ready", timeout=60).status_code == 200, timeout=600,
             what="the engine process restarted")
    [again] = httpx.get(s.url + "/ready", timeout=60).json()["replicas"]
    assert again["restarts"] == replica["restarts"] + 1 and again["pid"] != replica["pid"]
    assert generate(s.url, num_inference_steps=2, size="64x64").status_code == 200


def test_an_engine_process_whose_loop_dies_fails_and_is_restarted(server):
    """The black hole of a dead loop in a live process: the replica reports its engine failed and exits, /ready says
    why until the restarted one is ready, and the next request succeeds there."""
    s = server
    wait_for(lambda: httpx.get(s.url + "/ready", timeout=60).status_code == 200, timeout=600, what="ready")
    restarts = httpx.get(s.url + "/ready", timeout=60).json()["replicas"][0]["restarts"]
    broken = generate(s.url, prompt="break the loop", num_inference_steps=2, size="64x64")
    assert broken.status_code == 503, broken.text
    assert broken.json()["error"]["message"].startswith(
        "the engine failed (its loop stopped after an internal error (RuntimeError: a bug in the loop (a test)))")
    wait_for(lambda: httpx.get(s.url + "/ready", timeout=60).status_code == 200 and
             httpx.get(s.url + "/ready", timeout=60).json()["replicas"][0]["restarts"] == restarts + 1, timeout=600,
             what="the engine process restarted")
    assert "its loop stopped after an internal error (RuntimeError: a bug in the loop (a test))" in s.output()
    assert generate(s.url, num_inference_steps=2, size="64x64").status_code == 200
