"""The kinds of graphs a model runner captures: the whole step, the text encoder(s), the VAE decoder and encoder.

Each is a function over static buffers (see runner.Graphable). They import nothing from the engine: the model
runner hands each one the functions and shapes it needs. The step graph reads and writes the runner's
per-group StepBuffers; the text and VAE graphs own their static inputs, allocated once at their largest
bucket, and return outputs that live in the shared pool, which the runner copies out right after the replay
(the next replay of any graph may overwrite them). `fn` is the callable that is captured: the eager path of
the runner calls its own eager callable, never this one, so a compiled callable put here (the compile tier)
can never be triggered by an eager fallback.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..sampling.samplers import SamplerPlan
from .runner import StatelessGraphable
from .compiled import plain
from ..features.program import StepProgram, VariantKey, layout
from .step import Denoiser, StepBuffers, step_rows, whole_step


class StepGraph:
    """The whole step of one variant of the row features' program (kind "step" for the neutral variant, e.g.
    "step_lora1" where the LoRA side paths read one adapter slot per row). A bucket is a count of denoiser rows:
    the graph runs that many image rows over that many denoiser rows (a guiding row costs two)."""

    def __init__(self, buffers: Callable[[tuple[int, int]], StepBuffers], program: StepProgram, denoise: Denoiser,
                 key: VariantKey, verify_plan: Callable[[], SamplerPlan], resolutions: Sequence[tuple[int, int]],
                 buckets: tuple[int, ...], step_fn: Callable[..., None] = step_rows, kind: str | None = None):
        self.kind = kind or program.kind(key)  # another kind: the same step over other groups' buffers (tiling)
        self.key = key
        self._program = program
        self._step = step_fn  # step_rows, or the compile tier's compiled step_rows
        self._buffers = buffers
        self.fn = denoise
        self._verify_plan = verify_plan
        self._resolutions = resolutions
        self._buckets = buckets

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._resolutions)  # (a list its owner extends: the step graphs' shared groups)

    def run(self, h: int, w: int, b: int) -> None:
        buf = self._buffers((h, w)).head(b, self._program.tokens(self.key), self._program.unread(self.key))
        self._step(self.fn, buf, self._program, self._program.code_key(self.key))

    def run_reference(self, h: int, w: int, b: int) -> None:
        """The uncompiled step on the same buffers (what verification compares a replay with)."""
        whole_step(self._program, self.fn, self._buffers((h, w)), b, b, self.key)

    def snapshot(self, h: int, w: int, b: int) -> Any:
        return {name: t[:b].clone() for name, t in self._buffers((h, w)).tensors().items()}

    def restore(self, h: int, w: int, b: int, snap: Any) -> None:
        for name, t in self._buffers((h, w)).tensors().items():
            t[:b].copy_(snap[name])

    def verify_inputs(self, h: int, w: int, b: int) -> None:
        """Representative inputs for verification: noisy latents at a mid-schedule step of the family's default
        sampler; the first b // 2 rows guide (CFG 7.5, two denoiser rows each), the rest run one branch."""
        buf = self._buffers((h, w))
        plan = self._verify_plan()
        gen = torch.Generator(device=buf.x.device).manual_seed(0)
        step = min(3, plan.num_steps - 1)
        buf.x[:b] = torch.randn(buf.x[:b].shape, generator=gen, device=buf.x.device) * float(plan.sigmas[step])
        buf.d_prev[:b] = torch.randn(buf.x[:b].shape, generator=gen, device=buf.x.device)
        buf.coefs[:b, :plan.coefs.shape[1]] = torch.as_tensor(plan.coefs[step], dtype=torch.float32,
                                                               device=buf.x.device)
        guiding = b // 2 if self._program.alt is not None else 0
        columns = self._program.columns
        if "guidance" in columns:
            buf.coefs[:b, columns["guidance"]] = 1.0
            buf.coefs[:guiding, columns["guidance"]] = 7.5
        rows = [(r, 1, 2 if r < guiding else 1) for r in range(b - guiding)]
        buf.index[:b] = torch.as_tensor(layout(rows, b), device=buf.x.device)

    def output(self, h: int, w: int, b: int, result: Any) -> torch.Tensor:
        return self._buffers((h, w)).x[:b]


class TextGraph(StatelessGraphable):
    """Text encoder(s) at the tokenizers' length: static token ids in, the conditioning fields out."""

    kind = "text"

    def __init__(self, encode_ids: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]],
                 token_lengths: list[int], device: torch.device, buckets: tuple[int, ...]):
        self.fn = encode_ids
        self._buckets = buckets
        self.ids = [torch.zeros((max(buckets), n), dtype=torch.long, device=device) for n in token_lengths]

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
        return self.fn([ids[:b] for ids in self.ids])

    def run_reference(self, h: int, w: int, b: int) -> Any:
        return plain(self.fn)([ids[:b] for ids in self.ids])


class VaeGraph(StatelessGraphable):
    """VAE decoder per (resolution, bucket): static latents in, float pixels [b, 3, H, W] in [0, 1] out.
    (`input_shape` gives the static input's per-row shape of a resolution; `kind`: another kind of the same shapes,
    such as the tiling groups' decoder.)"""

    kind = "vae"

    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor],
                 input_shape: Callable[[tuple[int, int]], tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device, resolutions: tuple[tuple[int, int], ...], buckets: tuple[int, ...],
                 kind: str | None = None):
        self.kind = kind or self.kind
        self.fn = decode
        self._latent_shape = input_shape
        self._dtype = dtype
        self._device = device
        self._resolutions = resolutions
        self._buckets = buckets
        self.latents: dict[tuple[int, int], torch.Tensor] = {}

    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self._resolutions

    def like(self, fn: Callable[[torch.Tensor], torch.Tensor], kind: str) -> "VaeGraph":
        """A graph of kind `kind` of the same class, shapes and buckets over another callable (static inputs of its
        own)."""
        return type(self)(fn, self._latent_shape, self._dtype, self._device, self._resolutions, self._buckets, kind)

    def static_latents(self, h: int, w: int) -> torch.Tensor:
        t = self.latents.get((h, w))
        if t is None:
            t = torch.zeros((max(self._buckets), *self._latent_shape((h, w))), dtype=self._dtype, device=self._device)
            self.latents[(h, w)] = t
        return t

    def verify_inputs(self, h: int, w: int, b: int) -> None:
        gen = torch.Generator(device=self._device).manual_seed(0)
        static = self.static_latents(h, w)
        static[:b] = torch.randn(static[:b].shape, generator=gen, device=static.device).to(static.dtype)

    def write(self, h: int, w: int, latents: torch.Tensor, bucket: int) -> None:
        static = self.static_latents(h, w)
        n = latents.shape[0]
        static[:n].copy_(latents)
        static[n:bucket] = 0

    def run(self, h: int, w: int, b: int) -> Any:
        return self.fn(self.static_latents(h, w)[:b])

    def run_reference(self, h: int, w: int, b: int) -> Any:
        return plain(self.fn)(self.static_latents(h, w)[:b])


class VaeEncodeGraph(VaeGraph):
    """VAE encoder per (resolution, bucket): static pixels [b, 3, H, W] in [-1, 1] in, the posterior's parameters
    [b, 2C, h, w] out (image-to-image and inpainting inputs; sampling happens outside, from the request's
    generator)."""

    kind = "vae_encode"
