"""Scale-out figures of one `diffgraph serve` configuration over fixed seeded traces (issue 14's targets).

    python3 tools/bench_dp.py --label 1gpu --sat-rate 10 --json out/dp_1.json                      # one GPU, default
    python3 tools/bench_dp.py --label 2gpu --sat-rate 20 --json out/dp_2.json -- --data-parallel 2  # two replicas

Starts the server (the flags after `--`), waits until every replica is ready, then runs `bench serve`'s open-loop
load (512x512, 20 steps, Euler): one saturation trace (`--sat-rate` for `--duration` s, seed 0; the throughput
counts the drain), then `--repeats` runs of one trace at 80% of the measured capacity (seed 1, the same trace each
time: the spread between them is the run-to-run spread). Last, each replica's mean step time per batch bucket
from /metrics. Prints one JSON report (and writes it to --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.bench.serve import parse_mix, run_load  # noqa: E402
from diffgraph.server.process import ServerProcess  # noqa: E402


def step_figures(metrics_text: str) -> dict[str, dict[str, dict[str, float]]]:
    """replica -> bucket -> {"steps", "mean_ms"} from the per-replica bucket counters of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    steps: dict[tuple[str, str], float] = {}
    seconds: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = (s.labels.get("replica", ""), s.labels.get("bucket", ""))
            if s.name == "diffgraph_replica_bucket_steps_total":
                steps[key] = s.value
            elif s.name == "diffgraph_replica_bucket_step_seconds_total":
                seconds[key] = s.value
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (replica, bucket), n in sorted(steps.items()):
        if n:
            out.setdefault(replica, {})[bucket] = {"steps": n, "mean_ms": 1000 * seconds.get((replica, bucket), 0) / n}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True)
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mix", default="512x512/20")
    p.add_argument("--sat-rate", type=float, required=True, help="requests/s of the saturation trace")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--in-process", action="store_true",
                   help="the engine in the server's process (tools/serve_in_process.py), not a replica process")
    p.add_argument("flags", nargs="*", help="diffgraph serve flags (after --)")
    a = p.parse_args()
    mix = parse_mix(a.mix)
    report: dict = {"label": a.label, "flags": a.flags, "duration_s": a.duration}
    t0 = time.perf_counter()
    entry = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_in_process.py"),) if a.in_process \
        else ("-m", "diffgraph.server.cli")
    report["in_process"] = a.in_process
    with ServerProcess("--no-access-log", "--max-queue", "100000", *a.flags, model=a.model, device=a.device,
                       log_level="warning", entry=entry) as server:
        import httpx
        while not all(r["state"] == "ready" for r in httpx.get(server.url + "/ready", timeout=10).json()["replicas"]):
            time.sleep(0.5)
        report["ready_s"] = time.perf_counter() - t0
        sat = asyncio.run(run_load(server.url, a.sat_rate, a.duration, mix, seed=0))
        report["saturation"] = sat
        rate80 = round(0.8 * sat["requests_per_s"], 3)
        report["at_80"] = [asyncio.run(run_load(server.url, rate80, a.duration, mix, seed=1))
                           for _ in range(a.repeats)]
        report["steps"] = step_figures(httpx.get(server.url + "/metrics", timeout=30).text)
    p99 = [r["latency_s"]["p99"] for r in report["at_80"]]
    report["summary"] = {"label": a.label, "saturated_images_per_s": sat["images_per_s"],
                         "sat_ok": f"{sat['ok']}/{sat['sent']}", "rate_80": rate80,
                         "p99_80_s": p99, "p50_80_s": [r["latency_s"]["p50"] for r in report["at_80"]],
                         "errors": [sat["errors"], *[r["errors"] for r in report["at_80"]]]}
    text = json.dumps(report, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(json.dumps(report["summary"]))
    for replica, buckets in report["steps"].items():
        print(replica, {b: (int(v["steps"]), round(v["mean_ms"], 2)) for b, v in buckets.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
