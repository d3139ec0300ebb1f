"""Generation requests (validated parameters) and their results.

A `GenerationRequest` checks its parameters whenever one is made (`create(...)`, the constructor,
`dataclasses.replace`): every error is a ValueError that names the parameter, the value and what is
allowed. The engine, CLI and server build requests through `create`, which also draws a seed.
"""

from __future__ import annotations

import itertools
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .sampling.schedules import SAMPLERS, SCHEDULES

MIN_SIZE = 64
MAX_SIZE = 2048
MAX_STEPS = 200
MAX_IMAGES = 16
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
OUTPUT_FORMATS = ("png", "jpeg", "webp")

_ids = itertools.count()


def _nearest_multiples(value: int, base: int = 8) -> str:
    """The valid sizes next to `value`: multiples of `base` inside MIN_SIZE..MAX_SIZE."""
    low = min(max((value // base) * base, MIN_SIZE), MAX_SIZE)
    high = min(low + base, MAX_SIZE)
    return f"{low} or {high}" if MIN_SIZE <= value <= MAX_SIZE and high != low else f"{low}"


def _show(value: Any) -> str:
    """A value for an error message: short, and safe for integers too long for str()."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and abs(int(value)).bit_length() > 80:
        digits = int(abs(int(value)).bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}(an integer of about {digits} digits)"
    text = str(value) if isinstance(value, (int, float, np.integer, np.floating)) else repr(value)
    return text if len(text) <= 24 else f"{text[:20]}..."


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer number of pixels, got {_show(value)}")
    value = int(value)
    if not MIN_SIZE - 8 < value < MAX_SIZE + 8:
        raise ValueError(f"{name} {_show(value)} is outside the supported range {MIN_SIZE}..{MAX_SIZE} "
                         "(multiples of 8)")
    if value % 8:
        raise ValueError(f"{name} {value} is not a multiple of 8; use {_nearest_multiples(value)}")
    if not MIN_SIZE <= value <= MAX_SIZE:
        raise ValueError(f"{name} {value} is outside the supported range {MIN_SIZE}..{MAX_SIZE} (multiples of 8)")
    return value


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {_show(value)}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} {_show(value)} is out of range; allowed: {low}..{high}")
    return int(value)


@dataclass(frozen=True)
class GenerationRequest:
    """One user request: `num_images` rows that share prompt, size, sampler and one seeded generator."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    sampler: str
    schedule: str
    seed: int
    num_images: int
    output_format: str | None = None  # "png" | "jpeg" | "webp": also return encoded bytes
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")

    def __post_init__(self) -> None:
        """Every construction is checked (also `dataclasses.replace` and direct calls), and the numbers are
        stored as plain Python ints and floats."""
        prompt, negative_prompt = self.prompt, self.negative_prompt
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise ValueError(f"negative_prompt must be a string or None, got {type(negative_prompt).__name__}")
        for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt or "")):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{name} is not valid text: it holds an unpaired surrogate at character {e.start}; "
                                 "send UTF-8 text") from None
        guidance_scale = self.guidance_scale
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float, np.floating, np.integer)):
            raise ValueError(f"guidance_scale must be a number >= 0, got {_show(guidance_scale)}")
        try:
            guidance = float(guidance_scale)
        except OverflowError:  # an int too large for a float
            guidance = math.inf
        if not (0 <= guidance <= MAX_GUIDANCE):  # NaN fails this too
            raise ValueError(f"guidance_scale {_show(guidance_scale)} is out of range; allowed: 0..{MAX_GUIDANCE:g}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r} is unknown; allowed: {', '.join(SAMPLERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown; allowed: {', '.join(SCHEDULES)}")
        if self.output_format is not None and self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"output_format {self.output_format!r} is unknown; allowed: {', '.join(OUTPUT_FORMATS)}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        checked = {"width": _check_size("width", self.width), "height": _check_size("height", self.height),
                   "num_inference_steps": _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_STEPS),
                   "guidance_scale": guidance, "seed": _check_int("seed", self.seed, 0, MAX_SEED),
                   "num_images": _check_int("num_images", self.num_images, 1, MAX_IMAGES)}
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def create(cls, prompt: Any, *, negative_prompt: Any = None, width: Any, height: Any,
               num_inference_steps: Any, guidance_scale: Any, sampler: Any, schedule: Any,
               seed: Any = None, num_images: Any = 1, output_format: Any = None,
               request_id: str | None = None) -> "GenerationRequest":
        """A request from user parameters: a random seed when none is given, every value checked."""
        if seed is None:
            seed = secrets.randbelow(2**31)
        kwargs = {} if request_id is None else {"request_id": str(request_id)}
        return cls(prompt=prompt, negative_prompt=negative_prompt, width=width, height=height,
                   num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, sampler=sampler,
                   schedule=schedule, seed=seed, num_images=num_images, output_format=output_format, **kwargs)


@dataclass
class GenerationResult:
    """What a request gets back: PIL images, their float pixels in [0, 1] (n, H, W, 3), the seed, timings (ms)."""

    request_id: str
    images: list[Any]
    arrays: np.ndarray
    seed: int
    timings: dict[str, float]
    request: GenerationRequest
    encoded: list[bytes] | None = None  # the images in request.output_format, when one was asked for

    # A result reads as the list of its images: `images = engine.generate(...)`, `images[0].save(...)`.
    def __len__(self) -> int:
        return len(self.images)

    def __iter__(self):
        return iter(self.images)

    def __getitem__(self, index: int):
        return self.images[index]

