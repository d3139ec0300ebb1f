"""diffusers is the oracle: our images equal engine.diffusers_pipeline()'s within 1e-4 (fp32, CPU)."""

import numpy as np
import pytest
import torch

from diffgraph.sampling.names import KDIFFUSION_SAMPLERS, TABLE_SCHEDULES
from diffgraph.sampling.schedules import SAMPLERS, SCHEDULES

# the full grid runs the first four samplers on the first two schedules; every other sampler and schedule runs once
# below (issue 31's budget: each once, fp32, one uint8 level)
CORE_SAMPLERS, CORE_SCHEDULES = SAMPLERS[:4], SCHEDULES[:2]
ONCE = [("tiny_xl", "dpmpp_2m_sde", "karras"), ("tiny", "dpmpp_3m_sde", "exponential"), ("tiny_xl", "heun", "beta"),
        ("tiny", "dpm2", "sgm_uniform"), ("tiny_xl", "dpm2_a", "default"), ("tiny", "lms", "karras"),
        ("tiny_xl", "unipc", "simple"), ("tiny_xl", "dpmpp_sde", "karras"), ("tiny", "unipc_3", "default"), ("tiny_xl", "lcm", "default"),
        ("tiny", "tcd", "default"), ("tiny_xl", "euler", "exponential"), ("tiny", "dpmpp_2m", "beta"),
        ("tiny_xl", "euler_a", "sgm_uniform"), ("tiny", "ddim", "simple"), ("tiny", "plms", "default")]

PROMPT = "a photo of a red fox in the snow"
SIZES = [(64, 64), (64, 96)]  # (width, height): square and non-square


def _reference(engine, sampler, schedule, negative, width, height, steps, seed, n=1, guidance=None):
    pipe = engine.diffusers_pipeline(sampler, schedule)
    if hasattr(pipe.scheduler, "noise_sampler_seed"):  # dpmpp_sde: the Brownian tree seeded as each request's is
        pipe.scheduler.noise_sampler_seed = seed
    return pipe(PROMPT, negative_prompt=negative, width=width, height=height, num_inference_steps=steps,
                guidance_scale=engine.model.default_guidance if guidance is None else guidance,
                num_images_per_prompt=n, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np", **({"eta": 0.3} if sampler == "tcd" else {})).images  # TCD's gamma: its step's


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
@pytest.mark.parametrize("sampler", CORE_SAMPLERS)
@pytest.mark.parametrize("schedule", CORE_SCHEDULES)
@pytest.mark.parametrize("negative", [None, "blurry, low quality"])
@pytest.mark.parametrize("size", SIZES, ids=["64x64", "64x96"])
def test_images_match_diffusers(request, model, sampler, schedule, negative, size):
    engine = request.getfixturevalue(f"{model}_engine")
    width, height = size
    seed = 1234
    ours = engine.generate(PROMPT, negative_prompt=negative, width=width, height=height, num_inference_steps=8,
                           sampler=sampler, schedule=schedule, seed=seed)
    ref = _reference(engine, sampler, schedule, negative, width, height, 8, seed)
    assert ours.arrays.shape == ref.shape == (1, height, width, 3)
    assert ours.images[0].size == (width, height)
    # the comparison means something only if the image is not flat or saturated
    assert ours.arrays.std() > 1e-3 and 0.0 < ours.arrays.mean() < 1.0
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)


def test_every_sampler_and_schedule_runs_once_in_the_grid_or_below():
    """Every sampler and schedule diffusers has; the k-diffusion samplers and the table schedules it lacks are checked
    against their reference loops and formulas in tests/test_sampling_a1111.py (and in the mixes of test_sampler_mix)."""
    assert {s for _, s, _ in ONCE} | set(CORE_SAMPLERS) == set(SAMPLERS) - set(KDIFFUSION_SAMPLERS)
    assert {s for _, _, s in ONCE} | set(CORE_SCHEDULES) == set(SCHEDULES) - set(TABLE_SCHEDULES)


@pytest.mark.parametrize("model,sampler,schedule", ONCE)
def test_each_sampler_and_schedule_matches_diffusers(request, model, sampler, schedule):
    engine = request.getfixturevalue(f"{model}_engine")
    ours = engine.generate(PROMPT, negative_prompt="blurry", width=64, height=96, num_inference_steps=6,
                           sampler=sampler, schedule=schedule, seed=77)
    ref = _reference(engine, sampler, schedule, "blurry", 64, 96, 6, 77)
    assert ours.arrays.shape == ref.shape == (1, 96, 64, 3)
    assert ours.arrays.std() > 1e-3 and 0.0 < ours.arrays.mean() < 1.0
    assert np.abs(ours.arrays - ref).max() * 255 <= 1.0, np.abs(ours.arrays - ref).max() * 255


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_several_images_and_low_guidance_match_diffusers(request, model):
    """num_images > 1 (one generator for the batch, as diffusers) and guidance <= 1 (diffusers skips CFG)."""
    engine = request.getfixturevalue(f"{model}_engine")
    for guidance in (0.5, 3.0):
        ours = engine.generate(PROMPT, num_inference_steps=5, sampler="euler_a", seed=99, num_images=3,
                               guidance_scale=guidance)
        ref = _reference(engine, "euler_a", "default", None, 64, 64, 5, 99, n=3, guidance=guidance)
        np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
        assert np.abs(ours.arrays[0] - ours.arrays[1]).max() > 1e-3  # the rows differ


@pytest.mark.parametrize("model", ["tiny", "tiny_xl"])
def test_conditioning_reaches_the_image(request, model):
    """Guards the parity tests against an insensitive model: prompt, negative prompt and seed all change the image."""
    engine = request.getfixturevalue(f"{model}_engine")
    base = engine.generate(PROMPT, seed=5, num_inference_steps=4).arrays
    assert np.abs(base - engine.generate(PROMPT, seed=5, num_inference_steps=4).arrays).max() == 0
    for other in (engine.generate("a blue car on a road", seed=5, num_inference_steps=4),
                  engine.generate(PROMPT, negative_prompt="dog", seed=5, num_inference_steps=4),
                  engine.generate(PROMPT, seed=6, num_inference_steps=4)):
        assert np.abs(base - other.arrays).max() > 1e-3
