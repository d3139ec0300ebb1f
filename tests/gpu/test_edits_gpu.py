"""GPU tests of edits (issue 15): the VAE encoder graph against eager, and text-to-image, image-to-image and
inpainting rows sharing graph replays, each equal to its solo run (fp16 tolerance), for a 4-channel SD1.5 UNet and
a 9-channel inpainting UNet."""

import os
import threading

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


def _inputs(h: int, w: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    mask = np.zeros((h, w), np.uint8)
    mask[h // 4: 3 * h // 4, : w // 2] = 255
    return image, mask


def _mixed(engine, size: int, n: int = 12):
    reqs = []
    for i in range(n):
        image, mask = _inputs(size, size, i)
        kind = i % 3
        edit = {} if kind == 0 else {"image": image, "strength": [0.5, 0.75, 1.0][(i // 3) % 3]}
        if kind == 2:
            edit["mask_image"] = mask
        reqs.append(engine.make_request(["a red fox", "a blue car", "a castle"][i % 3], num_inference_steps=[6, 8, 10][i % 3],
                                        sampler=["euler", "euler_a", "dpmpp_2m", "ddim"][i % 4], seed=300 + i,
                                        num_images=[1, 2][(i // 2) % 2], **edit))
    return reqs


def _isolation(engine, reqs) -> float:
    alone = [engine.run(r).arrays for r in reqs]
    started = threading.Event()
    futures = [engine.submit(r, on_progress=lambda *a: started.set()) for r in reqs[: len(reqs) // 2]]
    started.wait(60)
    futures += [engine.submit(r) for r in reqs[len(reqs) // 2:]]
    results = [f.result(timeout=300) for f in futures]
    return max(float(np.abs(res.arrays - ref).max()) for res, ref in zip(results, alone))


@pytest.fixture(scope="module")
def sd15():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8, 16), resolutions=((512, 512),), prewarm=False)
    engine = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    yield engine
    engine.close()


def test_encoder_graph_matches_eager(sd15):
    runner = sd15.runner
    pixels = torch.rand((2, 3, 512, 512)) * 2 - 1
    graphed = runner.encode_pixels((512, 512), pixels)
    eager = runner.adapter.encode_pixels(runner.model, runner.decoder, pixels.to(DEVICE))
    diff = float((graphed.float() - eager.float()).abs().max())
    print(f"\n  vae encoder graph vs eager max abs (posterior parameters, fp16): {diff}")
    assert diff <= 2e-2
    assert any(r["kind"] == "vae_encode" and r["replays"] > 0 for r in sd15.graph_table())


def test_text_image_to_image_and_inpainting_rows_share_replays_and_equal_alone(sd15):
    worst = _isolation(sd15, _mixed(sd15, 512))
    print(f"\n  edits mixed with text-to-image vs alone, max abs (pixels, fp16): {worst}")
    assert worst <= 2e-2
    table = sd15.graph_table()
    assert sum(r["replays"] for r in table if r["kind"] == "step") > 0
    assert sum(r["replays"] for r in table if r["kind"] == "vae_encode") > 0
    assert not any(r["eager_fallbacks"] for r in table if r["kind"] in ("step", "vae_encode"))


def test_nine_channel_inpainting_unet_under_graphs():
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=((64, 64),), prewarm=False)
    engine = Engine(model="random:tiny-inpaint", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    try:
        assert engine.runner.extra_channels == 5
        worst = _isolation(engine, _mixed(engine, 64, n=9))
        print(f"\n  9-channel inpainting UNet, mixed vs alone max abs (pixels, fp16): {worst}")
        assert worst <= 2e-2
    finally:
        engine.close()
