"""What the prompt context's graphs cost (issue 30): a graph-tier engine's start (seconds to ready: captures of
every step variant at every bucket) and its device memory, with --max-prompt-chunks 1 (no context variants) and 3
(contexts of 1, 2, 3 and 6 windows), side by side in one process. Usage on the GPU host:
    python tools/probe_prompt_graphs.py [--model random:sd15] [--size 512]"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from diffgraph import Engine, GraphConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--size", type=int, default=512)
    args = p.parse_args()
    out = {}
    loader = Engine(args.model, device="cuda", mode="eager")
    model = loader.model  # the weights once, shared by every build
    loader.close()
    weights = torch.cuda.memory_reserved()
    for run, chunks in enumerate((1, 3, 1, 3)):
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        engine = Engine(model, mode="graph", max_prompt_chunks=chunks,
                        graphs=GraphConfig(resolutions=((args.size, args.size),)))
        ready = time.perf_counter() - t0
        steps = sum(1 for r in engine.graph_table() if r["kind"].startswith("step") and r["status"] == "captured")
        out[f"run {run}: max_prompt_chunks={chunks}"] = {
            "ready_s": round(ready, 2), "step_graphs": steps,
            "reserved_beyond_weights_gib": round((torch.cuda.memory_reserved() - weights) / 2**30, 3)}
        engine.close()
        del engine
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
