"""GPU test (marker `gpu`): Qwen-Image (models/families/qwen_image.py) on CUDA, the tiny random preset. Rows of
prompts of about 5, 60 and 300 tokens (text slots 128 and 512), two aspect ratios of one token bucket, true CFG with
and without a negative prompt beside unguided rows (one on the Lightning schedule), 3 / 4 steps, submitted together
in graph mode and in the compile tier, each equal to the same request run alone within one uint8 level in fp32 (no
row reads another's data); in bf16 within 12 levels (another batch size picks other GEMM and attention kernels, as
Z-Image's GPU test states). Qwen-Image-Edit's tiny preset: edit rows with one and two input images, a true-CFG row
without inputs and an unguided Lightning-schedule row, submitted together, each equal to its request alone within one
level in fp32, in graph mode and the compile tier."""

import os

import pytest


from token_rows import images_and_graphs, picture as _picture, together_and_alone, worst_levels

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


EDITS = [dict(prompt="the same fox, asleep", height=256, width=256, num_inference_steps=3, guidance_scale=4.0, seed=1,
              extras={"reference_images": [_picture(256, 256, 1)]}),
         dict(prompt="the two of them together", height=224, width=288, num_inference_steps=4, guidance_scale=3.0,
              seed=2, extras={"reference_images": [_picture(256, 256, 1), _picture(192, 288, 2)]}),
         dict(prompt=MEDIUM, height=256, width=256, num_inference_steps=3, guidance_scale=4.0, seed=3),
         dict(prompt="ink drawing of a cat", height=288, width=224, num_inference_steps=4, guidance_scale=1.0, seed=4,
              schedule="lightning")]


@pytest.mark.parametrize("compile", [False, True])
def test_edit_cfg_and_lightning_rows_together_equal_each_alone(compile):
    _, together, alone, table = images_and_graphs("random:qwen-image-edit-tiny", EDITS, DEVICE, "fp32", compile)
    assert [a.shape[:2] for a in together] == [(256, 256), (224, 288), (256, 256), (288, 224)]
    assert not any(row["eager_fallbacks"] for row in table if row["kind"] == "step"), table
    worst = worst_levels(together, alone)
    print(f"Qwen-Image-Edit edit/CFG/Lightning rows together vs alone, compile={compile}: {worst} levels")
    assert max(worst) <= 1, worst
