"""GPU tests of image-prompt rows (issue 32): on random:sd15 in fp16, IP-Adapter rows (base and plus), plain rows
and guidance-free rows submitted together in the graph tier equal each alone in eager mode (fp16 tolerance), and the
`step_ipon` graph replays."""

import os
import sys

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_image_prompt_graphs_equal_eager(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from test_ip_adapter import make_ip_adapter, make_plus_ip_adapter, picture
    eager = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="eager")
    try:
        make_ip_adapter(eager.model.denoiser, tmp_path, "base", seed=1, gain=0.05)
        make_plus_ip_adapter(eager.model.denoiser, tmp_path, "plus", seed=2, gain=0.05)
        cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((512, 512),), prewarm=False)
        kinds = [dict(image_prompts=dict(model="base", images=[picture(1)])), dict(),
                 dict(image_prompts=dict(model="plus", images=[picture(2), picture(3)], scale=0.6), guidance_scale=1.0)]
        with Engine(eager.model, mode="eager", ip_adapter_dir=str(tmp_path)) as e, \
                Engine(eager.model, mode="graph", graphs=cfg, ip_adapter_dir=str(tmp_path)) as g:
            reqs = [g.make_request("a red fox", num_inference_steps=6, seed=80 + i, sampler="euler", **k)
                    for i, k in enumerate(kinds)]
            alone = [e.run(r).arrays for r in reqs]
            futures = [g.submit(r) for r in reqs]
            graphed = [f.result().arrays for f in futures]
            replays: dict[str, int] = {}  # per kind, summed over its buckets (rows join and leave)
            for t in g.runner.graph_table():
                replays[t["kind"]] = replays.get(t["kind"], 0) + t["replays"]
        diffs = [float(np.abs(a - b).max() * 255) for a, b in zip(alone, graphed)]
        assert max(diffs) <= 6, (diffs, replays)  # fp16, graph vs eager kernels
        assert replays.get("step_ipon", 0) >= 6, replays
    finally:
        eager.close()
