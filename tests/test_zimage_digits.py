"""The shipped `digits-zimage` preset (the Z-Image family, trained by tools/train_digits_zimage.py) draws the digit
the prompt asks for at its checkpoint's default steps and guidance: the digits oracle (models/digits_oracle.py)
reads at least 90% of 20 images (2 per digit, on the CPU) as the asked digit."""

from __future__ import annotations

import os

import pytest

from diffgraph.models import presets

if presets.shipped_preset_folder("digits-zimage") is None:
    pytest.skip(f"the trained asset {os.path.join(presets.ASSETS, 'digits-zimage')} is absent (make it with "
                "tools/train_digits_zimage.py on a GPU and copy it there)", allow_module_level=True)

from diffgraph import Engine  # noqa: E402
from diffgraph.models.digits_oracle import engine_score, train_oracle  # noqa: E402


def test_draws_the_asked_digit_at_its_defaults():
    engine = Engine(model="digits-zimage", device="cpu")
    info = engine.model.extra["checkpoint"]
    assert (info.name, info.steps) == ("digits-zimage", 8)
    rate, wrong = engine_score(engine, "digits-zimage", train_oracle(), per_digit=2)
    assert rate >= 0.9, f"digits-zimage: {rate:.0%} of 20 read as the asked digit; misread (asked: read) {wrong}"
