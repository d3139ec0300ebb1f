"""The CPU server against the in-process Engine: 8 concurrent requests, idle and with two CPU-bound processes.

    python tools/bench_cpu_server.py [--model digits] [--requests 8] [--repeats 3] [--server-args "--torch-threads 2"]

For each machine state (idle, then loaded by two `python -c "while True: pass"`), in one run: the in-process
`Engine` (its defaults: torch's own thread count) makes N requests submitted at once, then a `diffgraph serve`
process (its defaults, or --server-args) gets the same N requests over HTTP at once. Prints the median wall time
of each over --repeats rounds and their ratio (the first-hour target: HTTP <= 1.5 x in-process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
BODY = {"prompt": "a handwritten digit {i}", "num_inference_steps": 20, "size": "64x64"}


def in_process(model: str, n: int, repeats: int) -> float:
    sys.path.insert(0, SRC)
    from diffgraph import Engine

    times = []
    with Engine(model=model, device="cpu") as engine:
        engine.generate("warm-up", num_inference_steps=2, seed=0)
        for r in range(repeats):
            requests = [engine.make_request(f"a handwritten digit {i}", num_inference_steps=20, seed=100 * r + i,
                                            output_format="png") for i in range(n)]
            t0 = time.perf_counter()
            for f in [engine.submit(q) for q in requests]:
                f.result()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def over_http(model: str, n: int, repeats: int, server_args: list[str]) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "diffgraph.server.cli", "--model", model, "--device", "cpu",
                             "--port", str(port), "--log-level", "warning", "--no-access-log", *server_args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("the server exited")
            time.sleep(0.1)
        times = []
        with httpx.Client(base_url=url, timeout=600) as client, \
                concurrent.futures.ThreadPoolExecutor(n) as pool:
            for r in range(repeats):
                bodies = [{**BODY, "prompt": BODY["prompt"].format(i=i), "seed": 100 * r + i} for i in range(n)]
                t0 = time.perf_counter()
                answers = list(pool.map(lambda b: client.post("/v1/images/generations", json=b), bodies))
                times.append(time.perf_counter() - t0)
                assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        return statistics.median(times)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-args", default="", help="extra flags for diffgraph serve, e.g. '--torch-threads 2'")
    p.add_argument("--states", default="idle,loaded")
    args = p.parse_args()
    print(f"cores {os.cpu_count()}, model {args.model}, {args.requests} requests x 20 steps at 64x64, "
          f"median of {args.repeats}; server flags: {args.server_args or '(defaults)'}")
    print("| machine | in-process Engine s | HTTP server s | ratio |\n|---|---|---|---|")
    for state in args.states.split(","):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)] \
            if state == "loaded" else []
        try:
            a = in_process_subprocess(args.model, args.requests, args.repeats)
            b = over_http(args.model, args.requests, args.repeats, shlex.split(args.server_args))
        finally:
            for h in hogs:
                h.kill()
        print(f"| {state} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)
    return 0


def in_process_subprocess(model: str, n: int, repeats: int) -> float:
    """The in-process figure from a fresh process (torch's thread pools as a user's script gets them)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"from bench_cpu_server import in_process; print(in_process({model!r}, {n}, {repeats}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
