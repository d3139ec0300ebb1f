"""What a decode costs per VAE bucket on the GPU, and 3 rows decoded as 2 + 1 (ModelRunner.decode_chunks) against
one bucket-4 replay with a padded row (the chunking before): the premise of whole-bucket decodes, measured.

    python3 tools/probe_decode.py [--model random:sd15] [--size 512x512] [--repeats 20] [--json out.json]

The graph tier, buckets 1, 2, 4 at one resolution; each figure the median of `repeats` decodes timed with CUDA events
(latents in, pixels copied to pinned host memory), after 3 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph import Engine  # noqa: E402
from diffgraph.config import GraphConfig  # noqa: E402


def timed(runner, key, latents: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of one decode of `latents` (launch to the pixels' copy done on the GPU)."""
    for _ in range(3):
        runner.decode(key, latents)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wait = runner.decode_async(key, latents)
        end.record()
        wait()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:sd15")
    p.add_argument("--size", default="512x512")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((h, w),))
    with Engine(a.model, device="cuda", mode="graph", graphs=cfg) as engine:
        runner, key = engine.runner, (h, w)
        shape = runner.latent_shape(key)
        lat = torch.randn((4, *shape), device="cuda", dtype=runner.model.dtype)
        per = {n: timed(runner, key, lat[:n], a.repeats) for n in (1, 2, 3, 4)}
        vae = [r for r in engine.graph_table() if r.get("kind") == "vae"]
    out = {"model": a.model, "size": a.size, "decode_ms": per,
           "ms_per_image": {n: ms / n for n, ms in per.items()},
           "three_rows_as_2_plus_1_ms": per[3], "three_rows_padded_to_4_ms": per[4],
           "ratio_padded_over_whole": per[4] / per[3], "vae_graphs": vae}
    print("| rows | decode ms | ms per image |\n|---|---|---|")
    for n, ms in per.items():
        print(f"| {n}{' (2 + 1)' if n == 3 else ''} | {ms:.2f} | {ms / n:.2f} |")
    print(f"3 rows: {per[3]:.2f} ms as 2 + 1, {per[4]:.2f} ms as bucket 4 with a padded row "
          f"({per[4] / per[3]:.3f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
