"""Adapter listings beside generations, over HTTP against a `diffgraph serve` in its own process (issue 36).

    python tools/bench_listings.py [--adapters 120] [--listers 12] [--samples 7] [--steps 1]

Writes ADAPTERS small adapters for `digits` into a temporary --lora-dir, starts the server on the CPU, and measures
the latency of one generation (median of SAMPLES) idle, then started together with LISTERS concurrent
`GET /v1/loras` calls: on a cold cache (every file a new version before each sample) and warm. Prints the ratios
against idle (the issue's target: within 1.5x). A benchmark, not a test: the ratio measures the machine's load too.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def _adapters(root: str, count: int) -> None:
    import torch
    from safetensors.torch import save_file

    from diffgraph import Engine

    with Engine("digits", device="cpu", max_loras=4, max_lora_rank=8) as engine:
        layers = list(engine.runner.loras.banks["unet"].layers.items())[:8]
        for i in range(count):
            g = torch.Generator().manual_seed(i)
            out = {}
            for path, slot in layers:
                out[f"unet.{path}.lora_A.weight"] = torch.randn(2, slot.a.shape[2], generator=g) * 0.05
                out[f"unet.{path}.lora_B.weight"] = torch.randn(slot.b.shape[2], 2, generator=g) * 0.05
            save_file(out, os.path.join(root, f"a{i:03d}.safetensors"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", type=int, default=120)
    p.add_argument("--listers", type=int, default=12)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="diffgraph-listings-")
    _adapters(root, args.adapters)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "diffgraph.server.cli", "--model", "digits", "--device", "cpu",
                               "--lora-dir", root, "--max-loras", "4", "--max-lora-rank", "8", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "a handwritten digit seven", "num_inference_steps": args.steps, "seed": 3}
    try:
        with httpx.Client(timeout=300) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get(f"{url}/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    print("the server did not become ready")
                    return 1
                time.sleep(0.2)

            def generation() -> float:
                t0 = time.perf_counter()
                assert client.post(f"{url}/v1/images/generations", json=body).status_code == 200
                return time.perf_counter() - t0

            # one client per lister, made before timing (a new httpx.Client builds an SSL context: ~15 ms of this
            # process's GIL each, which would count against the generation measured here)
            listers = [httpx.Client(timeout=300) for _ in range(args.listers)]

            def listing(c: httpx.Client) -> None:
                assert c.get(f"{url}/v1/loras").status_code == 200

            generation()
            for c in listers:
                listing(c)
            idle = statistics.median(generation() for _ in range(args.samples))
            results = {}
            for label, cold in (("cold", True), ("warm", False)):
                times = []
                for _ in range(args.samples):
                    if cold:
                        for name in os.listdir(root):
                            path = os.path.join(root, name)
                            st = os.stat(path)
                            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
                    start = threading.Barrier(args.listers + 1)
                    threads = [threading.Thread(target=lambda c=c: (start.wait(), listing(c))) for c in listers]
                    for t in threads:
                        t.start()
                    start.wait()
                    times.append(generation())
                    for t in threads:
                        t.join()
                results[label] = statistics.median(times)
            print(f"{args.steps}-step digits generation over HTTP, median of {args.samples}: idle {idle * 1e3:.0f} ms; "
                  f"with {args.listers} concurrent listings over {args.adapters} adapters: "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms ({v / idle:.2f}x)" for k, v in results.items()))
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
