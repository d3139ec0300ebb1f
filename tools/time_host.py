"""Host time of a burst's intake, the part of a guidance-mix burst (`diffgraph bench throughput --guidance-mix`)
that runs before the first step on the engine loop thread while the GPU waits: the requests' submission (plan,
prompts tokenised, state, queue) and their admission (conditioning looked up, rows written), ms per request.

    python tools/time_host.py [--model random:tiny] [--device cpu] [--requests 64] [--rounds 5]

Submission is timed with fresh prompts, with prompts sent before (the token cache: text/prepared.py `TokenCache`),
and with fresh prompts and the token cache off (every tokenizer call made, as before the cache); admission is
`EngineCore._admit`, the first step's admissions of the burst whose prompts were sent before (their conditioning in
the prompt cache: no text encoding, as in the bench's timed bursts). Each figure is the median over `rounds` bursts of
`requests` 4-step requests at guidance 0, 64x64 (the prompts' host cost does not depend on the size). Last, what an
image thread spent per image before decoded pixels became float32 on the device (780c123): fp16 [32, size, size, 3]
to float32 on the CPU, with torch's default threads (as the image threads ran it), and what they spend now: each
request's float32 pixels copied out of the decoded batch (pinned memory is not handed to callers). And a burst's tail:
one decode's 32 one-image requests answered (each request's copy and finiteness check, as `Retirement._deliver`)
one after another on one image thread (before: one task a decode) against a task a request
on the engine's 2 image threads (since), ms for the 32.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from diffgraph import Engine
from diffgraph.text.prepared import TokenCache


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pixels", type=int, default=512, help="the image side of the fp16 -> float32 conversion row")
    a = p.parse_args()
    threads = torch.get_num_threads()
    half = torch.rand(32, a.pixels, a.pixels, 3).half()
    convert, copy = [], []
    for _ in range(a.rounds + 1):
        t0 = time.perf_counter()
        pixels = half.float().numpy()
        t1 = time.perf_counter()
        for i in range(32):
            pixels[i:i + 1].copy()
        convert.append((t1 - t0) * 1e3 / 32)
        copy.append((time.perf_counter() - t1) * 1e3 / 32)
    block = half.float().numpy()

    def answer(i: int) -> bool:  # Retirement._deliver's array work for one one-image request
        return bool(np.isfinite(block[i:i + 1].copy()).all())
    serial, shared = [], []
    with ThreadPoolExecutor(max_workers=2) as images:
        for _ in range(a.rounds + 1):
            t0 = time.perf_counter()
            images.submit(lambda: [answer(i) for i in range(32)]).result()
            t1 = time.perf_counter()
            for f in [images.submit(answer, i) for i in range(32)]:
                f.result()
            serial.append((t1 - t0) * 1e3)
            shared.append((time.perf_counter() - t1) * 1e3)
    torch.set_num_threads(1)  # the loop thread's own cost, not the box's spare cores
    with Engine(model=a.model, device=a.device) as engine:
        core, runner = engine.core, engine.runner
        cached_setup = runner.text_setup
        admits: list[tuple[float, int]] = []  # (seconds, requests admitted)
        admit = core._admit

        def timed_admit(key, states):
            t0 = time.perf_counter()
            try:
                return admit(key, states)
            finally:
                admits.append((time.perf_counter() - t0, len(states)))
        core._admit = timed_admit

        def burst(prefix: str) -> tuple[float, float]:
            requests = [engine.make_request(f"{prefix} a photo of a fox, number {i}", num_inference_steps=4, seed=i,
                                            width=64, height=64, guidance_scale=0.0) for i in range(a.requests)]
            spent: list[float] = []

            def submit_all() -> list:
                t0 = time.perf_counter()
                futures = [engine.submit(r) for r in requests]
                spent.append(time.perf_counter() - t0)
                return futures
            admits.clear()
            for f in core.call_between_steps(submit_all).result():
                f.result()
            return spent[0] * 1e3 / a.requests, admits[0][0] * 1e3 / admits[0][1]

        burst("warm")
        rows = {"fresh prompts": [], "prompts sent before": [], "fresh prompts, no token cache": []}
        admission = []
        for r in range(a.rounds):
            rows["fresh prompts"].append(burst(f"round {r}")[0])
            ms, adm = burst(f"round {r}")
            rows["prompts sent before"].append(ms)
            admission.append(adm)
            runner.text_setup = dataclasses.replace(cached_setup, tokens=TokenCache(0))
            rows["fresh prompts, no token cache"].append(burst(f"uncached {r}")[0])
            runner.text_setup = cached_setup
    print(f"{a.model} on {a.device}, bursts of {a.requests}, median of {a.rounds}, one torch thread, ms per request\n")
    print("| what | ms per request |\n|---|---|")
    for name, values in rows.items():
        print(f"| submit, {name} | {statistics.median(values):.3f} |")
    print(f"| admission (first step's, per admitted request) | {statistics.median(admission):.3f} |")
    print(f"| before 780c123, an image thread: fp16 -> float32 pixels at {a.pixels}x{a.pixels}, {threads} torch "
          f"threads, per image | {statistics.median(convert[1:]):.3f} |")
    print(f"| since, an image thread: a request's float32 pixels copied out of the batch's pinned block, per image "
          f"| {statistics.median(copy[1:]):.3f} |")
    print(f"| a decode's 32 one-image requests answered at {a.pixels}x{a.pixels}, one task (before), ms for the 32 "
          f"| {statistics.median(serial[1:]):.3f} |")
    print(f"| the same, a task a request on 2 image threads (since), ms for the 32 "
          f"| {statistics.median(shared[1:]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
