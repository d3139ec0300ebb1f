"""GPU test (marker `gpu`): FLUX.2 klein (models/families/flux2.py) on CUDA, the tiny random preset, in graph mode
and the compile tier, fp32. Image-to-image rows at strengths 0.5 (no reference) and 0.75 (its image a reference too),
a row from noise with one reference, one with three and a plain row, submitted together: each equals the same request run alone
within one uint8 level (no row reads another's data); the plain row and the edit without references share the
graphed group (0 reference tokens, 256 image tokens); the rows with references replay their own group's graphs
(reference slot 256), captured on first use, and no step runs eagerly."""

import os

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


def _picture(h: int, w: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    small = torch.rand((1, 3, h // 8 + 1, w // 8 + 1), generator=g)
    return (torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).numpy()
            * 255).round().astype(np.uint8)


def _requests() -> list[dict]:
    a, b = _picture(256, 256, 1), _picture(224, 288, 2)
    refs = lambda images: {"reference_images": images}  # noqa: E731
    return [dict(prompt="the same fox", image=a, strength=0.5, num_inference_steps=4, seed=1),
            dict(prompt="the same fox", image=b, strength=0.75, num_inference_steps=4, seed=2, extras=refs([b])),
            dict(prompt="the same fox, asleep", height=256, width=256, num_inference_steps=4, seed=3,
                 extras=refs([a])),
            dict(prompt="a red fox", height=288, width=224, num_inference_steps=3, seed=4),
            dict(prompt="the three of them", height=256, width=256, num_inference_steps=4, seed=5,
                 extras=refs([a, b, _picture(128, 192, 5)]))]


@pytest.mark.parametrize("compile", [False, True])
def test_edit_reference_and_plain_rows_together_equal_each_alone(compile):
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((256, 256),), prewarm=False)
    with Engine(model="random:flux2-klein-tiny", device=DEVICE, dtype="fp32", mode="graph", graphs=cfg,
                compile=compile) as engine:
        requests = _requests()
        made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
        assert [m.denoising_steps for m in made] == [2, 3, 4, 3, 4]
        alone = [engine.submit(GenerationRequest.create(model=engine.info, **r)).result(timeout=600).arrays[0]
                 for r in requests]
        futures = []
        engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
        together = [f.result(timeout=600).arrays[0] for f in futures]
        table = engine.runner.graph_table()
    steps = {(row["height"], row["width"]) for row in table if row["kind"] == "step" and row["replays"]}
    assert (0, 256) in steps, table  # the plain row and the edit without references: one group's graph
    assert (256, 256) in steps, table  # the rows with references: their slot's graphs
    assert not any(row["eager_fallbacks"] for row in table if row["kind"] == "step"), table
    worst = [int(np.abs(np.round(a * 255) - np.round(b * 255)).max()) for a, b in zip(together, alone)]
    print(f"FLUX.2 klein edit/reference/plain rows together vs alone, compile={compile}: {worst} levels")
    assert max(worst) <= 1, worst
