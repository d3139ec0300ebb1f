"""The cost of ControlNet rows in a step (issue 32's targets): a bucket-16 step with no control rows, with 4 rows
using one ControlNet, and with all 16, in one process on one engine (graph tier), one denoiser row per image
(guidance 1), each step's time from CUDA events (the engine's step_events). The ControlNet is made from the preset's
UNet (`ControlNetModel.from_unet`), so it has a real ControlNet's architecture and cost.

    python3 tools/bench_control.py --preset random:sd15 --steps 20    # on the GPU host
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import numpy as np
import torch

from diffgraph import Engine, GraphConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="random:sd15")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=None)
    args = p.parse_args()
    from diffusers import ControlNetModel
    size = args.size or (1024 if "xl" in args.preset else 512)
    from diffgraph.models.loader import load_model
    folder = tempfile.mkdtemp()
    cuda = args.device.startswith("cuda")
    model = load_model(args.preset, torch.device(args.device), "fp16" if cuda else "fp32")
    ControlNetModel.from_unet(model.unet).save_pretrained(f"{folder}/net", safe_serialization=True)
    graphs = GraphConfig(batch_buckets=(16,), resolutions=((size, size),)) if cuda else None
    e = Engine(model, graphs=graphs, controlnet_dir=folder)
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4: size // 2, size // 4:] = 255

    def batch(controlled: int) -> float:
        reqs = [e.make_request("a cat", seed=i, num_inference_steps=args.steps, guidance_scale=1.0,
                               controls=[dict(model="net", image=image)] if i < controlled else ())
                for i in range(16)]
        e.core.step_events = []
        futures: list = []
        e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in reqs)).result()
        for f in futures:
            f.result()
        if not cuda:  # no CUDA events off the GPU: a smoke run only
            return 1.0
        torch.cuda.synchronize()
        times = [s.elapsed_time(t) for s, t, _ in e.core.step_events]
        return statistics.median(times)

    for c in (0, 4, 16):  # warm every variant (captures happen here, not in the timed rounds)
        batch(c)
    rows = {c: [] for c in (0, 4, 16)}
    for _ in range(args.rounds):
        for c in (0, 4, 16):
            rows[c].append(batch(c))
    med = {c: statistics.median(v) for c, v in rows.items()}
    print(json.dumps({"preset": args.preset, "size": size, "step_ms": rows, "graphs": [
        (r["kind"], r["bucket"], r["replays"]) for r in e.runner.graph_table() if r["replays"]]}))
    print(f"{'bucket-16 step':28s} {'ms':>8s} {'ratio':>7s}")
    for c, label in ((0, "no control rows"), (4, "4 rows with a ControlNet"), (16, "16 rows with a ControlNet")):
        print(f"{label:28s} {med[c]:8.2f} {med[c] / med[0]:7.3f}")
    e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
