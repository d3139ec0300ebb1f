"""What an engine sends back for a request: progress events (`ProgressEvent`), its result (`GenerationResult`), or one
of the errors it answers with (`QueueFullError`, `RequestAborted`, `EngineStepError`, `EngineClosed`). Plain picklable
data, so they cross a process boundary unchanged; request.py re-exports them (so this module names the request's type
without importing it: request.py is above it).
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests; the caller should retry later (HTTP 429)."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished."""


class EngineStepError(RuntimeError):
    """A denoising step (or the decode) failed; every request of that batch gets this error."""


class EngineClosed(RuntimeError):
    """The engine is closed, or its loop stopped after an internal error: it takes no new requests."""


@dataclass(frozen=True)
class ProgressEvent:
    """One denoising step of a request done: `step` of `total`. A request with a `preview` gets a second event for
    the steps that bring one: `previews` holds one encoded image per image of the request, in `preview_format`."""

    request_id: str
    step: int
    total: int
    previews: tuple[bytes, ...] = ()
    preview_format: str | None = None


@dataclass
class GenerationResult:
    """What a request gets back: float pixels in [0, 1] (n, H, W, 3), the images encoded in the request's
    output_format (when it has one), the seed and timings (ms). Reads as the list of its PIL images
    (`images[0].save(...)`), which are made from the pixels on first use, as diffusers' numpy_to_pil rounds."""

    request_id: str
    arrays: np.ndarray | None  # None when only the encoded images crossed a process boundary (replicas)
    seed: int
    timings: dict[str, float]
    request: GenerationRequest
    encoded: list[bytes] | None = None
    # the final image latents [n, C, h, w] float32 (the model's latent space, unpacked), when the request asked
    # (`return_latents`); else None
    latents: np.ndarray | None = None
    _images: list[Any] | None = field(default=None, repr=False, compare=False)

    @property
    def images(self) -> list[Any]:
        if self._images is None:
            import io

            from PIL import Image
            if self.arrays is None:
                self._images = [Image.open(io.BytesIO(b)) for b in self.encoded or ()]
            else:
                self._images = [Image.fromarray(a) for a in (self.arrays * 255).round().astype("uint8")]
        return self._images

    def __len__(self) -> int:
        return len(self.arrays) if self.arrays is not None else len(self.encoded or ())

    def __iter__(self):
        return iter(self.images)

    def __getitem__(self, index: int):
        return self.images[index]
