"""Prompt context length as a row feature: rows of 1 to `max_chunks` 77-token prompt windows in one replay.

A prompt read with AUTOMATIC1111's syntax (text/) may span several 75-token chunks, each encoded in its own
77-token window and concatenated, so a row's conditioning is [77 * chunks, dim]. A step reads the first
77 * C tokens of the family's sequence fields (`cond.embeds`, `uncond.embeds`), C the least common multiple of its
live rows' windows; each row's windows are written repeated (graphs/step.py `write_tokens`) up to `span` = lcm(1..max_chunks) windows,
so whatever C a step has, a row of c windows (c divides C) reads its own windows C / c times. Cross-attention over
keys repeated k times equals attention over them once (each weight is divided by k, each value counted k times), so
a row's output does not depend on its companions' lengths, and no mask is needed: the denoiser's code is the same
for every C, only the token count differs (the compile tier marks it dynamic: chunk counts add no compiles; CUDA
graphs capture each C). A step of 1-window rows only is exactly the step without this feature.

Variant part: the request's windows; the step's part: their lcm (1, 2, 3 or 6 windows with `max_chunks` 3).
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Sequence

from .base import Admission, RowFeature


def lcm_all(values: Sequence[int]) -> int:
    return reduce(math.lcm, values, 1)


class PromptContext(RowFeature):
    name = "context"

    def __init__(self, window: int, max_chunks: int):
        if max_chunks < 2:
            raise ValueError(f"max_chunks {max_chunks}: the context feature is for 2 or more windows")
        self.window, self.max_chunks = window, max_chunks
        self.span = lcm_all(range(1, max_chunks + 1))
        counts = range(1, max_chunks + 1)
        self._variants = tuple(sorted({lcm_all([c for c in counts if mask >> (c - 1) & 1])
                                       for mask in range(1, 1 << max_chunks)}))

    def variants(self) -> tuple[int, ...]:
        return self._variants

    def part(self, admission: Admission) -> int:
        return admission.chunks

    def variant(self, parts: Sequence[int]) -> int:
        return lcm_all(parts)

    def tokens(self, part: int) -> int:
        return self.window * part
