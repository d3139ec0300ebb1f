"""GPU tests (marker `gpu`, skipped without CUDA): live previews under CUDA graphs. The preview reads the step's
static buffers after a replay (no graph of its own, no eager fallback), arrives before the image, and rows without
previews in the same batch equal their solo runs."""

import io
import os
import threading

import numpy as np
import pytest
from PIL import Image

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def sd15():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16), resolutions=((512, 512),))
    engine = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    yield engine
    engine.close()


def test_previews_under_graphs_arrive_in_order_and_leave_other_rows_alone(sd15):
    plain = [sd15.make_request("a red fox", width=512, height=512, num_inference_steps=8, seed=40 + i)
             for i in range(3)]
    alone = [sd15.run(r).arrays for r in plain]
    watched = sd15.make_request("a blue car", width=512, height=512, num_inference_steps=8, seed=9, num_images=2,
                                preview={"every": 2, "format": "jpeg"})
    got, lock, order = [], threading.Lock(), []

    def on_preview(event):
        with lock:
            got.append(event)
            order.append(event.step)
    before = [(r["replays"], r["eager_fallbacks"]) for r in sd15.graph_table() if r["kind"] == "step"]
    future = sd15.submit(watched, on_preview=on_preview)
    future.add_done_callback(lambda f: order.append("result"))
    others = [sd15.submit(r) for r in plain]
    result = future.result(timeout=600)
    for f, ref in zip(others, alone):
        assert float(np.abs(f.result(timeout=600).arrays - ref).max()) <= 2e-2
    assert order == [2, 4, 6, 8, "result"]
    frames = [np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in e.previews]) for e in got]
    assert all(f.shape == (2, 64, 64, 3) for f in frames)  # latent resolution, one per image
    assert np.isfinite(result.arrays).all() and len(frames) == 4
    after = [(r["replays"], r["eager_fallbacks"]) for r in sd15.graph_table() if r["kind"] == "step"]
    assert sum(a for a, _ in after) > sum(a for a, _ in before)
    assert sum(e for _, e in after) == sum(e for _, e in before)  # previews added no eager steps
    assert sd15.core.previews.factors((512, 512)).source == "fitted"  # random weights: fitted, not published
