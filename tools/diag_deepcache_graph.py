"""Where DeepCache's graphed steps part from the eager ones on a GPU: the same requests (tests/gpu/
test_step_cache_gpu.py's mix) alone and together, with the cached steps run eagerly, replayed from CUDA graphs, and
replayed by the emulated backend on the same GPU; each capture verified against an eager run of the same buffers
(`GraphConfig.verify`). Writes one JSON line per finding to --out as it comes.

    PYTHONPATH=src python3 tools/diag_deepcache_graph.py --model random:sd15 --size 512 --out diag.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading

import numpy as np
import torch

from diffgraph import Engine, GraphConfig
from diffgraph.models.families.unet_cache import StepCacheRows

_step_part = StepCacheRows.step_part


def _all_deep(self, part, coefs, columns, index, d, gather=True):
    return _step_part(self, part, coefs, columns, index, d, False)


CACHES = [None, {"method": "deepcache", "interval": 3}, {"method": "deepcache", "interval": 2, "branch": 2},
          {"method": "deepcache", "interval": 4, "branch": 5, "schedule": "nonuniform", "center": 8}]


def requests(engine: Engine, size: int, steps: int) -> list:
    return [engine.make_request("a red fox", width=size, height=size, num_inference_steps=steps, seed=40 + i,
                                sampler=["euler", "dpmpp_2m"][i % 2],
                                extras=None if c is None else {"step_cache": c}) for i, c in enumerate(CACHES)]


def together(engine: Engine, reqs: list, staggered: bool) -> list[np.ndarray]:
    if not staggered:
        return [f.result(timeout=900).arrays for f in [engine.submit(r) for r in reqs]]
    started = threading.Event()
    futures = [engine.submit(r, on_progress=lambda *a: started.set()) for r in reqs[:2]]
    started.wait(300)
    futures += [engine.submit(r) for r in reqs[2:]]
    return [f.result(timeout=900).arrays for f in futures]


def levels(a: list[np.ndarray], b: list[np.ndarray]) -> list[float]:
    return [round(float(np.abs(x - y).max()) * 255, 2) for x, y in zip(a, b)]


def shadow(log, limit: int = 40):
    """Before each replay of a cached step's graph: the same step run eagerly on a copy of its buffers
    (`StepGraph.run_reference`), then the replay; logs where they differ (x, d_prev, the kept features)."""
    from diffgraph.graphs.runner import GraphRunner
    original = GraphRunner.replay
    seen = [0]

    def replay(self, kind, height, width, bucket):
        if "step_cache" not in kind or seen[0] >= limit:
            return original(self, kind, height, width, bucket)
        g = self.kinds[kind]
        bufs = g._buffers((height, width))
        snap = g.snapshot(height, width, bucket)
        g.run_reference(height, width, bucket)
        ref = {k: bufs.fields[k][:bucket].clone() for k in ("x", "d_prev", "cache.deep")}
        g.restore(height, width, bucket, snap)
        out = original(self, kind, height, width, bucket)
        diff = {k: [round(float(v), 6) for v in (bufs.fields[k][:bucket] - ref[k]).flatten(1).abs().amax(1)]
                for k in ref}
        seen[0] += 1
        log(what="replay vs eager, same buffers", kind=kind, bucket=bucket, diff=diff)
        return out

    GraphRunner.replay = replay
    return lambda: setattr(GraphRunner, "replay", original)


def variant(name: str, args, log, base: dict) -> None:
    StepCacheRows.graphed = name != "eager"
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not name.endswith("notf32")
    # a name ending in "notf32": fp32 convolutions and matmuls without TF32; "graphed-nogather": every row runs the deep path (keys without gathers), only the reused features replaced
    StepCacheRows.step_part = _all_deep if name.endswith("nogather") else _step_part
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((args.size, args.size),), prewarm=False,
                      verify=True, backend="emulated" if name == "emulated" else "cuda")
    undo = shadow(log) if name != "eager" and args.shadow else (lambda: None)
    with Engine(model=args.model, device=args.device, dtype=args.dtype, mode="graph", graphs=cfg) as e:
        reqs = requests(e, args.size, args.steps)
        alone = [e.run(r).arrays for r in reqs]
        alone2 = [e.run(r).arrays for r in reqs]
        log(variant=name, what="alone twice (second: every key captured)", levels=levels(alone, alone2))
        for other, images in base.items():
            log(variant=name, what=f"alone vs {other} variant alone", levels=levels(alone, images))
        base[name] = alone
        for staggered in (False, True):
            mix = together(e, reqs, staggered)
            log(variant=name, what=f"together ({'staggered' if staggered else 'at once'}) vs alone",
                levels=levels(mix, alone))
        table = [{k: r.get(k) for k in ("kind", "bucket", "status", "replays", "eager_fallbacks", "verify_max_abs", "error")}
                 for r in e.runner.graph_table() if r["kind"].startswith("step")]
        log(variant=name, what="step graphs", table=table)
    undo()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--variants", default="eager,graphed,emulated")
    p.add_argument("--out", default="diag_deepcache.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shadow", action="store_true", help="check each cached replay against the eager step")
    args = p.parse_args()
    with open(args.out, "a") as f:
        def log(**row):
            line = json.dumps(row)
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()
        base: dict = {}
        for name in args.variants.split(","):
            try:
                variant(name, args, log, base)
            except Exception as exc:  # the next variant still runs
                log(variant=name, error=f"{type(exc).__name__}: {exc}"[:400])


if __name__ == "__main__":
    main()
