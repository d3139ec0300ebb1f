"""Live previews: a small image of a row's current denoised prediction, every K steps, for the requests that ask.

Owns: the latent-to-RGB factors of a model (`LatentRGB`), the preview render on the device and the preview thread
that encodes and sends them. The render is a linear map of the rows' D (the step's `d_prev` field after the step:
the denoised prediction the sampler just used) to RGB at latent resolution, AUTOMATIC1111's "Approx cheap":
  * its published factors for the SD1.x/SD2.x and SDXL latent spaces (the family adapter's `preview_factors`), for
    a checkpoint with their VAE architecture and trained weights;
  * for any other model (the `digits` presets, random-weight presets, other VAEs) factors fitted by least squares
    to the model's own VAE: random latents decoded once, the pixels averaged over each latent cell; fitted at the
    model's first preview and kept by the runner's `PreviewMaker` (one decode of four small latents).
It runs between steps on the loop thread, after the step and outside its graphs: an einsum over the asking rows
only, a copy to pinned host memory and an event (nothing waits for the GPU); the preview thread waits for the event,
encodes the images and sends them as a `ProgressEvent` with `previews`. A request's result is sent only after its
last preview (`settle`), so a stream's previews come before its image. Rows that did not ask cost nothing.
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from ..models.model import DiffusionModel
from ..request import GroupKey, ProgressEvent
from .request_state import RequestState

logger = logging.getLogger(__name__)

SD_VAE_CHANNELS = [128, 256, 512, 512]  # the SD1.x / SD2.x / SDXL VAE's block_out_channels
FIT_SAMPLES = 4


@dataclass(frozen=True)
class LatentRGB:
    """pixels in [0, 1] = latents (channels) @ weight + bias, per latent cell."""

    weight: np.ndarray  # [C, 3]
    bias: np.ndarray    # [3]
    source: str         # "published" | "fitted"

    @classmethod
    def published(cls, factors: tuple) -> "LatentRGB":  # [-1, 1] -> [0, 1]
        return cls(np.asarray(factors, np.float32) / 2, np.full(3, 0.5, np.float32), "published")


class PreviewRunner(Protocol):
    """What previews need of the model runner (engine/model_runner.py)."""

    cuda: bool
    device: torch.device
    model: DiffusionModel

    def buffers(self, key: GroupKey): ...
    def latent_shape(self, key: GroupKey) -> tuple[int, ...]: ...
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor: ...
    def on_device(self): ...


def published_factors(factors: tuple | None, vae_config: object, is_random: bool) -> LatentRGB | None:
    """The family's published factors where the model has the SD VAE architecture with trained weights, else
    None (then they are fitted)."""
    if factors is None or is_random or list(getattr(vae_config, "block_out_channels", ())) != SD_VAE_CHANNELS \
            or getattr(vae_config, "latent_channels", None) != len(factors):
        return None
    return LatentRGB.published(factors)


def fit_factors(runner: PreviewRunner, key: GroupKey, seed: int = 0) -> LatentRGB:
    """Least-squares factors for the runner's VAE at resolution `key`: random latents decoded, each latent cell's
    mean pixel regressed on its channels (with a bias)."""
    shape = runner.latent_shape(key)
    g = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn((FIT_SAMPLES, *shape), generator=g)
    with torch.no_grad():
        pixels = runner.decode_pixels(latents.to(runner.device)).float().cpu()  # [n, 3, H, W] in [0, 1]
    cells = torch.nn.functional.adaptive_avg_pool2d(pixels, shape[1:])          # [n, 3, h, w]
    x = latents.permute(0, 2, 3, 1).reshape(-1, shape[0]).double().numpy()
    y = cells.permute(0, 2, 3, 1).reshape(-1, 3).double().numpy()
    a = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    solution, *_ = np.linalg.lstsq(a, y, rcond=None)
    return LatentRGB(solution[:-1].astype(np.float32), solution[-1].astype(np.float32), "fitted")


def render(runner: PreviewRunner, key: GroupKey, start: int, count: int, rgb: LatentRGB
           ) -> Callable[[], np.ndarray]:
    """Enqueues the preview of rows [start, start + count) of group `key` (their D); returns a waiter giving uint8
    pixels [count, h, w, 3]. Nothing waits for the device here."""
    d = runner.buffers(key).d_prev[start:start + count]
    weight = torch.from_numpy(rgb.weight).to(d.device, non_blocking=True)
    bias = torch.from_numpy(rgb.bias).to(d.device, non_blocking=True)
    pixels = torch.einsum("nchw,cr->nhwr", d.float(), weight) + bias
    pixels = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
    if not runner.cuda:
        host = pixels.numpy()
        return lambda: host
    host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(pixels, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(runner.device))

    def wait() -> np.ndarray:
        with runner.on_device():
            event.synchronize()
        return host.numpy()
    return wait


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt.upper(), **({"quality": 85} if fmt != "png" else {}))
    return out.getvalue()


class PreviewMaker:
    """One runner's previews: its factors (published, or fitted once) and the preview thread."""

    def __init__(self, runner: PreviewRunner, published: LatentRGB | None):
        self.runner = runner
        self._rgb = published
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffgraph-previews")
        self.sent = 0  # preview events sent (a counter for tests and metrics)

    @classmethod
    def of(cls, runner: "PreviewRunner") -> "PreviewMaker":
        model = runner.model
        return cls(runner, published_factors(model.adapter.preview_factors, model.vae.config, model.is_random))

    def factors(self, key: GroupKey) -> LatentRGB:
        if self._rgb is None:
            self._rgb = fit_factors(self.runner, key)
        return self._rgb

    def capture(self, key: GroupKey, live: list[RequestState]) -> None:
        """On the loop thread after a step: previews of the live requests whose step brings one."""
        for s in live:
            spec = s.request.preview if s.request is not None else None
            if spec is None or not spec.due(s.step):
                continue
            try:
                wait = render(self.runner, key, s.first_row, s.rows, self.factors(key))
                s.preview_future = self._pool.submit(self._send, s, wait, s.step, s.steps, spec.format)
            except Exception:  # a preview must never fail the request or the step
                logger.exception("preview of %s failed", s.request_id)

    def _send(self, s: RequestState, wait: Callable[[], np.ndarray], step: int, total: int, fmt: str) -> None:
        try:
            images = tuple(encode(p, fmt) for p in wait())
            s.sink.progress(ProgressEvent(s.request_id, step, total, images, fmt))
            self.sent += 1
        except Exception:
            logger.exception("preview of %s failed", s.request_id)

    @staticmethod
    def settle(s: RequestState) -> None:
        """Waits until the request's last preview is sent (before its result goes)."""
        future: Future | None = s.preview_future
        if future is not None:
            try:
                future.result()
            except Exception:  # cancelled at close: the result goes anyway
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
