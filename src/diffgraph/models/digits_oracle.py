"""The digits oracle: reads which digit an image of the shipped `digits` / `digits-xl` presets shows.

An SVC trained on scikit-learn's 8x8 digits, upscaled and augmented as tools/train_digits.py trains the presets
(so the same white-on-black polarity), reads a 64x64 image area-downsampled to 8x8. tests/test_digits.py holds the
presets to it (>= 90% the asked digit); `diffgraph compare` scores both tiers of a digits preset with it. Training
takes a second or two; callers keep the `DigitsOracle` they get (nothing is cached here). Needs scikit-learn (the
test extra): `train_oracle` says so, with the install line, when it is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_PRESETS = ("digits", "digits-xl")
# the prompt each preset was trained on (tools/train_digits.py's captions), by the digit's word {w} or figure {d}
PROMPTS = {"digits": "a handwritten digit {w}", "digits-xl": "the number {d}",
           "digits-zimage": "a handwritten digit {w}"}
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SIZE = 64  # the presets' native size


def digit_prompt(model: str, digit: int) -> str:
    return PROMPTS[model].format(w=WORDS[digit], d=digit)


def features(arrays: np.ndarray) -> np.ndarray:
    """[n, 64, 64, 3] in 0..1 -> [n, 64]: grey, 8x8 block means, on the 0..16 scale of load_digits."""
    grey = np.asarray(arrays, dtype=np.float64).mean(axis=-1)
    n = grey.shape[0]
    return grey.reshape(n, 8, 8, 8, 8).mean(axis=(2, 4)).reshape(n, 64) * 16.0


def upscale(images8: torch.Tensor) -> torch.Tensor:
    """[N, 8, 8] in 0..16 -> [N, 1, 64, 64] in 0..1 (white digit on black), bilinear."""
    x = (images8 / 16.0).clamp(0, 1)[:, None]
    return F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False).clamp(0, 1)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Small random rotation (+-10 deg), scale (0.9-1.1) and shift (+-3 px) of [N, 1, 64, 64] in 0..1."""
    n = x.shape[0]
    r = torch.rand(n, 4, generator=gen, device=gen.device)
    angle = (r[:, 0] * 2 - 1) * math.radians(10)
    scale = 1.0 / (0.9 + 0.2 * r[:, 1])  # the grid maps output -> input, so invert the zoom
    shift = (r[:, 2:] * 2 - 1) * (3.0 / (SIZE / 2))
    cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


@dataclass(frozen=True)
class DigitsOracle:
    """The trained classifier (scikit-learn's SVC) and its accuracy on held-out augmented digits."""
    classifier: Any
    heldout: float

    def predict(self, images: np.ndarray) -> np.ndarray:
        """The digit read in each of [n, 64, 64, 3] images in 0..1."""
        return self.classifier.predict(features(images))

    def score(self, asked: np.ndarray, images: np.ndarray) -> float:
        """The fraction of `images` read as the digit `asked` of each."""
        return float((self.predict(images) == np.asarray(asked)).mean())


def train_oracle() -> DigitsOracle:
    """Trains the oracle: 1500 of the 1797 digits, each plain and in three augmented copies; the other 297 (one
    augmented copy) measure it."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.svm import SVC
    except ImportError:
        raise ValueError("the digits oracle needs scikit-learn: pip install scikit-learn") from None
    data = load_digits()
    labels = data.target.astype(np.int64)
    x64 = upscale(torch.from_numpy(data.images.astype(np.float32)))
    gen = torch.Generator().manual_seed(0)
    copies = [x64] + [augment(x64, gen) for _ in range(3)]

    def feats(x: torch.Tensor) -> np.ndarray:
        return features(x[:, 0, :, :, None].numpy())

    order = np.random.default_rng(0).permutation(len(labels))
    train_idx, test_idx = order[:1500], order[1500:]
    X = np.concatenate([feats(c[train_idx]) for c in copies])
    y = np.concatenate([labels[train_idx]] * len(copies))
    clf = SVC(gamma=0.001, C=10.0).fit(X, y)
    heldout = float((clf.predict(feats(copies[1][test_idx])) == labels[test_idx]).mean())
    return DigitsOracle(clf, heldout)


def engine_score(engine: Any, model: str, oracle: DigitsOracle, per_digit: int,
                 **params: Any) -> tuple[float, dict[int, int]]:
    """(the fraction read as the asked digit, {asked: read} of those misread) of `per_digit` 64x64 images per digit
    that `engine` (a diffgraph Engine of `model`) draws for `model`'s prompt, seed 1000 + the digit; `params` (steps,
    guidance, sampler) are the request's, the model's defaults where left out."""
    asked, images = [], []
    for d in range(10):
        result = engine.generate(digit_prompt(model, d), seed=1000 + d, num_images=per_digit, width=SIZE, height=SIZE,
                                 **params)
        images.append(np.asarray(result.arrays))
        asked += [d] * per_digit
    pred = oracle.predict(np.concatenate(images))
    return float((pred == np.array(asked)).mean()), {a: int(p) for a, p in zip(asked, pred) if a != p}
