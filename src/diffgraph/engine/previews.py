"""Live previews: a small image of a row's current denoised prediction, every K steps, for the requests that ask.

Owns: the latent-to-RGB factors of a model (`LatentRGB`), the preview render on the device and the preview thread
that encodes and sends them. The render is a linear map of the rows' D (the step's `d_prev` field after the step:
the denoised prediction the sampler just used) to RGB at latent resolution, AUTOMATIC1111's "Approx cheap":
  * its published factors for the SD1.x/SD2.x and SDXL latent spaces (the family adapter's `preview_factors`), for
    a checkpoint with their VAE architecture and trained weights;
  * for any other model (the `digits` presets, random-weight presets, other VAEs) factors fitted by least squares
    to the model's own VAE: random latents decoded once, the pixels averaged over each latent cell; fitted at the
    model's first preview and kept by the runner's `PreviewMaker` (one decode of four small latents).
With a tiny decoder (`Engine(preview_decoder=DIR)`, `--preview-decoder DIR`: TAESD / TAESDXL as diffusers'
AutoencoderTiny folders) the previews are that decoder's full-resolution images instead, through its own small CUDA
graphs (kind "preview", per resolution and bucket 1, 2, 4, captured with the others at start-up).
It runs between steps on the loop thread, after the step and outside its graphs: an einsum (or the tiny decoder's
replay) over the asking rows only, a copy to pinned host memory and an event (nothing waits for the GPU); the preview thread waits for the event,
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

from ..graphs.runner import GraphRunner
from ..models.model import DiffusionModel
from ..models.stream_load import load_part
from ..models.weights_view import UnreadableWeights
from ..request import GroupKey, ProgressEvent, Size
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
    graph_runner: GraphRunner | None

    def buffers(self, key: GroupKey): ...
    def image_latent_shape(self, size: Size) -> tuple[int, ...]: ...
    def image_latents(self, rows: torch.Tensor, key: GroupKey, size: Size) -> torch.Tensor: ...
    def graphed_sizes(self) -> tuple[Size, ...]: ...
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor: ...
    def on_device(self): ...


def published_factors(factors: tuple | None, vae_config: object, is_random: bool) -> LatentRGB | None:
    """The family's published factors where the model has the SD VAE architecture with trained weights, else
    None (then they are fitted)."""
    if factors is None or is_random or list(getattr(vae_config, "block_out_channels", ())) != SD_VAE_CHANNELS \
            or getattr(vae_config, "latent_channels", None) != len(factors):
        return None
    return LatentRGB.published(factors)


def fit_factors(runner: PreviewRunner, size: Size, seed: int = 0) -> LatentRGB:
    """Least-squares factors for the runner's VAE at image `size`: random latents decoded, each latent cell's
    mean pixel regressed on its channels (with a bias)."""
    shape = runner.image_latent_shape(size)
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


def render(runner: PreviewRunner, key: GroupKey, size: Size, start: int, count: int, weight: torch.Tensor,
           bias: torch.Tensor) -> Callable[[], np.ndarray]:
    """Enqueues the preview of rows [start, start + count) of group `key` (their D), images of `size`, with factors
    already on the device; returns a waiter giving uint8 pixels [count, h, w, 3]. Nothing waits for the device here."""
    d = runner.image_latents(runner.buffers(key).d_prev[start:start + count], key, size)
    pixels = torch.einsum("nchw,cr->nhwr", d.float(), weight) + bias
    return _to_host(runner, (pixels.clamp(0, 1) * 255).round().to(torch.uint8))


class TinyDecoder:
    """A TAESD-style decoder (diffusers' AutoencoderTiny) for previews at full resolution, with its graphs."""

    def __init__(self, folder: str, runner: PreviewRunner, buckets: tuple[int, ...] = (1, 2, 4)):
        from diffusers import AutoencoderTiny

        model = runner.model
        try:  # streamed, checked: never a map of the user's file
            self.module = load_part(AutoencoderTiny, folder, f"--preview-decoder {folder!r}")
        except UnreadableWeights:
            raise
        except (OSError, ValueError) as e:
            raise ValueError(f"--preview-decoder {folder!r} is not a diffusers AutoencoderTiny folder (TAESD / "
                             f"TAESDXL: config.json and diffusion_pytorch_model.safetensors): {e}") from None
        channels = self.module.config.latent_channels
        if channels != model.vae.config.latent_channels:
            raise ValueError(f"--preview-decoder {folder!r} decodes {channels}-channel latents but {model.name} makes "
                             f"{model.vae.config.latent_channels}-channel ones; use the tiny decoder of its family "
                             "(TAESD for SD1.x/SD2.x, TAESDXL for SDXL)")
        self.module.to(runner.device, model.vae_dtype)
        self.runner, self.dtype, self.graph = runner, model.vae_dtype, None
        graphs = runner.graph_runner
        if graphs is not None:  # its own small graphs beside the decoder's, captured with them
            from ..graphs.graphables import VaeGraph

            self.graph = VaeGraph(self._pixels, runner.image_latent_shape, self.dtype, runner.device,
                                  runner.graphed_sizes(), buckets)
            self.graph.kind = "preview"
            graphs.register(self.graph)

    @torch.no_grad()
    def _pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents -> uint8 pixels [n, H, W, 3] (AutoencoderTiny decodes to [-1, 1]; its scale is 1)."""
        image = self.module.decode(latents.to(self.dtype)).sample
        return ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)

    def render(self, key: GroupKey, size: Size, start: int, count: int) -> Callable[[], np.ndarray]:
        d = self.runner.image_latents(self.runner.buffers(key).d_prev[start:start + count], key, size)
        graphs, parts = self.runner.graph_runner, []
        chunk = max(self.graph.buckets()) if self.graph is not None else count  # the largest graph's rows at once
        for i in range(0, count, chunk):
            part = d[i:i + chunk]
            bucket = graphs.bucket("preview", size[0], size[1], part.shape[0]) if graphs is not None else None
            if bucket is None:
                parts.append(self._pixels(part))
            else:
                self.graph.write(size[0], size[1], part.to(self.dtype), bucket)
                parts.append(graphs.replay("preview", size[0], size[1], bucket)[:part.shape[0]].clone())
        return _to_host(self.runner, torch.cat(parts))


def _to_host(runner: PreviewRunner, pixels: torch.Tensor) -> Callable[[], np.ndarray]:
    """uint8 pixels on the device -> a waiter for them on the host (pinned, behind an event: nothing waits here)."""
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
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None  # the factors, copied once
        self.decoder: TinyDecoder | None = None  # full-resolution previews instead (use_decoder)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffgraph-previews")
        self.sent = 0  # preview events sent (a counter for tests and metrics)

    @classmethod
    def of(cls, runner: "PreviewRunner") -> "PreviewMaker":
        model = runner.model
        return cls(runner, published_factors(model.adapter.preview_factors, model.vae.config, model.is_random))

    def use_decoder(self, folder: str) -> None:
        """Previews from the tiny decoder in `folder` (before the graphs are captured). Raises ValueError."""
        self.decoder = TinyDecoder(folder, self.runner)

    def factors(self, size: Size) -> LatentRGB:
        if self._rgb is None:
            self._rgb = fit_factors(self.runner, size)
        return self._rgb

    def capture(self, key: GroupKey, live: list[RequestState]) -> None:
        """On the loop thread after a step: previews of the live requests whose step brings one."""
        for s in live:
            spec = s.request.preview if s.request is not None else None
            if spec is None or not spec.due(s.step, s.steps):
                continue
            try:
                if self.decoder is not None:
                    wait = self.decoder.render(key, s.size, s.first_row, s.rows)
                else:
                    if self._on_device is None:
                        rgb = self.factors(s.size)
                        self._on_device = (torch.from_numpy(rgb.weight).to(self.runner.device),
                                           torch.from_numpy(rgb.bias).to(self.runner.device))
                    wait = render(self.runner, key, s.size, s.first_row, s.rows, *self._on_device)
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
