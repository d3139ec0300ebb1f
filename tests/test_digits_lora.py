"""The built-in `pencil` LoRA of the shipped `digits` model (tools/train_digits_lora.py) changes a measurable style
and keeps the digit: over 20 prompts (2 per digit, each its own seed) the test_digits oracle reads >= 90% of the
images made with the adapter at scale 1 as the asked digit (features normalised by each image's peak, since pencil
strokes are grey, not white), and the style measure (an image's peak brightness, its 99th percentile) moves from
scale 0 by more than 5 times its spread over 20 seeds at scale 0."""

from __future__ import annotations

import numpy as np
import pytest

from diffgraph.models import presets

if presets.builtin_lora_folder("digits") is None or presets.shipped_preset_folder("digits") is None:
    pytest.skip("the digits model or its built-in adapters are not shipped in this install "
                "(make them with tools/train_digits.py and tools/train_digits_lora.py)", allow_module_level=True)

from loop_util import together  # noqa: E402
from test_digits import WORDS, features, oracle_and_heldout  # noqa: E402

from diffgraph import Engine  # noqa: E402

PROMPT = "a handwritten digit {w}"


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


def _images(engine, scale: float, seeds, digits) -> np.ndarray:
    """One image per (seed, digit), the requests submitted together (they share steps)."""
    loras = [("pencil", scale)] if scale else []
    return np.concatenate([r.arrays for r in together(engine, [
        engine.make_request(PROMPT.format(w=WORDS[d]), seed=seed, num_inference_steps=20, loras=loras)
        for seed, d in zip(seeds, digits)])])


def _peak(images: np.ndarray) -> np.ndarray:
    return np.percentile(images.mean(axis=-1).reshape(len(images), -1), 99, axis=1)


def test_pencil_is_listed_as_builtin(engine):
    listing = {a["name"]: a for a in engine.loras()["data"]}
    assert listing["pencil"]["source"] == "builtin" and listing["pencil"]["family"] == "sd"


def test_pencil_keeps_the_digit_and_changes_the_style(engine):
    digits = [d for d in range(10) for _ in range(2)]
    seeds = [500 + i for i in range(20)]
    styled = _images(engine, 1.0, seeds, digits)
    plain = _images(engine, 0.0, seeds, digits)
    clf, _ = oracle_and_heldout()
    normalised = styled / np.maximum(styled.reshape(len(styled), -1).max(axis=1), 1e-3)[:, None, None, None]
    rate = float((clf.predict(features(normalised)) == np.array(digits)).mean())
    assert rate >= 0.9, f"only {rate:.0%} of the pencil digits read as the asked digit"
    p0, p1 = _peak(plain), _peak(styled)
    assert abs(p1.mean() - p0.mean()) > 5 * p0.std(), (p0.mean(), p0.std(), p1.mean())


def test_lora_dir_and_builtin_adapters_are_served_together(tmp_path):
    import shutil

    from diffgraph.request import ParamError

    shutil.copy(f"{presets.builtin_lora_folder('digits')}/pencil.safetensors", tmp_path / "inky.safetensors")
    with Engine("digits", device="cpu", lora_dir=str(tmp_path)) as e:
        sources = {a["name"]: a["source"] for a in e.loras()["data"]}
        assert sources == {"pencil": "builtin", "lcm": "builtin", "inky": "lora_dir"}
        for typo, meant in (("pencl", "pencil"), ("inkk", "inky")):
            with pytest.raises(ParamError, match=f"did you mean '{meant}'"):
                e.generate("a handwritten digit one", num_inference_steps=1, loras=[(typo, 1.0)])
