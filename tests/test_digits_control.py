"""The built-in `outline` ControlNet of `digits` (issue 32, point 5; tools/train_digits_control.py): its control image
is a digit's outline (the Canny edge map of a digit image), and the generated digit follows where the outline is and
how large. Digits are centred and alike in size, so an uncontrolled digit already overlaps a centred outline: the
outlines here are moved 16 px up or scaled by 0.6, and the generated digit's foreground must overlap the outline's
filled shape with IoU >= 0.6 in >= 8 of 10 seeds, against a mean IoU <= 0.3 without the control."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffgraph import Engine

from loop_util import together

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@pytest.fixture(scope="module")
def engine():
    with Engine("digits", device="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.images.astype(np.float32), d.target


def placed(image8: np.ndarray, shift: tuple[int, int] = (0, 0), scale: float = 1.0) -> np.ndarray:
    """A training-set digit at 64x64 (white on black, uint8), moved by `shift` pixels (x, y) and scaled."""
    x = F.interpolate(torch.from_numpy(image8 / 16.0).clamp(0, 1)[None, None], size=(64, 64), mode="bilinear",
                      align_corners=False)
    theta = torch.tensor([[[1 / scale, 0, -shift[0] / 32], [0, 1 / scale, -shift[1] / 32]]], dtype=torch.float32)
    x = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)
    return (x[0, 0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def test_the_outline_control_is_listed_as_a_builtin(engine):
    assert "outline" in engine.runner.controls.catalog.listing()


@pytest.mark.parametrize("move", [dict(shift=(0, -16)), dict(scale=0.6)], ids=["up16", "scale0.6"])
def test_generated_digits_follow_the_outline(engine, digits, move):
    import cv2
    images, labels = digits
    shapes, reqs = [], []
    for seed in range(10):
        i = seed * 7
        shape = placed(images[i], **move)
        outline = np.repeat(cv2.Canny(shape, 100, 200)[:, :, None], 3, 2)
        prompt = f"a handwritten digit {WORDS[labels[i]]}"
        shapes.append(shape)
        reqs += [engine.make_request(prompt, seed=seed, controls=[dict(model="outline", image=outline)]),
                 engine.make_request(prompt, seed=seed)]
    results = together(engine, reqs)  # the 20 requests share steps
    controlled = [iou(ours.arrays[0].mean(-1) > 0.5, shape > 127) for ours, shape in zip(results[::2], shapes)]
    plain = [iou(alone.arrays[0].mean(-1) > 0.5, shape > 127) for alone, shape in zip(results[1::2], shapes)]
    assert sum(c >= 0.6 for c in controlled) >= 8, np.round(controlled, 2)
    assert np.mean(plain) <= 0.3, np.round(plain, 2)
