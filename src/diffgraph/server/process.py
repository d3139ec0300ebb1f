"""`ServerProcess`: a `diffgraph serve` subprocess on a free local port, for tests, tools and benchmarks.

    with ServerProcess("--devices", "cpu,cpu", model="random:tiny") as server:   # waits for GET /ready == 200
        httpx.post(server.url + "/v1/images/generations", json={...})
                                                                                # SIGTERM (a drain) on exit

Its output goes to a temporary file (`output()`), so a failure can show what the server said. `wait_ready` polls
until /ready (or another path) answers 200, with a bound that is a failure bound, not a timing assumption.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the folder holding diffgraph/


class ServerProcess:
    def __init__(self, *flags: str, model: str = "random:tiny", device: str = "cpu", log_level: str = "warning",
                 entry: tuple[str, ...] = ("-m", "diffgraph.server.cli")):
        """`entry`: what the interpreter runs, given the serve flags (a benchmark's in-process variant, say)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "--model", model, "--device", device, "--port",
             str(self.port), "--log-level", log_level, *flags], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.first_ready_status: int | None = None  # the first answer of /ready (503 while the model loads)
        self.first_ready_body: dict | None = None

    def wait_ready(self, timeout: float = 600.0, path: str = "/ready") -> None:
        """Polls `path` until it answers 200: /ready (the model is loaded), or /health (the server listens)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + path, timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if path == "/ready" and self.first_ready_status is None:
                try:
                    body = r.json()
                except ValueError:  # not ours yet (e.g. Ray's proxy before the application is deployed)
                    time.sleep(0.05)
                    continue
                self.first_ready_status, self.first_ready_body = r.status_code, body
            if r.status_code == 200:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{path} did not answer 200 within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "ServerProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
