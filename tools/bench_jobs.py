"""What the batch-job machinery costs, and what interactive requests get beside a job (issue 35's targets), on one
engine in this process (no HTTP: the same store, coordinator and backend the server runs).

    python3 tools/bench_jobs.py cost --n 1000 --json out/jobs_cost.json     # burst vs job, same requests
    python3 tools/bench_jobs.py mixed --n 600 --rate 1 --json out/jobs_mixed.json

cost: the same N one-image requests (random:sd15 512x512, euler, 20 steps, CFG 7.5, PNG) submitted at once to the
engine (the reference) and made as one N-item job (store, coordinator at --batch-inflight's default, images
written and committed); images/s of each to the last image (target: job >= 0.97x burst).
mixed: a job of N items running, interactive requests (the same settings, another prompt) arriving at `rate` per
second for as long as the job runs; their latency percentiles against the latency of one request inside a full
batch (a burst of as many requests as fill the largest bucket: target p99 <= 1.3x), and the job's images/s against
`cost`'s figure for the job alone (target: its drop no more than the people's share of the GPU: on CUDA their rows'
part of every replay plus their own decodes, over the GPU's busy time, from CUDA events; host step time elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph import Engine  # noqa: E402
from diffgraph.engine.async_engine import AsyncEngine  # noqa: E402
from diffgraph.engine.graph_setup import VAE_BUCKETS, decode_chunks  # noqa: E402
from diffgraph.jobs.backend import EngineBackend, build_request  # noqa: E402
from diffgraph.jobs.coordinator import Coordinator, CoordinatorSettings  # noqa: E402
from diffgraph.jobs.spec import SpecLimits, parse_job  # noqa: E402
from diffgraph.jobs.store import JobStore  # noqa: E402
from diffgraph.api.config import ServerConfig  # noqa: E402

ITEM = {"num_inference_steps": 20, "guidance_scale": 7.5, "sampler": "euler", "size": "512x512"}


def job_file(n: int) -> bytes:
    return "\n".join(json.dumps({"prompt": f"a photo of a fox, number {i}", "seeds": [i], **ITEM})
                     for i in range(n)).encode()


class StepTally:
    """The engine's steps while a run goes: how many, their live rows (and how many of them were the job's), bucket
    rows and host time, each step also kept with the time it ended (so a run's GPU work splits into rows used and
    slots left empty, and into the job's rows and the people's over any window of the run). On CUDA each step also
    keeps its CUDA events (the engine's own, from its first copy to its last launch) and those of the decodes it
    launched, so the GPU's time splits by whose work it was: a step's replay over its live rows, a decode over the
    rows it decodes."""

    def __init__(self, client: AsyncEngine):
        self.on = False
        self.core = client.engine.core
        self.cuda = client.engine.runner.cuda
        self.reset()
        client.add_step_listener(self._step)

    def reset(self) -> None:
        self.log: list[tuple] = []  # (ended at, rows, batch rows, bucket, seconds, step events, decodes)
        self._decodes = 0
        self.core.retirement.decode_log = []
        if self.cuda:
            self.core.step_events = []

    def stop(self) -> None:
        self.on = False
        if self.cuda:
            torch.cuda.synchronize()
        self.core.step_events = self.core.retirement.decode_log = None

    def _step(self, event) -> None:  # on the engine's loop thread, right after the step's end event
        if not self.on:
            return
        step = self.core.step_events[-1] if self.cuda else None
        done = self.core.retirement.decode_log
        decodes, self._decodes = done[self._decodes:], len(done)
        self.log.append((time.perf_counter(), event.rows, event.batch_rows, event.bucket, event.seconds, step,
                         decodes))

    def _between(self, start: float, end: float) -> list[tuple]:
        return [e for e in self.log if start <= e[0] <= end]

    def figures(self, until: float = float("inf")) -> dict:
        log = self._between(-float("inf"), until)
        rows, bucket = sum(e[1] for e in log), sum(e[3] for e in log)
        return {"steps": len(log), "row_steps": rows, "job_row_steps": sum(e[2] for e in log),
                "bucket_row_steps": bucket, "fill": rows / max(1, bucket), "step_seconds": sum(e[4] for e in log)}

    def fill(self, start: float, end: float) -> float:
        """Live rows over bucket rows, over the steps that ended in [start, end]."""
        log = self._between(start, end)
        return sum(e[1] for e in log) / max(1, sum(e[3] for e in log))

    def people_share(self, start: float, end: float) -> float:
        """The people's (non-batch rows') share of the step time of the steps that ended in [start, end]: each
        step's time split over its live rows."""
        log = self._between(start, end)
        total = sum(e[4] for e in log)
        return sum(e[4] * (e[1] - e[2]) / max(1, e[1]) for e in log) / max(1e-9, total)

    def gathering(self, start: float, end: float) -> dict:
        """How the decodes launched by the steps that ended in [start, end] gathered their rows (any device): how
        many, their sizes, and the share of the job's rows decoded in full replays (`ModelRunner.decode_chunks`'
        chunks of the largest VAE bucket, split over a decode's rows as the GPU figures split its time: a smaller
        replay costs more per image, 20.5 ms for 1 against 15.2 for 4 in tools/probe_decode.py's H200 run)."""
        sizes: dict[int, int] = {}
        job_rows = job_full = 0.0
        for *_, decodes in self._between(start, end):
            for rows, batch, _ in decodes:
                sizes[rows] = sizes.get(rows, 0) + 1
                full = sum(n for n in decode_chunks(rows) if n == max(VAE_BUCKETS))
                job_rows += batch
                job_full += full * batch / rows
        return {"decodes": sum(sizes.values()), "rows_per_decode": dict(sorted(sizes.items())),
                "job_rows": job_rows, "job_full_replay_share": job_full / max(1, job_rows)}

    def gpu(self, start: float, end: float) -> dict | None:
        """GPU milliseconds of the steps that ended in [start, end] (CUDA events, after `stop`), by whose work:
        each step's replay (its events less the decodes inside them) split over its live rows, each decode over the
        rows it decoded; `people_share`: the people's part of the GPU's busy time. None off CUDA."""
        if not self.cuda:
            return None
        replay = [0.0, 0.0]  # (job's, people's) ms
        decode = [0.0, 0.0]
        busy = 0.0
        log = self._between(start, end)
        for _, rows, batch, _, _, (s0, s1, _), decodes in log:
            step_ms = s0.elapsed_time(s1)
            inside = 0.0
            for drows, dbatch, (d0, d1) in decodes:
                ms = d0.elapsed_time(d1)
                inside += ms if s0.elapsed_time(d0) >= 0 else 0.0  # a decode launched within this step's events
                busy += 0.0 if s0.elapsed_time(d0) >= 0 else ms
                decode[0] += ms * dbatch / drows
                decode[1] += ms * (drows - dbatch) / drows
            busy += step_ms
            replay[0] += (step_ms - inside) * batch / max(1, rows)
            replay[1] += (step_ms - inside) * (rows - batch) / max(1, rows)
        return {"steps": len(log), "busy_ms": busy, "replay_ms_per_step": sum(replay) / max(1, len(log)),
                "job_replay_ms": replay[0], "people_replay_ms": replay[1], "job_decode_ms": decode[0],
                "people_decode_ms": decode[1], "people_share": (replay[1] + decode[1]) / max(1e-9, busy)}


async def run_job(client: AsyncEngine, n: int, config: ServerConfig, during=None,
                  tally: StepTally | None = None) -> dict:
    """An n-item job through the store and coordinator, timed from its creation to its last committed image;
    `during(job_done)`: a coroutine run beside it (interactive arrivals) until the job ends."""
    if tally is not None:
        tally.reset()
        tally.on = True
    with tempfile.TemporaryDirectory() as root:
        store = JobStore(root)
        backend = EngineBackend(config, lambda: client.info, client.submit)
        coordinator = Coordinator(store, backend, None, CoordinatorSettings(poll_s=0.05))
        t0 = time.perf_counter()
        progress: list[tuple[float, int]] = []  # (time, images done), polled
        job = store.create("", parse_job(job_file(n), "jsonl", SpecLimits()), client.info.name)
        task = asyncio.ensure_future(coordinator.run())
        finished = asyncio.Event()
        side = asyncio.ensure_future(during(finished)) if during else None
        try:
            while True:
                row = store.job(job.id)
                progress.append((time.perf_counter(), row.done))
                if row.done + row.failed >= n:
                    break
                await asyncio.sleep(0.05)
            end = time.perf_counter()
            seconds = end - t0
            finished.set()
            extra = await side if side else None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            store.close()
    figures = window = None
    if tally is not None:
        tally.stop()
        figures = tally.figures(until=end)  # the job's own run (people still finishing after it are not its steps)
        lo, hi = when_done(progress, 0.1 * n), when_done(progress, 0.9 * n)
        window = {"start": lo, "end": hi, "images_per_s": 0.8 * n / (hi - lo), "people_share": tally.people_share(lo, hi),
                  "whole_run_people_share": tally.people_share(t0, end), "fill": tally.fill(lo, hi),
                  "gpu": tally.gpu(lo, hi), "decodes": tally.gathering(lo, hi)}
    return {"images": row.done, "failed": row.failed, "seconds": seconds, "images_per_s": row.done / seconds,
            "side": extra, "steps": figures, "window": window}


def when_done(progress: list[tuple[float, int]], count: float) -> float:
    """The time the job's done count first reached `count` (polled every 50 ms)."""
    return next(t for t, done in progress if done >= count)


async def burst(client: AsyncEngine, requests: list) -> dict:
    t0 = time.perf_counter()
    handles = [await client.submit(r) for r in requests]
    results = await asyncio.gather(*(h.result() for h in handles))
    seconds = time.perf_counter() - t0
    return {"images": len(results), "seconds": seconds, "images_per_s": len(results) / seconds,
            "latency_s": sorted(r.timings["total_ms"] / 1e3 for r in results)}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def cost(client: AsyncEngine, n: int, config: ServerConfig) -> dict:
    reqs = [build_request(config, client.info, {"prompt": f"a photo of a fox, number {i}", **ITEM}, i, "x")
            for i in range(n)]
    await burst(client, reqs[:32])  # warm every bucket the burst walks
    ref = await burst(client, reqs)
    job = await run_job(client, n, config)
    return {"n": n, "burst": {k: v for k, v in ref.items() if k != "latency_s"}, "job": job,
            "ratio": job["images_per_s"] / ref["images_per_s"]}


async def mixed(client: AsyncEngine, n: int, rate: float, config: ServerConfig) -> dict:
    tally = StepTally(client)
    rows = client.info.max_rows // 2  # guided images that fill the largest bucket
    full = [build_request(config, client.info, {"prompt": "a castle", **ITEM}, 1000 + i, "x") for i in range(rows)]
    full = [dataclasses.replace(r, priority="interactive", job=None) for r in full]
    await burst(client, full)
    inside_full = await burst(client, full)  # one request's latency inside a full batch
    alone_job = await run_job(client, n, config, tally=tally)
    rng = random.Random(0)

    async def arrivals(finished: asyncio.Event) -> list[float]:
        latencies, tasks, i = [], [], 0
        while not finished.is_set():
            await asyncio.sleep(rng.expovariate(rate))
            if finished.is_set():
                break
            r = build_request(config, client.info, {"prompt": "a castle at dusk", **ITEM}, 5000 + i, "x")
            r = dataclasses.replace(r, priority="interactive", job=None)
            i += 1

            async def one(request):
                t = time.perf_counter()
                await (await client.submit(request)).result()
                latencies.append(time.perf_counter() - t)
            tasks.append(asyncio.ensure_future(one(r)))
        await asyncio.gather(*tasks)
        return latencies

    with_people = await run_job(client, n, config, during=arrivals, tally=tally)
    lat = with_people.pop("side")
    ref_p99 = pct(inside_full["latency_s"], 0.99)
    alone_steps, mixed_steps = alone_job["steps"], with_people["steps"]
    aw, mw = alone_job["window"], with_people["window"]
    return {"n": n, "rate": rate, "interactive": len(lat), "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99),
            "inside_full_batch_p99_s": ref_p99, "p99_ratio": pct(lat, 0.99) / ref_p99,
            "steps_alone": alone_steps, "steps_with_people": mixed_steps,
            # the whole job, start to last image: its drop against the people's share of the step time meanwhile
            "job_alone_images_per_s": alone_job["images_per_s"],
            "job_with_people_images_per_s": with_people["images_per_s"],
            "job_drop": 1 - with_people["images_per_s"] / alone_job["images_per_s"],
            "people_share_of_step_time": mw["whole_run_people_share"],
            "people_share_of_row_steps": 1 - mixed_steps["job_row_steps"] / max(1, mixed_steps["row_steps"]),
            # steady state: from the job's 10% to its 90% image (no start, no last bucket draining)
            "window_job_drop": 1 - mw["images_per_s"] / aw["images_per_s"],
            "window_people_share_of_step_time": mw["people_share"],
            "window_fill_alone": aw["fill"], "window_fill_with_people": mw["fill"],
            # on CUDA, the window's GPU time by whose work it is (StepTally.gpu): the target compares the drop
            # with the people's share of the GPU, their rows' part of each replay and their own decodes
            "window_people_share_of_gpu": mw["gpu"]["people_share"] if mw["gpu"] else None,
            "window_gpu_alone": aw["gpu"], "window_gpu_with_people": mw["gpu"],
            # how the job's finished rows gathered into decodes, alone and with people (any device)
            "window_decodes_alone": aw["decodes"], "window_decodes_with_people": mw["decodes"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["cost", "mixed"])
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="512x512")
    p.add_argument("--compile", action="store_true", help="the compile tier (Inductor kernels in the step graphs)")
    a = p.parse_args()
    ITEM["size"] = a.size
    config = ServerConfig(model=a.model, device=a.device)
    engine = Engine(a.model, device=a.device, max_queue=max(256, a.n + 64), compile=a.compile)
    client = AsyncEngine(engine)
    t0 = time.perf_counter()
    out = asyncio.run(cost(client, a.n, config) if a.what == "cost" else mixed(client, a.n, a.rate, config))
    out["wall_s"] = time.perf_counter() - t0
    out["compile"] = a.compile
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
