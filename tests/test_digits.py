"""The shipped `digits` / `digits-xl` presets draw the digit the prompt asks for.

An oracle (models/digits_oracle.py: an SVC trained on scikit-learn's 8x8 digits, passed through the same upscale
and augmentation as tools/train_digits.py, so the same white-on-black polarity) reads each generated 64x64 image,
area-downsampled to 8x8. For each model and sampler, 50 images (5 per digit) at 20 steps must be at least 90% the
asked digit, and classifier-free guidance 5.0 must beat 1.0.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pytest

from diffgraph.models import presets
from diffgraph.models.digits_oracle import DIGITS_PRESETS as MODELS
from diffgraph.models.digits_oracle import PROMPTS, WORDS, features, train_oracle

_missing = [name for name in MODELS if presets.shipped_preset_folder(name) is None]
if _missing:
    pytest.skip(f"trained assets missing: {', '.join(os.path.join(presets.ASSETS, m) for m in _missing)} "
                "(make them with tools/train_digits.py)", allow_module_level=True)

from diffgraph import Engine  # noqa: E402

PER_DIGIT = 5
__all__ = ["PROMPTS", "WORDS", "features", "oracle_and_heldout"]  # what the other digits tests import from here


@lru_cache(maxsize=1)
def oracle_and_heldout():
    """(the oracle's SVC, its held-out accuracy), trained once per test process."""
    oracle = train_oracle()
    return oracle.classifier, oracle.heldout


@lru_cache(maxsize=2)
def engine(model: str) -> Engine:
    return Engine(model=model, device="cpu")


@lru_cache(maxsize=None)
def generated(model: str, sampler: str, guidance: float) -> tuple[np.ndarray, np.ndarray]:
    """(asked digits [50], images [50, 64, 64, 3]); 5 per digit, each digit its own seed."""
    asked, images = [], []
    for d in range(10):
        prompt = PROMPTS[model].format(w=WORDS[d], d=d)
        result = engine(model).generate(prompt, num_inference_steps=20, guidance_scale=guidance, sampler=sampler,
                                        seed=1000 + d, num_images=PER_DIGIT, width=64, height=64)
        images.append(np.asarray(result.arrays))
        asked += [d] * PER_DIGIT
    return np.array(asked), np.concatenate(images)


def recognition(model: str, sampler: str, guidance: float) -> tuple[float, float, np.ndarray]:
    """(fraction read as the asked digit, mean decision margin of the asked digit, predictions)."""
    clf, _ = oracle_and_heldout()
    asked, images = generated(model, sampler, guidance)
    x = features(images)
    pred = clf.predict(x)
    scores = clf.decision_function(x)  # [n, 10], one-vs-rest shaped
    own = scores[np.arange(len(asked)), asked]
    others = np.where(np.eye(10, dtype=bool)[asked], -np.inf, scores).max(axis=1)
    return float((pred == asked).mean()), float((own - others).mean()), pred


def test_oracle_reads_training_style_digits():
    _, heldout = oracle_and_heldout()
    assert heldout >= 0.97, f"oracle accuracy on held-out augmented digits is only {heldout:.3f}"


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m"])
@pytest.mark.parametrize("model", MODELS)
def test_draws_the_asked_digit(model, sampler):
    rate, _, pred = recognition(model, sampler, 5.0)
    asked, images = generated(model, sampler, 5.0)
    assert images.shape == (50, 64, 64, 3) and images.min() >= 0.0 and images.max() <= 1.0
    # Real drawings, not blank or saturated: a digit covers part of the square.
    ink = images.mean(axis=(1, 2, 3))
    assert 0.05 < ink.mean() < 0.6, f"mean brightness {ink.mean():.3f}: images are not white digits on black"
    wrong = {int(a): int(p) for a, p in zip(asked, pred) if a != p}
    assert rate >= 0.9, f"{model}/{sampler}: {rate:.0%} recognised as the asked digit; misread (asked: read) {wrong}"


@pytest.mark.parametrize("model", MODELS)
def test_guidance_makes_the_digit_clearer(model):
    rate1, margin1, _ = recognition(model, "euler", 1.0)
    rate5, margin5, _ = recognition(model, "euler", 5.0)
    assert rate5 >= rate1 and margin5 > margin1 + 0.1, (
        f"{model}: guidance 1.0 -> {rate1:.0%} (margin {margin1:.2f}), 5.0 -> {rate5:.0%} (margin {margin5:.2f})")


@pytest.mark.parametrize("model", MODELS)
def test_concurrent_mixed_requests_each_get_their_digit(model):
    """50 requests in flight together (one image each, its own seed), mixed samplers and step counts, sharing
    steps in the step-level engine: a row mix-up would hand a request another request's digit."""
    eng = engine(model)
    clf, _ = oracle_and_heldout()
    steps_before = eng.stats["steps"]
    asked, futures = [], []
    for i in range(50):
        d = i % 10
        req = eng.make_request(PROMPTS[model].format(w=WORDS[d], d=d), num_inference_steps=(15, 20, 25)[i % 3],
                               guidance_scale=5.0, sampler=("euler", "dpmpp_2m")[(i // 3) % 2], seed=5000 + i,
                               width=64, height=64)
        futures.append(eng.submit(req))
        asked.append(d)
    images = np.concatenate([f.result(timeout=600).arrays for f in futures])
    pred = clf.predict(features(images))
    rate = float((pred == np.array(asked)).mean())
    assert eng.stats["steps"] - steps_before < sum((15, 20, 25)[i % 3] for i in range(50))  # they shared steps
    assert rate >= 0.9, f"{model}: {rate:.0%} of concurrent requests got their digit"
