"""Probe: does closing an engine give its device memory back? (issue 29: a --model-dir eviction freed nothing)

Builds `random:sd15` engines in several ways and, after each is closed and collected, reports how much of what its
build allocated (torch.cuda.memory_allocated) and reserved is still there:

    eager      an engine without graphs (one generate), closed
    graph      an engine with its bucketed graphs (GraphConfig buckets 1, 2), closed
    unet       a plain diffusers UNet moved to the device, one forward, deleted
    unet_graph the same UNet with one CUDA graph of its forward captured, both deleted
    unet_sdpa  the UNet's forward under each SDPA backend (math, flash, efficient, cudnn), deleted
    thread     a graph engine built on another thread, closed on this one
    loop       a graph engine sharing its DeviceLoop with a second engine that stays, closed
    set        a ModelSet of two graph engines, the second evicted (what --model-dir does)

    python3 tools/probe_release.py      # on the GPU host
"""

from __future__ import annotations

import gc
import json
import sys
import os
import weakref

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph import Engine, GraphConfig  # noqa: E402
from diffgraph.models.loader import preset_modules  # noqa: E402
from diffgraph.models import presets as P  # noqa: E402

GiB = 2**30


def settle() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def measure(name: str, build) -> dict:
    a0, r0 = settle()
    ref = build()
    a1, r1 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    alive = ref()
    del ref
    a2, r2 = settle()
    row = {"case": name, "built_allocated_gib": (a1 - a0) / GiB, "built_reserved_gib": (r1 - r0) / GiB,
           "left_allocated_gib": (a2 - a0) / GiB, "left_reserved_gib": (r2 - r0) / GiB, "collected": alive}
    print(json.dumps(row), flush=True)
    return row


def engine(graphs: bool):
    def build():
        e = Engine("random:sd15", device="cuda", mode="graph" if graphs else "eager",
                   graphs=GraphConfig(batch_buckets=(1, 2)) if graphs else None)
        e.generate("a cat", num_inference_steps=2, seed=0)
        unet = weakref.ref(e.model.denoiser)
        e.close()
        del e
        return lambda: (gc.collect(), unet() is None)[1]
    return build


def unet(capture: bool, backends=None):
    def build():
        m, _, _ = preset_modules(P.RANDOM_PRESETS["random:sd15"], "cuda")
        m = m.half().eval().requires_grad_(False)
        x = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.half)
        t = torch.tensor([10.0, 10.0], device="cuda")
        c = torch.randn(2, 77, 768, device="cuda", dtype=torch.half)
        with torch.inference_mode():
            for backend in backends or [None]:
                if backend is None:
                    m(x, t, c)
                else:
                    from torch.nn.attention import sdpa_kernel
                    with sdpa_kernel(backend):
                        m(x, t, c)
            g = None
            if capture:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    m(x, t, c)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    m(x, t, c)
                g.replay()
        torch.cuda.synchronize()
        ref = weakref.ref(m)
        del m, g, x, c, t
        return lambda: (gc.collect(), ref() is None)[1]
    return build


def _graph_engine(**kw) -> Engine:
    e = Engine("random:sd15", device="cuda", graphs=GraphConfig(batch_buckets=(1, 2)), **kw)
    e.generate("a cat", num_inference_steps=2, seed=0)
    return e


def on_thread():
    def build():
        import threading
        box = []
        t = threading.Thread(target=lambda: box.append(_graph_engine()))
        t.start()
        t.join()
        unet = weakref.ref(box[0].model.denoiser)
        box.pop().close()
        return lambda: (gc.collect(), unet() is None)[1]
    return build


def shared_loop(stay: list):
    def build():
        from diffgraph.engine.device_loop import DeviceLoop
        loop = DeviceLoop()
        stay.append(_graph_engine(loop=loop, name="stays"))
        a0 = torch.cuda.memory_allocated()
        e = _graph_engine(loop=loop, name="goes")
        print("loop: the second engine allocated", (torch.cuda.memory_allocated() - a0) / GiB, "GiB")
        unet = weakref.ref(e.model.denoiser)
        e.close()
        del e
        return lambda: (gc.collect(), unet() is None)[1]
    return build


def loop_variant(stay: list, on_thread: bool, wrapped: bool, close_elsewhere: bool):
    """`shared_loop` with one of the model set's differences: the engine built on a thread, wrapped in an
    AsyncEngine, closed from another thread."""
    def build():
        import threading
        from diffgraph.engine.async_engine import AsyncEngine
        from diffgraph.engine.device_loop import DeviceLoop
        loop = DeviceLoop()
        stay.append(_graph_engine(loop=loop, name="stays"))
        box = []
        make = lambda: box.append(_graph_engine(loop=loop, name="goes"))  # noqa: E731
        if on_thread:
            t = threading.Thread(target=make)
            t.start()
            t.join()
        else:
            make()
        e = box.pop()
        unet = weakref.ref(e.model.denoiser)
        target = AsyncEngine(e, name="goes") if wrapped else e
        del e
        if close_elsewhere:
            t = threading.Thread(target=target.close)
            t.start()
            t.join()
        else:
            target.close()
        del target
        return lambda: (gc.collect(), unet() is None)[1]
    return build


def model_set(stay: list):
    def build():
        import time
        from diffgraph.engine.model_set import ModelSet
        models = ModelSet(lambda name, loop: _graph_engine(loop=loop, name=name), "cuda", max_models=2)
        stay.append(models)
        models.release(models.acquire("a"))
        b = models.acquire("b")
        unet = weakref.ref(b.client.engine.model.denoiser)
        models.release(b)
        del b
        models.max_models = 1
        models.release(models.acquire("a"))
        for _ in range(600):
            if len(models.resident()) == 1 and unet() is None:
                break
            gc.collect()
            time.sleep(0.1)
        models.wait_settled(60)  # the eviction's own collection, on its thread, ends
        census()
        return lambda: (gc.collect(), unet() is None)[1]
    return build


def census() -> None:
    """How many of the engine's kinds of objects are alive (after an eviction: one model's worth is expected)."""
    gc.collect()
    names = ("Engine", "EngineCore", "ModelRunner", "GraphRunner", "DiffusionModel", "UNet2DConditionModel",
             "AutoencoderKL", "CUDAGraph", "AsyncEngine", "Resident", "StepBuffers", "Thread")
    counts = {n: 0 for n in names}
    big = 0
    for o in gc.get_objects():
        n = type(o).__name__
        if n in counts:
            counts[n] += 1
        if isinstance(o, torch.UntypedStorage) and o.is_cuda and o.nbytes() >= 8 * 2**20:
            big += 1
    print("census:", json.dumps(counts), "big cuda storages:", big, "threads:",
          [t.name for t in __import__("threading").enumerate()], flush=True)


def main() -> int:
    from torch.nn.attention import SDPBackend
    stay: list = []
    rows = [measure("set", model_set(stay))]
    for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.CUDNN_ATTENTION) if "--sdpa" in sys.argv else ():
        try:
            rows.append(measure(f"unet_sdpa_{b.name.lower()}", unet(False, [b])))
        except RuntimeError as e:
            print(f"{b.name}: {str(e).splitlines()[0]}")
    print(f"{'case':24s} {'built GiB':>10s} {'left GiB':>10s} {'left reserved':>14s}")
    for r in rows:
        print(f"{r['case']:24s} {r['built_allocated_gib']:10.3f} {r['left_allocated_gib']:10.3f} "
              f"{r['left_reserved_gib']:14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
