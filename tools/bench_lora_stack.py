"""What the 5th-8th LoRA adapter of a request costs, on the CPU (`random:tiny`, fp32, eager):

    python3 tools/bench_lora_stack.py [--steps 30] [--repeats 5] [--rank 4]

One engine with 8 slots and the default --max-request-loras 8 (side-path depths 0, 1, 4, 8); one request at a time
of `steps` steps with 0, 4 or 8 random adapters (random_adapter: every UNet layer with a side path), and the same
4-adapter request on an engine with --max-request-loras 4 (today's depths 0, 1, 4). Prints the median steps/s of
`repeats` runs of each case, the cases interleaved so that a slow moment of a shared machine falls on all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph import Engine  # noqa: E402
from diffgraph.bench.throughput import random_adapter  # noqa: E402


def steps_per_s(engine: Engine, loras: list[tuple[str, float]], steps: int) -> float:
    request = engine.make_request("a red fox", num_inference_steps=steps, seed=1, loras=loras)
    t0 = time.perf_counter()
    engine.run(request)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rank", type=int, default=4)
    args = p.parse_args()
    engines = {limit: Engine("random:tiny", device="cpu", dtype="fp32", max_loras=8, max_lora_rank=args.rank,
                             max_request_loras=limit) for limit in (8, 4)}
    for engine in engines.values():
        for i in range(8):
            engine.add_lora(f"a{i}", random_adapter(engine, args.rank, i))
    adapters = [(f"a{i}", 0.5) for i in range(8)]
    cases = {"0 adapters": (engines[8], []), "4 adapters, limit 4": (engines[4], adapters[:4]),
             "4 adapters, limit 8": (engines[8], adapters[:4]), "8 adapters, limit 8": (engines[8], adapters)}
    for engine, loras in cases.values():  # warm: slot loads, prompt encodes
        steps_per_s(engine, loras, 2)
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, (engine, loras) in cases.items():
            runs[name].append(steps_per_s(engine, loras, args.steps))
    for name, values in runs.items():
        print(f"{name:22s} {statistics.median(values):7.2f} steps/s (runs: {', '.join(f'{v:.2f}' for v in values)})")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
