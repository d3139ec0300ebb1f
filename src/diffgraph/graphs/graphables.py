"""The three kinds of graphs a worker captures: the whole step, the text encoder(s), the VAE decoder.

Each is a function over static buffers (see runner.Graphable). The step graph reads and writes the
worker's per-group StepBuffers; the text and VAE graphs own their static inputs, allocated once at
their largest bucket, and return outputs that live in the shared pool, which the worker copies out
right after the replay (the next replay of any graph may overwrite them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .runner import StatelessGraphable
from .step import whole_step

if TYPE_CHECKING:
    from ..engine.worker import Worker


class StepGraph:
    kind = "step"

    def __init__(self, worker: "Worker", resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...]):
        self.worker = worker
        self._resolutions = resolutions
        self._buckets = buckets

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self._resolutions

    def run(self, h: int, w: int, b: int) -> None:
        whole_step(self.worker.model.unet, self.worker.buffers((h, w)), b)

    def snapshot(self, h: int, w: int, b: int) -> Any:
        buf = self.worker.buffers((h, w))
        return {name: t[:b].clone() for name, t in buf.tensors().items()}

    def restore(self, h: int, w: int, b: int, snap: Any) -> None:
        buf = self.worker.buffers((h, w))
        for name, t in buf.tensors().items():
            t[:b].copy_(snap[name])

    def verify_inputs(self, h: int, w: int, b: int) -> None:
        """Representative inputs for verification: noisy latents at a mid-schedule Euler step, CFG 7.5."""
        from ..sampling.samplers import make_plan

        buf = self.worker.buffers((h, w))
        plan = make_plan(self.worker.noise_schedule, "dpmpp_2m", "karras", 10)
        gen = torch.Generator(device=buf.x.device).manual_seed(0)
        buf.x[:b] = torch.randn(buf.x[:b].shape, generator=gen, device=buf.x.device) * float(plan.sigmas[3])
        buf.d_prev[:b] = torch.randn(buf.x[:b].shape, generator=gen, device=buf.x.device)
        buf.coefs[:b] = torch.as_tensor(plan.coefs[3], dtype=torch.float32, device=buf.x.device)
        buf.guidance[:b] = 7.5

    def output(self, h: int, w: int, b: int, result: Any) -> torch.Tensor:
        return self.worker.buffers((h, w)).x[:b]


class TextGraph(StatelessGraphable):
    """Text encoder(s) at the tokenizers' length: static token ids in, (embeds, pooled) out."""

    kind = "text"

    def __init__(self, worker: "Worker", buckets: tuple[int, ...]):
        self.worker = worker
        self._buckets = buckets
        model = worker.model
        self.ids = [torch.zeros((max(buckets), t.model_max_length), dtype=torch.long, device=model.device)
                    for t in model.tokenizers]

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return ((0, 0),)

    def write(self, ids: list[torch.Tensor], bucket: int) -> None:
        n = ids[0].shape[0]
        for static, new in zip(self.ids, ids):
            static[:n].copy_(new, non_blocking=True)
            static[n:bucket] = static[0]  # padding rows: a copy of a real row, always a valid input

    def run(self, h: int, w: int, b: int) -> Any:
        out = self.worker.encoder.encode_ids([ids[:b] for ids in self.ids])
        return out.embeds, out.pooled



class VaeGraph(StatelessGraphable):
    """VAE decoder per (resolution, bucket): static latents in, float pixels [b, 3, H, W] in [0, 1] out."""

    kind = "vae"

    def __init__(self, worker: "Worker", resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...]):
        self.worker = worker
        self._resolutions = resolutions
        self._buckets = buckets
        self.latents: dict[tuple[int, int], torch.Tensor] = {}

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self._resolutions

    def static_latents(self, h: int, w: int) -> torch.Tensor:
        t = self.latents.get((h, w))
        if t is None:
            model = self.worker.model
            t = torch.zeros((max(self._buckets), *self.worker.latent_shape((h, w))), dtype=model.vae_dtype,
                            device=model.device)
            self.latents[(h, w)] = t
        return t

    def verify_inputs(self, h: int, w: int, b: int) -> None:
        gen = torch.Generator(device=self.worker.model.device).manual_seed(0)
        static = self.static_latents(h, w)
        static[:b] = torch.randn(static[:b].shape, generator=gen, device=static.device).to(static.dtype)

    def write(self, h: int, w: int, latents: torch.Tensor, bucket: int) -> None:
        static = self.static_latents(h, w)
        n = latents.shape[0]
        static[:n].copy_(latents)
        static[n:bucket] = 0

    def run(self, h: int, w: int, b: int) -> Any:
        return self.worker.decode_tensor(self.static_latents(h, w)[:b])

