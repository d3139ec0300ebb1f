"""The whole denoising step over static per-row buffers: input scaling, denoiser, CFG, sampler update.

`StepBuffers` holds every tensor one step reads or writes for the rows of one resolution group, allocated
once at the largest batch bucket (the model runner owns them); its conditioning fields are whatever the
model's family adapter declares (`cond_spec`, `row_spec`). `whole_step(denoise, buffers, n)` runs rows [0, n)
and writes x and D_prev in place; `denoise(x, t, cond, rows)` is the family's capturable denoiser call.
The same function runs eagerly and under CUDA-graph capture, so the two paths cannot drift apart, and its
update is `sampling.samplers.apply_step`, the tested reference itself. Rows carry their own coefficients, so
rows at different steps, with different samplers and guidance, share one call. Padding rows (coefficients
all zero) produce x = 0 and stay finite.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..sampling.samplers import NUM_COEFS, Coef, apply_step

# (model input [2n, C, h, w], timesteps [2n], conditioning fields [2n, ...], per-row fields [2n, ...]) -> output
Denoiser = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class StepBuffers:
    """Per-row inputs and state of one resolution group; first dimension = rows."""

    x: torch.Tensor          # [B, C, h, w] fp32: the row's latent in its sampler's state space
    d_prev: torch.Tensor     # [B, C, h, w] fp32: the previous step's denoised prediction
    noise: torch.Tensor      # [B, C, h, w] fp32: this step's ancestral noise (zeros where unused)
    coefs: torch.Tensor      # [B, NUM_COEFS] fp32: this step's coefficients per row
    guidance: torch.Tensor   # [B] fp32: effective CFG scale per row
    cond: dict[str, torch.Tensor]    # family conditioning fields, text branch: name -> [B, ...]
    uncond: dict[str, torch.Tensor]  # the same fields, unconditional (negative prompt) branch
    rows: dict[str, torch.Tensor]    # per-row fields shared by both branches (SDXL time ids)
    dtype: torch.dtype               # the denoiser's input dtype
    # inpainting (4-channel denoisers): after the update, x <- (1 - mask) * known-at-next-state + mask * x.
    # mask is 1 (repaint everything: no blend) for every other row, which leaves x exactly as updated.
    mask: torch.Tensor | None = None     # [B, 1, h, w] fp32, 1 = repaint
    known: torch.Tensor | None = None    # [B, C, h, w] fp32: the image's latents
    noise0: torch.Tensor | None = None   # [B, C, h, w] fp32: the row's initial noise
    extra: torch.Tensor | None = None    # [B, E, h, w]: extra denoiser input channels (9-channel inpainting
                                         # UNets: the mask and the masked image's latents), or None
    # LoRA side paths (engines with adapter slots): per row, the slots (0 = none) and scales of its adapters
    lora_idx: torch.Tensor | None = None    # [B, K] int64
    lora_scale: torch.Tensor | None = None  # [B, K] fp32

    @classmethod
    def allocate(cls, rows: int, latent_shape: tuple[int, ...],
                 cond_spec: dict[str, tuple[tuple[int, ...], torch.dtype]], row_values: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, extra_channels: int = 0,
                 lora_stack: int = 0) -> "StepBuffers":
        def z(*shape, dt=torch.float32):
            return torch.zeros(shape, dtype=dt, device=device)
        return cls(
            x=z(rows, *latent_shape), d_prev=z(rows, *latent_shape), noise=z(rows, *latent_shape),
            coefs=z(rows, NUM_COEFS), guidance=z(rows),
            cond={k: z(rows, *shape, dt=dt) for k, (shape, dt) in cond_spec.items()},
            uncond={k: z(rows, *shape, dt=dt) for k, (shape, dt) in cond_spec.items()},
            rows={k: z(rows, *v.shape, dt=v.dtype) for k, v in row_values.items()},
            dtype=dtype,
            mask=torch.ones((rows, 1, *latent_shape[1:]), dtype=torch.float32, device=device),
            known=z(rows, *latent_shape), noise0=z(rows, *latent_shape),
            extra=z(rows, extra_channels, *latent_shape[1:], dt=dtype) if extra_channels else None,
            lora_idx=z(rows, lora_stack, dt=torch.int64) if lora_stack else None,
            lora_scale=z(rows, lora_stack) if lora_stack else None,
        )

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-row tensor by a flat name (snapshots, compaction)."""
        out = {"x": self.x, "d_prev": self.d_prev, "noise": self.noise, "coefs": self.coefs,
               "guidance": self.guidance}
        for name in ("mask", "known", "noise0", "extra", "lora_idx", "lora_scale"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for prefix, fields in (("cond", self.cond), ("uncond", self.uncond), ("rows", self.rows)):
            out.update({f"{prefix}.{k}": v for k, v in fields.items()})
        return out

    def head(self, n: int) -> "StepBuffers":
        """The same buffers, rows [0, n) only (views: writes reach the full buffers)."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:n]
        return dataclasses.replace(
            self, x=self.x[:n], d_prev=self.d_prev[:n], noise=self.noise[:n], coefs=self.coefs[:n],
            guidance=self.guidance[:n], cond={k: v[:n] for k, v in self.cond.items()},
            uncond={k: v[:n] for k, v in self.uncond.items()}, rows={k: v[:n] for k, v in self.rows.items()},
            mask=cut(self.mask), known=cut(self.known), noise0=cut(self.noise0), extra=cut(self.extra),
            lora_idx=cut(self.lora_idx), lora_scale=cut(self.lora_scale))

    def move_rows(self, src: int, dst: int, count: int) -> None:
        """Copies rows [src, src+count) to [dst, dst+count) in every buffer (compaction)."""
        if src == dst or count == 0:
            return
        for t in self.tensors().values():
            t[dst:dst + count] = t[src:src + count].clone()


def whole_step(denoise: Denoiser, buf: StepBuffers, n: int, loras: Any = None, stack: int = 0) -> None:
    """One denoising step for rows [0, n): D <- p*x + q*out, x <- a*x + b*D + c*D_prev + d*noise, then the
    inpainting blend of the known region (a no-op for rows whose mask is all ones). With `stack` > 0 the denoiser's
    LoRA side paths (`loras`, a lora.sidepath.RowLoras) read the first `stack` adapter slots of each row; with 0
    they are skipped (the variant for steps where no row uses an adapter)."""
    if stack:
        idx, scale = buf.lora_idx[:n, :stack], buf.lora_scale[:n, :stack]
        loras.set(torch.cat([idx, idx]), torch.cat([scale, scale]))  # both CFG branches use the row's adapters
        try:
            _step(denoise, buf, n)
        finally:
            loras.set(None, None)
    else:
        _step(denoise, buf, n)


def step_rows(denoise: Denoiser, buf: StepBuffers, loras: Any = None, stack: int = 0) -> None:
    """`whole_step` over every row of `buf` (a `StepBuffers.head` view): what the step graphs capture. The row count
    is the buffers' first dimension, not a Python int, so the compile tier compiles one step for every bucket above
    1 of a resolution (that dimension marked dynamic) instead of one per bucket."""
    whole_step(denoise, buf, buf.x.shape[0], loras, stack)


def _step(denoise: Denoiser, buf: StepBuffers, n: int) -> None:
    x = buf.x[:n]
    co = buf.coefs[:n]
    x_in = (x * co[:, int(Coef.C_IN)].view(n, 1, 1, 1)).to(buf.dtype)
    if buf.extra is not None:
        x_in = torch.cat([x_in, buf.extra[:n]], dim=1)
    t = co[:, int(Coef.T)]
    cond = {k: torch.cat([buf.uncond[k][:n], buf.cond[k][:n]]) for k in buf.cond}
    rows = {k: torch.cat([v[:n], v[:n]]) for k, v in buf.rows.items()}
    out = denoise(torch.cat([x_in, x_in]), torch.cat([t, t]), cond, rows).float()
    out_uncond, out_cond = out.chunk(2)
    guided = out_uncond + buf.guidance[:n].view(n, 1, 1, 1) * (out_cond - out_uncond)
    x_next, denoised = apply_step(co, x, guided, buf.d_prev[:n], buf.noise[:n])
    if buf.mask is not None:
        m = buf.mask[:n]
        known = (co[:, int(Coef.KNOWN)].view(n, 1, 1, 1) * buf.known[:n]
                 + co[:, int(Coef.KNOWN_NOISE)].view(n, 1, 1, 1) * buf.noise0[:n])
        x_next = (1 - m) * known + m * x_next
    x.copy_(x_next)
    buf.d_prev[:n].copy_(denoised)
