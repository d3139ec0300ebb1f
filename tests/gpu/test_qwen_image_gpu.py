"""GPU test (marker `gpu`): Qwen-Image (models/families/qwen_image.py) on CUDA, the tiny random preset. Rows of
prompts of about 5, 60 and 300 tokens (text slots 128 and 512), two aspect ratios of one token bucket, true CFG with
and without a negative prompt beside unguided rows, 3 / 4 steps, submitted together in graph mode and in the compile
tier, each equal to the same request run alone within one uint8 level in fp32 (no row reads another's data); in bf16
within 12 levels (another batch size picks other GEMM and attention kernels, as Z-Image's GPU test states)."""

import os

import numpy as np
import pytest

from diffgraph import Engine, GenerationRequest, GraphConfig
from diffgraph.text.prepared import prepare

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
LONG = ", ".join(["a lighthouse on a cliff at dusk, long exposure, waves breaking below"] * 20)
MEDIUM = ", ".join(["a lighthouse on a cliff at dusk, long exposure, waves breaking below"] * 4)
REQUESTS = [dict(prompt="a red fox", height=256, width=256, num_inference_steps=4, guidance_scale=1.0, seed=1),
            dict(prompt=LONG, height=224, width=288, num_inference_steps=3, guidance_scale=4.0, seed=2),
            dict(prompt="ink drawing of a cat", negative_prompt="blurry", guidance_scale=3.0, height=288, width=224,
                 num_inference_steps=4, seed=3),
            dict(prompt=MEDIUM, height=256, width=256, num_inference_steps=3, guidance_scale=1.0, seed=4)]


def _levels(a: np.ndarray) -> np.ndarray:
    return (a * 255).round().astype(np.int16)


@pytest.mark.parametrize("dtype,levels", [("fp32", 1), ("bf16", 12)])
@pytest.mark.parametrize("compile", [False, True])
def test_mixed_rows_equal_each_alone(compile, dtype, levels):
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((256, 256),), prewarm=False)
    with Engine(model="random:qwen-image-tiny", device=DEVICE, dtype=dtype, mode="graph", graphs=cfg,
                compile=compile) as engine:
        made = [GenerationRequest.create(model=engine.info, **r) for r in REQUESTS]
        keys = [engine.runner.group_key(m.key, prepare(engine.runner.text_setup, m)) for m in made]
        assert keys == [(128, 256), (512, 256), (128, 256), (128, 256)]
        alone = [engine.submit(GenerationRequest.create(model=engine.info, **r)).result(timeout=600).arrays[0]
                 for r in REQUESTS]
        futures = []
        engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in made)).result()
        together = [f.result(timeout=600).arrays[0] for f in futures]
        steps = [row for row in engine.runner.graph_table() if row["kind"] == "step" and row["replays"]]
    assert {(row["height"], row["width"]) for row in steps} == {(128, 256), (512, 256)}, steps
    worst = [int(np.abs(_levels(a) - _levels(b)).max()) for a, b in zip(together, alone)]
    print(f"Qwen-Image rows together vs alone, {dtype}, compile={compile}: {worst} levels")
    assert max(worst) <= levels, worst
