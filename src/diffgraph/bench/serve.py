"""`diffgraph bench serve`: open-loop Poisson load against a running server, over HTTP.

    diffgraph bench serve --url http://127.0.0.1:8000 --rate 4 --duration 30 --mix 512x512/20:3,768x512/50:1

Requests arrive at exponential intervals (seeded) whether or not earlier ones have finished, so a
server slower than the rate builds a queue instead of slowing the client down. Each request draws its
size and step count from the mix. Reported as JSON: throughput (requests and images per second over the
whole run, drain included), p50/p90/p99 latency of the successful requests, and errors by HTTP status
(or by exception name when no answer came).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class MixItem:
    size: str | None   # "WxH"; None: the server's native size
    steps: int
    weight: float


def parse_mix(text: str) -> list[MixItem]:
    """'512x512/20:3,768x512/50' -> items; a size may be left out ('20:3' = native size, 20 steps, weight 3)."""
    items = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        spec, _, weight = part.partition(":")
        size, _, steps = spec.rpartition("/")
        try:
            item = MixItem(size or None, int(steps), float(weight) if weight else 1.0)
        except ValueError:
            raise ValueError(f"mix item {part!r} must look like [WxH/]STEPS[:WEIGHT], e.g. 512x512/20:3") from None
        if item.steps < 1 or item.weight <= 0:
            raise ValueError(f"mix item {part!r}: steps must be >= 1 and weight > 0")
        items.append(item)
    if not items:
        raise ValueError("the mix is empty; e.g. --mix 512x512/20:3,768x512/50:1")
    return items


def make_schedule(rate: float, duration: float, mix: list[MixItem], seed: int) -> list[tuple[float, MixItem, int]]:
    """(send time, mix item, request seed) for Poisson arrivals at `rate` per second over `duration` seconds."""
    rng = np.random.default_rng(seed)
    p = np.array([m.weight for m in mix]) / sum(m.weight for m in mix)
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            return out
        out.append((t, mix[int(rng.choice(len(mix), p=p))], int(rng.integers(2**31))))


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


async def run_load(url: str, rate: float, duration: float, mix: list[MixItem], *, prompt: str = "a photo of a cat",
                   n: int = 1, sampler: str = "euler", model: str | None = None, timeout: float = 600.0,
                   seed: int = 0) -> dict[str, Any]:
    import httpx

    schedule = make_schedule(rate, duration, mix, seed)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    images = 0

    async def one(client: "httpx.AsyncClient", item: MixItem, req_seed: int) -> None:
        nonlocal images
        body: dict[str, Any] = {"prompt": prompt, "n": n, "num_inference_steps": item.steps, "sampler": sampler,
                                "seed": req_seed, "response_format": "b64_json"}
        if item.size:
            body["size"] = item.size
        if model:
            body["model"] = model
        sent = time.perf_counter()
        try:
            r = await client.post("/v1/images/generations", json=body)
        except httpx.HTTPError as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            return
        if r.status_code == 200:
            latencies.append(time.perf_counter() - sent)
            images += len(r.json()["data"])
        else:
            errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # open loop: never queue client-side
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for at, item, req_seed in schedule:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, item, req_seed)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return {"url": url, "rate": rate, "duration_s": duration, "mix": [m.__dict__ for m in mix], "n": n,
            "sent": len(schedule), "ok": len(latencies), "errors": dict(sorted(errors.items())),
            "elapsed_s": elapsed, "requests_per_s": len(latencies) / elapsed if elapsed else 0.0,
            "images_per_s": images / elapsed if elapsed else 0.0, "latency_s": _percentiles(latencies)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffgraph bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--rate", required=True,
                   help="mean arrival rate, requests per second; a comma list runs each rate in turn (a sweep)")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals (the run then drains)")
    p.add_argument("--mix", default="20", help="comma list of [WxH/]STEPS[:WEIGHT]; without a size the server's "
                                              "native size (default: %(default)s)")
    p.add_argument("-n", type=int, default=1, help="images per request (default: 1)")
    p.add_argument("--sampler", default="euler", help="sampler of every request (default: euler)")
    p.add_argument("--prompt", default="a photo of a cat")
    p.add_argument("--model", default=None, help="model field of the requests (default: none, the served one)")
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, s (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival trace (default: 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw latency percentiles and images/s against the rate (matplotlib)")
    args = p.parse_args(argv)
    try:
        mix = parse_mix(args.mix)
        try:
            rates = [float(r) for r in args.rate.split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--rate {args.rate!r} must be a number or a comma list of numbers") from None
        if not rates or min(rates) <= 0 or args.duration <= 0:
            raise ValueError("--rate and --duration must be > 0")
        if args.plot:
            from .plots import plot_runs  # noqa: F401  (fail before the load runs when matplotlib is missing)
            import matplotlib  # noqa: F401
    except (ValueError, ImportError) as e:
        print(f"diffgraph: error: {e}" + ("; pip install 'diffgraph[plot]'" if isinstance(e, ImportError) else ""),
              file=sys.stderr)
        return 2
    runs = [asyncio.run(run_load(args.url, rate, args.duration, mix, prompt=args.prompt, n=args.n,
                                 sampler=args.sampler, model=args.model, timeout=args.timeout, seed=args.seed))
            for rate in rates]
    report = runs[0] if len(runs) == 1 else {"runs": runs}
    if args.plot:
        from .plots import plot_runs
        plot_runs(runs, args.plot, f"bench serve: {args.url}, mix {args.mix}")
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
