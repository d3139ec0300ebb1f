"""GPU tests of ControlNet rows (issue 32): the ControlNets' own CUDA graphs (one kind per device slot, per gathered
bucket) against eager on the same engine model, with control rows, plain rows and guidance-free rows submitted
together (fp16 tolerance), and switching ControlNets of one architecture in one slot capturing nothing."""

import os

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from diffusers import ControlNetModel
    folder = tmp_path_factory.mktemp("controlnets")
    eager = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="eager")
    for i, name in enumerate(("edges", "depth")):
        net = ControlNetModel.from_unet(eager.model.denoiser)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for m in [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]:
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
                m.bias.zero_()
        net.save_pretrained(str(folder / name), safe_serialization=True)
    yield eager.model, str(folder)
    eager.close()


def _image(seed: int) -> np.ndarray:
    a = np.zeros((512, 512, 3), np.uint8)
    a[64 * (seed % 4): 64 * (seed % 4) + 128, 100:400] = 255
    return a


def test_control_graphs_equal_eager_and_switching_captures_nothing(nets):
    model, folder = nets
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((512, 512),), prewarm=False)
    kinds = [dict(controls=[dict(model="edges", image=_image(0))]), dict(),
             dict(controls=[dict(model="depth", image=_image(1), scale=0.5, start=0.2)], guidance_scale=1.0),
             dict(controls=[dict(model="edges", image=_image(2), end=0.6)], guidance_scale=1.0)]
    with Engine(model, mode="eager", controlnet_dir=folder) as eager, \
            Engine(model, mode="graph", graphs=cfg, controlnet_dir=folder, max_controlnets=1) as g:
        reqs = [g.make_request("a red fox", num_inference_steps=6, seed=70 + i, sampler="euler", **k)
                for i, k in enumerate(kinds)]
        alone = [eager.run(r).arrays for r in reqs]
        graphed = [g.run(r).arrays for r in reqs]  # one slot: edges, depth, edges take turns in it
        table = [t for t in g.runner.graph_table() if t["kind"].startswith("control")]
    for a, b in zip(alone, graphed):
        assert np.abs(a - b).max() * 255 <= 6, np.abs(a - b).max() * 255  # fp16, graph vs eager kernels
    assert sum(t["replays"] for t in table) >= 12 and sum(t["status"] == "captured" for t in table) == 4, table
    assert all(t["on_demand"] == 0 and t["invalidations"] == 0 for t in table), table
