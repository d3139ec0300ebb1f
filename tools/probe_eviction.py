"""Probe: which part of a ModelSet's path keeps an evicted model's CUDA weights allocated (issue 29)?

Each case runs in its own process (allocator figures are per process); all cases run at once. Every case builds two
`random:sd15` graph engines ("a", "b") on one DeviceLoop and then lets one go; it prints the allocated GiB left
beyond the one engine that stays, the Python-visible CUDA tensor bytes (every tensor gc sees, no size filter), and
the allocator's active blocks by pool.

    set          ModelSet: b evicted by the trim thread an acquire of "a" starts (what --model-dir does)
    set_wait     as set, and the trim thread waited for (30 s at most) before measuring; its stack printed if alive
    set_main     ModelSet: b evicted by calling _make_room on the main thread
    set_plain    ModelSet whose device is switched to "cpu" after the builds (no gc.collect / empty_cache /
                 memory_reserved calls in the eviction)
    set_close    ModelSet: close() (both go; left should be ~0 of both)
    set_first    ModelSet(max_models=1): a evicted before b's build, on b's loader thread
    manual       both engines built on the main thread on one DeviceLoop, wrapped in AsyncEngine, b closed
    manual_load  the same, but both built on a thread each, one after the other (as the set's loader does)

    python3 tools/probe_eviction.py            # on the GPU host: all cases, a table last
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref

GiB = 2**30
CASES = ("set", "set_wait", "set_main", "set_plain", "set_close", "set_first", "manual", "manual_load")


def run_case(case: str) -> dict:
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    from diffgraph import Engine, GraphConfig
    from diffgraph.engine.async_engine import AsyncEngine
    from diffgraph.engine.device_loop import DeviceLoop
    from diffgraph.engine.model_set import ModelSet

    def build(name, loop):
        e = Engine("random:sd15", device="cuda", graphs=GraphConfig(batch_buckets=(1, 2)), loop=loop, name=name)
        e.generate("a cat", num_inference_steps=2, seed=0)
        return e

    def settle():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    a0 = settle()
    one = None  # one engine's allocated bytes
    gone = []  # weakrefs to the unet(s) that should go
    keep = []
    if case.startswith("set"):
        models = ModelSet(build, "cuda", max_models=1 if case == "set_first" else 2)
        keep.append(models)
        ra = models.acquire("a")
        gone_a = weakref.ref(ra.client.engine.model.denoiser)
        models.release(ra)
        del ra
        one = settle() - a0
        rb = models.acquire("b")
        if case != "set_first":
            gone.append(weakref.ref(rb.client.engine.model.denoiser))
        else:
            gone.append(gone_a)
        models.release(rb)
        del rb
        built = torch.cuda.memory_allocated() - a0
        if case in ("set", "set_wait"):
            models.max_models = 1
            models.release(models.acquire("a"))
        elif case == "set_main":
            models.max_models = 1
            models._make_room(exclude="a", need_slot=False)
        elif case == "set_plain":
            models.device = torch.device("cpu")
            models.max_models = 1
            models._make_room(exclude="a", need_slot=False)
        elif case == "set_close":
            gone.append(gone_a)
            models.close()
    else:
        loop = DeviceLoop()
        box = {}
        for name in ("a", "b"):
            if case == "manual_load":
                t = threading.Thread(target=lambda n=name: box.__setitem__(n, AsyncEngine(build(n, loop), name=n)))
                t.start()
                t.join()
            else:
                box[name] = AsyncEngine(build(name, loop), name=name)
            if one is None:
                one = settle() - a0
        built = torch.cuda.memory_allocated() - a0
        keep.append(box.pop("a"))
        gone.append(weakref.ref(box["b"].engine.model.denoiser))
        box.pop("b").close()
    for _ in range(300):
        gc.collect()
        if all(g() is None for g in gone):
            break
        time.sleep(0.1)
    if case == "set_wait":
        import faulthandler
        for t in threading.enumerate():
            if "_trim" in t.name:
                t.join(30)
                if t.is_alive():
                    print("the trim thread is still alive after 30 s; every thread's stack:", flush=True)
                    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    left = settle() - a0
    seen, py_bytes = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda:
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                py_bytes += s.nbytes()
    pools: dict[str, int] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                k = f"{seg.get('segment_pool_id')}:{b['state']}"
                pools[k] = pools.get(k, 0) + b["size"]
    threads = [t.name for t in threading.enumerate()]
    return {"case": case, "one_gib": one / GiB, "built_gib": built / GiB, "left_gib": left / GiB,
            "python_cuda_gib": py_bytes / GiB, "collected": all(g() is None for g in gone),
            "pools_gib": {k: round(v / GiB, 3) for k, v in pools.items()}, "threads": threads}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print("RESULT " + json.dumps(run_case(sys.argv[2])), flush=True)
        return 0
    cases = sys.argv[1:] or list(CASES)
    procs = {c: subprocess.Popen([sys.executable, __file__, "--case", c], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for c in cases}
    rows = []
    for c, p in procs.items():
        out, _ = p.communicate()
        found = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        if found:
            rows.append(json.loads(found[0]))
            print(found[0])
        else:
            print(f"{c} failed:\n{out[-3000:]}")
    print(f"{'case':12s} {'one':>6s} {'built':>6s} {'left':>6s} {'python':>7s} collected")
    for r in rows:
        print(f"{r['case']:12s} {r['one_gib']:6.2f} {r['built_gib']:6.2f} {r['left_gib']:6.2f} "
              f"{r['python_cuda_gib']:7.2f} {r['collected']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
