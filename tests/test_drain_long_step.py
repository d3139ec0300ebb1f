"""SIGTERM while a long step runs and a client waits (issue 28 point 4): once the drain timeout passes the client
gets 503 (retry elsewhere) without waiting for the step, and the process exits 0, not by SIGABRT from tearing the
interpreter down under a busy native op. The long step is made by a test-side wrapper around the server's normal
entry point (the server itself has no test hooks): steps of a "slow" request first run torch matmuls for minutes, in
the engine's process (the wrapper's module is the spawned process's __mp_main__ too)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from diffgraph.server.process import SRC

WRAPPER = '''
import sys, time, torch
from diffgraph.engine import core
step = core.EngineCore._step  # patched here and in the engine process (spawned: it runs this file as __mp_main__)
def slow(self, plan):
    if any("slow" in s.request.prompt for s in plan.live):
        a, end = torch.randn(768, 768), time.monotonic() + 300
        while time.monotonic() < end:
            a = (a @ a).tanh()  # native work on torch's threads, as a long denoising step
    return step(self, plan)
core.EngineCore._step = slow
if __name__ == "__main__":
    from diffgraph.server.cli import main
    sys.exit(main(sys.argv[1:]))
'''


def test_sigterm_during_a_long_step_answers_503_and_exits_0(tmp_path):
    script = tmp_path / "slow_server.py"
    script.write_text(WRAPPER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, str(script), "--model", "random:tiny", "--device", "cpu", "--port",
                             str(port), "--drain-timeout", "1", "--log-level", "warning"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # failure bounds, not timing assumptions
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        answer: dict[str, httpx.Response] = {}
        client = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
            url + "/v1/images/generations", json={"prompt": "slow", "num_inference_steps": 2}, timeout=600)))
        client.start()
        while 'diffgraph_live_rows{group="64x64"} 1.0' not in httpx.get(url + "/metrics", timeout=30).text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the step has minutes to go
        client.join(120)
        r = answer["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "aborted" and "retry on another replica" in r.json()["error"]["message"]
        assert proc.wait(120) == 0, (tmp_path / "server.log").read_text()
        assert "terminate called" not in (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
