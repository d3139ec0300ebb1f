"""Two resident models on one device loop against one model alone (issue 29's targets): request latency when
requests alternate between two resident models (p50 within 3% of one model alone), and the memory a ModelSet
accounts per model against torch's allocator.

    python tools/bench_models.py --preset random:sd15 --requests 40 --steps 20   # on the GPU host

Builds a ModelSet (engine/model_set.py) whose two models are the same preset under two names ("a", "b": separate
engines, weights and graphs), then times one-image requests one after another: "a" alone (N), then "a", "b"
alternating (N), then "a" alone again; each request's end-to-end time from submit to its result. Memory: each model's
accounted bytes (the allocator's reserved bytes its build added) beside torch.cuda.memory_reserved and
memory_allocated before and after, and after one model is evicted.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import weakref

import torch

from diffgraph import Engine, GraphConfig
from diffgraph.engine.model_set import ModelSet


def _traced_blocks(min_bytes: int = 8 * 2**20) -> list[str]:
    """The allocated blocks of at least `min_bytes` whose allocation was recorded, grouped by their innermost frames
    in diffgraph / diffusers / torch.nn (bytes, count, frames), largest first."""
    groups: dict[str, list[int]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            frames = block.get("frames") or []
            if block["state"] != "active_allocated" or block["size"] < min_bytes or not frames:
                continue
            own = [f"{f['filename'].split('site-packages/')[-1].split('/src/')[-1]}:{f['line']}:{f['name']}"
                   for f in frames if any(k in f["filename"] for k in ("diffgraph", "diffusers", "torch/nn"))][:4]
            key = f"pool={seg.get('segment_pool_id')} " + " < ".join(own)
            g = groups.setdefault(key, [0, 0])
            g[0] += block["size"]
            g[1] += 1
    return [f"{b / 2**20:.0f} MiB in {n}: {k}" for k, (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])]


def _holders(obj, depth: int = 3) -> list[str]:
    """What still refers to `obj` (None: nothing to say), a few levels up: why an evicted model's memory stays."""
    if obj is None:
        return []
    out, frontier, seen = [], [obj], {id(obj)}
    for level in range(depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if id(r) in seen or r is frontier or type(r).__name__ == "frame":
                    continue
                seen.add(id(r))
                keys = [k for k, v in r.items() if v is o][:3] if isinstance(r, dict) else ""
                out.append(f"{level}:{type(r).__module__}.{type(r).__qualname__}{keys}")
                nxt.append(r)
        frontier = nxt[:20]
    return out[:40]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--trace-eviction", action="store_true",
                   help="record where the second model's device memory comes from (slows it: not for the timings) "
                        "and list the blocks still allocated after its eviction")
    args = p.parse_args()
    size = args.size or (1024 if "xl" in args.preset else 512)
    cuda = args.device.startswith("cuda")
    reserved = torch.cuda.memory_reserved if cuda else (lambda: 0)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def build(name: str, loop):
        engine = Engine(args.preset, device=args.device, loop=loop, name=name, compile=args.compile,
                        graphs=GraphConfig(batch_buckets=(1, 2)) if cuda else None)
        engine.generate("warm-up", num_inference_steps=2, seed=0)
        return engine

    sync()
    base_reserved, base_allocated = reserved(), allocated()
    models = ModelSet(build, args.device, max_models=2)
    held = {"a": models.acquire("a")}
    if args.trace_eviction:  # where b's device memory was allocated, to say what an eviction leaves behind
        torch.cuda.memory._record_memory_history(max_entries=200000)
    held["b"] = models.acquire("b")
    sync()
    memory = {"accounted": {n: r.memory_bytes for n, r in held.items()},
              "reserved_delta": reserved() - base_reserved,
              "allocated_delta": allocated() - base_allocated}
    memory["accounted_sum"] = sum(memory["accounted"].values())
    memory["ratio_to_reserved"] = memory["accounted_sum"] / max(1, memory["reserved_delta"])

    def one(name: str, i: int) -> float:
        engine = held[name].client.engine
        t0 = time.perf_counter()
        engine.generate("a photo of a cat", seed=i, num_inference_steps=args.steps, width=size, height=size)
        return (time.perf_counter() - t0) * 1e3

    for i in range(3):  # warm both
        one("a", i), one("b", i)
    alone1 = [one("a", i) for i in range(args.requests)]
    mixed = [one("a" if i % 2 == 0 else "b", i) for i in range(args.requests)]
    alone2 = [one("a", i) for i in range(args.requests)]
    alone = alone1 + alone2
    row = {"preset": args.preset, "steps": args.steps, "requests": args.requests, "compile": args.compile,
           "alone_p50_ms": statistics.median(alone), "alternating_p50_ms": statistics.median(mixed),
           "alone_first_p50": statistics.median(alone1), "alone_second_p50": statistics.median(alone2),
           "memory": memory}
    row["ratio"] = row["alternating_p50_ms"] / row["alone_p50_ms"]
    for name in held:
        models.release(held[name])
    b_engine = weakref.ref(held["b"].client.engine)  # evicted below: measured once it is gone
    b_unet = weakref.ref(held["b"].client.engine.model.denoiser)
    b_set = held["b"].client.engine.runner.graphs  # its graph set (None off CUDA)
    b_graph = [weakref.ref(g) for g in list(b_set.runner.graphs.values())[:1]] if b_set is not None else []
    del b_set
    b_runner = weakref.ref(held["b"].client.engine.runner)
    held.clear()  # the benchmark's own references to the engines (the set's are the only ones left)
    models.max_models = 1
    before, before_allocated = reserved(), allocated()
    models.release(models.acquire("a"))  # over the bound now: the idle "b" is evicted (on a background thread)
    deadline = time.monotonic() + 60
    while (len(models.resident()) > 1 or b_engine() is not None) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    settled = models.wait_settled(max(0.0, deadline - time.monotonic()))  # the evicting thread's collection ends
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    sync()
    row["evicted"] = {"settled": settled, "freed_reserved": before - reserved(), "freed_allocated": before_allocated - allocated(),
                      "engine_collected": b_engine() is None, "runner_collected": b_runner() is None,
                      "unet_collected": b_unet() is None, "graph_collected": all(g() is None for g in b_graph),
                      "held_by": _holders(b_unet()) + _holders(b_graph[0]() if b_graph else None),
                      "b_accounted": memory["accounted"]["b"], "resident": [r.name for r in models.resident()]}
    print(json.dumps(row, indent=1))
    print(f"{'':28s} {'p50 ms':>8s}")
    print(f"{'one model alone':28s} {row['alone_p50_ms']:8.2f}")
    print(f"{'two models, alternating':28s} {row['alternating_p50_ms']:8.2f}  ({row['ratio']:.4f}x; target <= 1.03)")
    print(f"memory accounted {memory['accounted_sum'] / 2**30:.2f} GiB vs reserved delta "
          f"{memory['reserved_delta'] / 2**30:.2f} GiB ({memory['ratio_to_reserved']:.3f}x; allocated delta "
          f"{memory['allocated_delta'] / 2**30:.2f} GiB); eviction freed {row['evicted']['freed_reserved'] / 2**30:.2f} "
          f"GiB of b's {memory['accounted']['b'] / 2**30:.2f}")
    if cuda:  # the large device tensors still alive that are not the resident model's weights, and who holds them
        survivor = models.resident()[0].client.engine.model
        own = {t.data_ptr() for m in (survivor.unet, survivor.vae, *survivor.text_encoders)
               for t in [*m.parameters(), *m.buffers()]}
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda
                 and o.numel() * o.element_size() >= 2**20 and o.data_ptr() not in own]
        row["evicted"]["alive_big_tensors"] = len(alive)
        row["evicted"]["alive_big_bytes"] = sum(t.numel() * t.element_size() for t in alive)
        row["evicted"]["alive_examples"] = [(list(t.shape), str(t.dtype), _holders(t, 2)[:6]) for t in alive[:8]]
    if args.trace_eviction:
        row["evicted"]["still_allocated"] = _traced_blocks()
        for line in row["evicted"]["still_allocated"][:12]:
            print("still allocated:", line)
    print("evicted:", json.dumps({k: v for k, v in row["evicted"].items() if k != "held_by"}))
    print("held by:", row["evicted"]["held_by"][:20])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    models.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
