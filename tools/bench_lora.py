"""LoRA benchmark figures on the GPU host (issue 12), each case in one process:

    python3 tools/bench_lora.py step     # random:sd15 512x512, a full bucket-16 step (graph replay): adapter-free
                                         # in an engine without slots, adapter-free and with 4 different rank-16
                                         # adapters (one per row) in engines with slots of max rank 16 and 64
    python3 tools/bench_lora.py load     # random:sdxl 1024x1024: loading a rank-32 adapter file from local disk
                                         # into a slot while other requests keep stepping; step p99 during the load

Adapters are random (made here: a rank-32 SDXL file is larger than what can be carried to the host).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diffgraph import Engine, GraphConfig  # noqa: E402
from diffgraph.bench.throughput import random_adapter  # noqa: E402
from probe_layout import eager_ms  # noqa: E402  (the probes' event timer)


def replay_ms(engine: Engine, kind: str, key: tuple[int, int], bucket: int, iters: int = 30) -> float:
    runner = engine.runner.graph_runner
    return eager_ms(lambda: runner.replay(kind, *key, bucket), iters=iters)


def fill_rows(engine: Engine, key: tuple[int, int], rows: int, adapters: list[str]) -> None:
    """Loads the adapters into slots 1..k and gives row i adapter i % k (scale 1), with plausible latents."""
    manager = engine.runner.loras
    buf = engine.runner.buffers(key)
    for slot, name in enumerate(adapters, start=1):
        manager.write(slot, manager.resolve(((name, 1.0),))[0].prepared)
    buf.x[:rows] = torch.randn_like(buf.x[:rows]) * 10
    buf.coefs[:rows] = 0.1
    buf.guidance[:rows] = 7.5
    buf.lora_idx[:rows] = 0
    buf.lora_idx[:rows, 0] = torch.arange(rows, device=buf.x.device) % len(adapters) + 1
    buf.lora_scale[:rows, 0] = 1.0


def step_case() -> None:
    key, bucket = (512, 512), 16
    cfg = GraphConfig(batch_buckets=(bucket,), resolutions=(key,))
    rows = []
    with Engine("random:sd15", device="cuda", dtype="fp16", mode="graph", graphs=cfg) as plain:
        plain.runner.buffers(key).x.normal_()
        base = replay_ms(plain, "step", key, bucket)
    rows.append(("engine without adapter slots, step", base))
    for rank in (16, 64):
        with Engine("random:sd15", device="cuda", dtype="fp16", mode="graph", graphs=cfg, max_loras=8,
                    max_lora_rank=rank) as engine:
            names = [f"r{i}" for i in range(4)]
            for i, name in enumerate(names):
                engine.add_lora(name, random_adapter(engine, 16, i))
            fill_rows(engine, key, bucket, names)
            free = replay_ms(engine, "step", key, bucket)
            adapted = replay_ms(engine, "step_lora1", key, bucket)
            stacked = replay_ms(engine, "step_lora4", key, bucket)
            rows += [(f"max rank {rank}: adapter-free step (variant without side paths)", free),
                     (f"max rank {rank}: 4 different rank-16 adapters, one per row", adapted),
                     (f"max rank {rank}: the same rows in the 4-stack variant", stacked)]
    print(f"random:sd15 512x512, bucket {bucket} (CFG batch {2 * bucket}), fp16, one step replayed (ms, x of the "
          "engine without slots):")
    for name, ms in rows:
        print(f"  {name:70s} {ms:8.2f} ms  {ms / base:.3f}x")


def write_adapter(engine: Engine, rank: int, path: str) -> int:
    from safetensors.torch import save_file

    state = {k: v.half() for k, v in random_adapter(engine, rank, 0).items()}
    save_file(state, path)
    return os.path.getsize(path)


def quiet_breakdown(manager, path: str) -> dict[str, float]:
    """The parts of reading and checking an adapter, timed one by one while the engine is idle (ms)."""
    from diffgraph.lora.files import read_adapter
    from diffgraph.lora.manager import _finite

    out = {}
    t0 = time.perf_counter()
    adapter = read_adapter(path, manager.pipeline_class, "probe")
    out["read (safetensors + diffusers' lora_state_dict + layers)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = manager._pad(adapter)
    out["check against the model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = {c: manager.banks[c].host_row(w, pin=True) for c, w in weights.items()}
    out["host rows (pinned)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert all(_finite(r) for r in rows.values())
    out["finite check"] = time.perf_counter() - t0
    return {k: v * 1e3 for k, v in out.items()}


def load_case() -> None:
    key = (1024, 1024)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=(key,))
    folder = tempfile.mkdtemp(prefix="loras-")
    with Engine("random:sdxl", device="cuda", dtype="fp16", mode="graph", graphs=cfg, lora_dir=folder,
                max_loras=4, max_lora_rank=32) as engine:
        size = write_adapter(engine, 32, os.path.join(folder, "big.safetensors"))
        manager = engine.runner.loras
        writes: list[tuple[float, object, object]] = []  # (host seconds to issue, GPU start and end events)
        original = manager.write

        def timed_write(slot, prepared):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            original(slot, prepared)
            end.record()
            writes.append((time.perf_counter() - t0, start, end))
        manager.write = timed_write
        steps: list[tuple[float, float]] = []
        engine.step_listeners.append(lambda plan, seconds: steps.append((time.perf_counter(), seconds)))
        engine.generate("warm", num_inference_steps=2)
        stop = threading.Event()

        def traffic() -> None:  # keeps 3 requests stepping
            futures = []
            while not stop.is_set():
                futures = [f for f in futures if not f.done()]
                while len(futures) < 3:
                    futures.append(engine.submit(engine.make_request("a fox", num_inference_steps=30)))
                time.sleep(0.01)
            for f in futures:
                f.result()
        thread = threading.Thread(target=traffic)
        thread.start()
        time.sleep(8.0)
        t_submit = time.perf_counter()
        future = engine.submit(engine.make_request("a fox", num_inference_steps=30, loras=[("big", 1.0)]))
        t_resolved = time.perf_counter()  # submit read and checked the file on this thread
        time.sleep(4.0)
        stop.set()
        future.result()
        thread.join()
        parts = quiet_breakdown(manager, os.path.join(folder, "big.safetensors"))  # after: it warms caches
    before = [s for t, s in steps if t < t_submit and t > t_submit - 6.0]
    during = [s for t, s in steps if t_submit <= t <= t_resolved + 2.0]
    p99 = lambda xs: float(np.percentile(xs, 99)) * 1e3  # noqa: E731
    print(f"random:sdxl 1024x1024: a rank-32 adapter file of {size / 1e6:.1f} MB from local disk")
    print("  where a read goes, read again with the engine idle (ms): " +
          ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
    torch.cuda.synchronize()
    host = max(w[0] for w in writes) * 1e3
    gpu = max(w[1].elapsed_time(w[2]) for w in writes)
    print(f"  read and checked (submit thread): {(t_resolved - t_submit) * 1e3:.0f} ms; written into its slot "
          f"(loop thread, between steps): {host:.1f} ms to issue the copies, {gpu:.1f} ms of copies on the GPU; "
          f"together {(t_resolved - t_submit) * 1e3 + max(host, gpu):.0f} ms (target <= 500)")
    print(f"  step p99 while loading {p99(during):.1f} ms ({len(during)} steps) vs before {p99(before):.1f} ms "
          f"({len(before)} steps): {p99(during) / p99(before):.3f}x (target <= 1.2)")


if __name__ == "__main__":
    {"step": step_case, "load": load_case}[sys.argv[1]]()
