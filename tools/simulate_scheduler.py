"""Replays a throughput trace through the real Scheduler on a virtual clock (no GPU).

Each engine iteration costs the measured step time of its (resolution, bucket), plus a decode cost per
finished image (SD1.5 VAE on the H200: 21 ms for one image, 15 ms per image for four). Use it to compare batching modes and cross-group policies before spending GPU time;
the numbers are a model, not a benchmark (BENCHMARKS.md holds the measured ones). Default step times:
`random:sd15` on the H200 at 512x512 (buckets 1, 4 and 16 measured, 2 and 8 interpolated); 512x768 scaled
by the measured bucket-16 ratio (148.6 / 94.2).

    PYTHONPATH=src python tools/simulate_scheduler.py --rates 2.0,2.5,3.16 --duration 60 [--grow-fill 0]
"""

from __future__ import annotations

import argparse

import numpy as np

from diffgraph.bench.throughput import make_trace
from diffgraph.config import parse_resolutions
from diffgraph.engine.scheduler import RequestState, Scheduler, SchedulerConfig
from diffgraph.sampling.samplers import make_plan
from diffgraph.sampling.schedules import NoiseSchedule

NOISE = NoiseSchedule.from_config({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
                                   "timestep_spacing": "leading", "steps_offset": 1})
STEP_MS_512 = {1: 11.95, 2: 17.0, 4: 27.4, 8: 50.0, 16: 94.2}
SIZE_SCALE = {(512, 512): 1.0, (768, 512): 148.6 / 94.2}


def simulate(rate: float, duration: float, mode: str, max_wait_ms: float = 20.0, decode_ms: float = 18.0,
             seed: int = 0, grow_fill: float = 0.85, grow_hold_ms: float = 2000.0) -> dict[str, float]:
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(batching=mode, max_rows=16, max_queue=10**6, buckets=tuple(STEP_MS_512),
                                      grow_fill=grow_fill, grow_hold_ms=grow_hold_ms,
                                      max_wait_ms=max_wait_ms if mode == "request" else 0.0), clock=lambda: clock[0])
    trace = make_trace(rate, duration, seed, (20, 30, 50), parse_resolutions("512x512,512x768"), ("euler", "dpmpp_2m"))
    plans: dict = {}
    arrivals, latencies, i = {}, [], 0
    while len(latencies) < len(trace):
        while i < len(trace) and trace[i].at <= clock[0]:
            t = trace[i]
            key = (t.steps, t.sampler)
            plans.setdefault(key, make_plan(NOISE, t.sampler, "default", t.steps))
            sched.add(RequestState(f"r{i}", t.size, 1, plans[key], t.at))
            arrivals[f"r{i}"] = t.at
            i += 1
        plan = sched.schedule()
        if plan is None:
            nxt = trace[i].at if i < len(trace) else clock[0] + 1e-3
            wait = sched.next_deadline()
            clock[0] = nxt if wait is None else min(nxt, clock[0] + max(wait, 1e-4))
            continue
        bucket = next(b for b in sorted(STEP_MS_512) if b >= plan.n_rows)
        clock[0] += STEP_MS_512[bucket] * SIZE_SCALE.get(plan.key, 1.0) / 1e3
        finished = sched.update(plan)
        clock[0] += decode_ms * len(finished) / 1e3
        latencies += [clock[0] - arrivals[s.request_id] for s in finished]
    lat = np.array(latencies) * 1e3
    return {"images_per_s": len(trace) / clock[0], "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.8,1.5,2.5,3.16")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--max-wait-ms", type=float, default=20.0)
    p.add_argument("--grow-fill", type=float, default=0.85, help="step mode's bucket growth policy; 0 turns it off")
    p.add_argument("--grow-hold-ms", type=float, default=2000.0)
    args = p.parse_args()
    for rate in (float(r) for r in args.rates.split(",")):
        for mode in ("step", "request", "off"):
            r = simulate(rate, args.duration, mode, args.max_wait_ms, grow_fill=args.grow_fill,
                         grow_hold_ms=args.grow_hold_ms)
            print(f"rate {rate:5.2f}/s {mode:8s} {r['images_per_s']:5.2f} img/s  p50 {r['p50_ms']:7.0f} ms  "
                  f"p99 {r['p99_ms']:7.0f} ms")


if __name__ == "__main__":
    main()
