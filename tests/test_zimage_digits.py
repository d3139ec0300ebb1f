"""The shipped `digits-zimage` preset (the Z-Image family, trained by tools/train_digits_zimage.py) draws the digit
the prompt asks for at its checkpoint's default steps and guidance: the digits oracle (models/digits_oracle.py)
reads at least 90% of 20 images (2 per digit, on the CPU) as the asked digit. It ships without tokenizer/ (the
tokenizer's files would cost megabytes): such a folder reads prompts with the shipped Qwen3 tokenizer."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from diffgraph import Engine
from diffgraph.models import presets
from diffgraph.models.digits_oracle import engine_score, train_oracle

ASSET = os.path.join(presets.ASSETS, "digits-zimage")


@pytest.mark.skipif(presets.shipped_preset_folder("digits-zimage") is None,
                    reason=f"the trained asset {ASSET} is absent (make it with tools/train_digits_zimage.py on a GPU "
                           "and copy it there)")
def test_draws_the_asked_digit_at_its_defaults():
    with Engine(model="digits-zimage", device="cpu") as engine:
        info = engine.model.extra["checkpoint"]
        assert (info.name, info.steps) == ("digits-zimage", 8)
        rate, wrong = engine_score(engine, "digits-zimage", train_oracle(), per_digit=2)
    assert rate >= 0.9, f"digits-zimage: {rate:.0%} of 20 read as the asked digit; misread (asked: read) {wrong}"


@pytest.mark.skipif(presets.shipped_preset_folder("digits-zimage") is None, reason="the trained asset is absent")
def test_its_fp8_tier_quantises_the_blocks_linears_and_still_draws_the_asked_digit():
    """The fp8 tier takes the family's block linears (attention and feed-forward; `min_features=64` because the
    tiny model's are narrow) and leaves the embedders, the modulation and the final layer in 16 bits. The tiny
    model's feed-forward is 341 wide (Z-Image's 8/3 of 128), off fp8's multiple of 16, so it stays 16-bit here
    (Z-Image's own, 10240, is a multiple)."""
    from diffgraph.config import Fp8Config
    from diffgraph.quantize import Fp8Linear
    from diffgraph.quantize.fp8 import SkipReason

    with Engine(model="digits-zimage", device="cpu", quantize=Fp8Config(min_features=64)) as engine:
        report = engine.quantized
        chosen = report.quantized
        denoiser = engine.model.denoiser
        layers = len(denoiser.layers) + len(denoiser.noise_refiner) + len(denoiser.context_refiner)
        assert len(chosen) == 4 * layers
        assert {name.split(".", 2)[2] for name in chosen} == {
            "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"}
        off = {name.split(".", 2)[2] for name, why in report.skipped if why is SkipReason.NOT_MULTIPLE_OF_16}
        assert off == {"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
        fp8 = {n for n, m in engine.model.denoiser.named_modules() if isinstance(m, Fp8Linear)}
        assert fp8 == set(chosen)
        assert not any("adaLN" in n or "embedder" in n or "final_layer" in n for n in fp8)
        rate, wrong = engine_score(engine, "digits-zimage", train_oracle(), per_digit=2)
    assert rate >= 0.9, f"digits-zimage in fp8: {rate:.0%} of 20 read as the asked digit; misread {wrong}"


def test_a_folder_without_tokenizer_reads_prompts_with_the_shipped_one(tmp_path):
    from test_zimage import pipeline

    pipe = pipeline(3.0, qwen_vocabulary=True)
    full, bare = tmp_path / "Z-Image-Turbo", tmp_path / "bare" / "Z-Image-Turbo"
    for folder in (full, bare):
        pipe.save_pretrained(str(folder))
    shutil.rmtree(bare / "tokenizer")
    images = []
    for folder in (full, bare):
        with Engine(model=str(folder), device="cpu") as engine:
            images.append(engine.generate("a red fox", width=64, height=64, num_inference_steps=2, seed=1).arrays[0])
    np.testing.assert_array_equal(images[0], images[1])


def test_its_checkpoint_comes_from_its_name():
    from diffgraph.models.families.zimage import CHECKPOINTS, checkpoint_of

    assert checkpoint_of("digits-zimage") == checkpoint_of("/m/digits-zimage") == CHECKPOINTS["digits-zimage"]
    assert (CHECKPOINTS["digits-zimage"].steps, CHECKPOINTS["digits-zimage"].guidance) == (8, 3.0)
    assert checkpoint_of("/m/digits-zimage-v2") == CHECKPOINTS["z-image"]  # only the exact name
