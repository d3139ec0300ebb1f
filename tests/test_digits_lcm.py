"""The built-in `lcm` LoRA of the shipped `digits` model: a 4-step student distilled from it (tools/train_digits_lcm.py,
latent consistency distillation). With `sampler="lcm"`, 4 steps and guidance 1 (one denoiser branch: the guidance
is distilled in) the digits oracle reads >= 90% of 50 images as the asked digit (5 per digit, each digit its seed),
the student reads them more surely than the base model does with the same 4 LCM steps (its mean decision margin is
higher), and an image equals diffusers' (LCMScheduler + load_lora_weights) within one uint8 level."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from diffgraph.models import presets

FOLDER = presets.builtin_lora_folder("digits")
if FOLDER is None or not os.path.isfile(os.path.join(FOLDER, "lcm.safetensors")):
    pytest.skip("the digits model's built-in lcm adapter is not shipped in this install (make it with "
                "tools/train_digits_lcm.py)", allow_module_level=True)

from loop_util import together  # noqa: E402
from test_digits import PROMPTS, WORDS, features, oracle_and_heldout  # noqa: E402

from diffgraph import Engine  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


def _read(engine, loras) -> tuple[float, float]:
    clf, _ = oracle_and_heldout()
    asked, images = [], []
    for d, r in enumerate(together(engine, [  # the ten requests share steps
            engine.make_request(PROMPTS["digits"].format(w=WORDS[d], d=d), sampler="lcm", num_inference_steps=4,
                                guidance_scale=1.0, seed=1000 + d, num_images=5, loras=loras) for d in range(10)])):
        images.append(np.asarray(r.arrays))
        asked += [d] * 5
    x, asked = features(np.concatenate(images)), np.array(asked)
    scores = clf.decision_function(x)
    own = scores[np.arange(len(asked)), asked]
    others = np.where(np.eye(10, dtype=bool)[asked], -np.inf, scores).max(axis=1)
    return float((clf.predict(x) == asked).mean()), float((own - others).mean())


def test_the_four_step_student_draws_the_asked_digit_more_surely_than_the_base(engine):
    rate, margin = _read(engine, [("lcm", 1.0)])
    base_rate, base_margin = _read(engine, [])
    print(f"4-step lcm: student {rate:.0%} (margin {margin:.3f}), base {base_rate:.0%} (margin {base_margin:.3f})")
    assert rate >= 0.9
    assert margin > base_margin


def test_a_four_step_request_is_four_single_branch_rows_and_equals_diffusers(engine):
    request = engine.make_request("a handwritten digit three", sampler="lcm", num_inference_steps=4,
                                  guidance_scale=1.0, seed=5, loras=[("lcm", 1.0)])
    plan = engine.runner.request_plan(request)
    assert plan.num_steps == 4 and engine.runner.program.branches(request, plan.step_index).tolist() == [1, 1, 1, 1]
    ours = engine.run(request).arrays
    from diffusers import StableDiffusionPipeline

    from diffgraph.sampling.oracle import diffusers_scheduler

    # a pipeline of its own (the engine's modules carry its side paths; loading the adapter there would change them)
    pipe = StableDiffusionPipeline.from_pretrained(presets.shipped_preset_folder("digits"), torch_dtype=torch.float32,
                                                   safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = diffusers_scheduler(pipe.scheduler.config, "lcm", "default")
    pipe.load_lora_weights(os.path.join(FOLDER, "lcm.safetensors"))
    ref = pipe("a handwritten digit three", num_inference_steps=4, guidance_scale=1.0,
               generator=torch.Generator("cpu").manual_seed(5), output_type="np").images
    assert np.abs(ours - ref).max() * 255 <= 1.0, np.abs(ours - ref).max() * 255
