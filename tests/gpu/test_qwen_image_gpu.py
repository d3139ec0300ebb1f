"""GPU test (marker `gpu`): Qwen-Image (models/families/qwen_image.py) on CUDA, the tiny random preset. Rows of
prompts of about 5, 60 and 300 tokens (text slots 128 and 512), two aspect ratios of one token bucket, true CFG with
and without a negative prompt beside unguided rows (one on the Lightning schedule), 3 / 4 steps, submitted together
in graph mode and in the compile tier, each equal to the same request run alone within one uint8 level in fp32 (no
row reads another's data); in bf16 within 12 levels (another batch size picks other GEMM and attention kernels, as
Z-Image's GPU test states)."""

import os

import pytest

from token_rows import together_and_alone

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
LONG = ", ".join(["a lighthouse on a cliff at dusk, long exposure, waves breaking below"] * 20)
MEDIUM = ", ".join(["a lighthouse on a cliff at dusk, long exposure, waves breaking below"] * 4)
REQUESTS = [dict(prompt="a red fox", height=256, width=256, num_inference_steps=4, guidance_scale=1.0, seed=1),
            dict(prompt=LONG, height=224, width=288, num_inference_steps=3, guidance_scale=4.0, seed=2),
            dict(prompt="ink drawing of a cat", negative_prompt="blurry", guidance_scale=3.0, height=288, width=224,
                 num_inference_steps=4, seed=3),
            dict(prompt=MEDIUM, height=256, width=256, num_inference_steps=3, guidance_scale=1.0, seed=4,
                 schedule="lightning")]


@pytest.mark.parametrize("dtype,levels", [("fp32", 1), ("bf16", 12)])
@pytest.mark.parametrize("compile", [False, True])
def test_mixed_rows_equal_each_alone(compile, dtype, levels):
    keys, steps, worst = together_and_alone("random:qwen-image-tiny", REQUESTS, DEVICE, dtype, compile)
    assert keys == [(128, 256), (512, 256), (128, 256), (128, 256)]
    assert steps == {(128, 256), (512, 256)}, steps
    print(f"Qwen-Image rows together vs alone, {dtype}, compile={compile}: {worst} levels")
    assert max(worst) <= levels, worst
