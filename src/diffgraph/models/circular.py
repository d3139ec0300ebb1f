"""Circular padding for AUTOMATIC1111's tiling: every `torch.nn.Conv2d` of a module pads circularly for the span of a
context, and back to what it was after.

A1111 sets `padding_mode = "circular"` on every Conv2d of the model (UNet and VAE) for a tiling request; torch's
Conv2d reads the attribute at each forward (`F.pad(..., mode="circular")`, then the convolution without padding), so
switching it needs no new weights. Here it is switched only around the calls of a tiling group (its step, decode and
encode), which the engine loop runs one at a time, so other groups' calls of the same modules never see it; a CUDA
graph captured inside the context keeps the circular kernels. A convolution without padding (the VAE's downsamplers,
which pad by hand) is unchanged, as in A1111.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


@contextlib.contextmanager
def circular_padding(module: torch.nn.Module) -> Iterator[None]:
    """Every Conv2d of `module` pads circularly inside the context; each gets its own mode back after, also on
    an error."""
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    modes = [m.padding_mode for m in convs]
    try:
        for m in convs:
            m.padding_mode = "circular"
        yield
    finally:
        for m, mode in zip(convs, modes):
            m.padding_mode = mode


def circular(fn: Callable[..., Any], module: Callable[[], torch.nn.Module]) -> Callable[..., Any]:
    """`fn` run with the Conv2d layers of `module()` (looked up at each call: a replaced module is the one
    padded) padding circularly."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with circular_padding(module()):
            return fn(*args, **kwargs)
    return run
