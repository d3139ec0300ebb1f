"""N engine replicas on a virtual clock: the real router (engine/router.py's choice) in front of the real scheduler
of each replica, with step and decode times measured on the H200 (tools/simulate_scheduler.py's tables).

Each replica is one GPU: its own Scheduler, stepping back to back whenever it has work; a request goes, at its
arrival, to the replica the router picks (least outstanding row-steps, resolution-group affinity), and the router's
outstanding work follows each request's steps as the real progress events would. The router's own cost is timed for
real (the `choose` call per request, in microseconds). A model, not a benchmark: check it first against the 1- and
2-GPU measurements (BENCHMARKS.md, `gpu_check.sh dp`), then read what it predicts for more GPUs.

    PYTHONPATH=src python tools/simulate_replicas.py --replicas 1,2,8,64 --rate-per-replica 10 --duration 15
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np

from diffgraph.bench.throughput import make_trace
from diffgraph.config import parse_resolutions
from diffgraph.engine.router import Router
from diffgraph.engine.scheduler import RequestState, Scheduler, SchedulerConfig
from diffgraph.request import GenerationRequest, ProgressEvent
from diffgraph.sampling.samplers import make_plan

from simulate_scheduler import NOISE, SIZE_SCALE, STEP_MS_512


class _Replica:
    """What the router sees of a replica (name, ready), plus the simulated GPU: a scheduler and a clock."""

    def __init__(self, i: int):
        self.name, self.ready, self.state, self.info, self.error = f"gpu{i}", True, "ready", None, None
        self.clock = 0.0
        self.scheduler = Scheduler(SchedulerConfig(max_rows=16, max_queue=10**6, buckets=tuple(STEP_MS_512)),
                                   clock=lambda: self.clock)


def simulate(replicas: int, rate: float, duration: float, steps=(20,), sizes=((512, 512),), decode_ms: float = 16.2,
             seed: int = 0) -> dict[str, float]:
    sims = [_Replica(i) for i in range(replicas)]
    router = Router(sims)
    trace = make_trace(rate, duration, seed, steps, sizes, ("euler",))
    plans = {s: make_plan(NOISE, "euler", "default", s) for s in steps}
    arrivals: dict[str, float] = {}
    latencies: list[float] = []
    choose_us: list[float] = []
    pending = [(t.at, i) for i, t in enumerate(trace)]  # arrivals, in order
    heapq.heapify(pending)
    while pending or any(r.scheduler.has_work() for r in sims):
        # the next event: an arrival, or the replica that can start its next step the earliest
        busy = [r for r in sims if r.scheduler.has_work()]
        next_step = min(busy, key=lambda r: r.clock) if busy else None
        if pending and (next_step is None or pending[0][0] <= next_step.clock):
            at, i = heapq.heappop(pending)
            item = trace[i]
            request = GenerationRequest(prompt="x", negative_prompt=None, width=item.size[1], height=item.size[0],
                                        num_inference_steps=item.steps, guidance_scale=7.5, sampler="euler",
                                        schedule="default", seed=0, num_images=1, request_id=f"r{i}")
            t0 = time.perf_counter()
            replica = router.choose(request)
            choose_us.append((time.perf_counter() - t0) * 1e6)
            router.track(request, replica)
            replica.clock = max(replica.clock, at)
            replica.scheduler.add(RequestState.of(request, plans[item.steps], at))
            arrivals[request.request_id] = at
            continue
        r = next_step
        plan = r.scheduler.schedule()
        if plan is None:  # nothing admissible yet: idle until the next arrival
            r.clock = pending[0][0] if pending else r.clock + 1e-3
            continue
        bucket = next(b for b in sorted(STEP_MS_512) if b >= plan.n_rows)
        r.clock += STEP_MS_512[bucket] * SIZE_SCALE.get(plan.key, 1.0) / 1e3
        finished = r.scheduler.update(plan)
        for s in plan.live:
            router._progress(s.request_id, ProgressEvent(s.request_id, s.step, s.steps))
        r.clock += decode_ms * len(finished) / 1e3
        for s in finished:
            router._done(s.request_id)
            latencies.append(r.clock - arrivals[s.request_id])
    end = max(r.clock for r in sims)
    lat = np.array(latencies)
    return {"replicas": replicas, "rate": rate, "requests": len(trace), "images_per_s": len(trace) / end,
            "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
            "router_us_mean": float(np.mean(choose_us)), "router_us_p99": float(np.percentile(choose_us, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2,8,64")
    p.add_argument("--rate-per-replica", type=float, default=10.0, help="arrivals per second per replica")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--steps", default="20")
    p.add_argument("--sizes", default="512x512")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    steps = tuple(int(s) for s in args.steps.split(","))
    sizes = parse_resolutions(args.sizes)
    print("| replicas | rate /s | requests | images/s | per replica | p50 s | p99 s | router us/request (mean, p99) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(v) for v in args.replicas.split(",")):
        r = simulate(n, args.rate_per_replica * n, args.duration, steps, sizes, seed=args.seed)
        print(f"| {n} | {r['rate']:g} | {r['requests']} | {r['images_per_s']:.2f} | {r['images_per_s'] / n:.2f} | "
              f"{r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['router_us_mean']:.1f}, {r['router_us_p99']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
