"""The whole denoising step over static per-row buffers: input scaling, UNet, CFG, sampler update.

`StepBuffers` holds every tensor one step reads or writes for the rows of one resolution group,
allocated once at the largest batch bucket; `whole_step(unet, buffers, n)` runs rows [0, n) and
writes x and D_prev in place. The same function runs eagerly and under CUDA-graph capture, so the
two paths cannot drift apart. Rows carry their own coefficients (see sampling.samplers), so rows at
different steps, with different samplers and guidance, share one call. Padding rows (coefficients
all zero) produce x = 0 and stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..sampling.samplers import NUM_COEFS, Coef


@dataclass
class StepBuffers:
    """Per-row inputs and state of one resolution group; first dimension = rows."""

    x: torch.Tensor          # [B, C, h, w] fp32: the row's latent in its sampler's state space
    d_prev: torch.Tensor     # [B, C, h, w] fp32: the previous step's denoised prediction
    noise: torch.Tensor      # [B, C, h, w] fp32: this step's ancestral noise (zeros where unused)
    coefs: torch.Tensor      # [B, NUM_COEFS] fp32: this step's coefficients per row
    guidance: torch.Tensor   # [B] fp32: effective CFG scale per row
    cond: torch.Tensor       # [B, 77, E] model dtype
    uncond: torch.Tensor     # [B, 77, E] model dtype
    pooled_cond: torch.Tensor | None = None    # [B, P] SDXL
    pooled_uncond: torch.Tensor | None = None  # [B, P] SDXL
    time_ids: torch.Tensor | None = None       # [B, 6] SDXL

    @classmethod
    def allocate(cls, rows: int, latent_shape: tuple[int, int, int], embed_shape: tuple[int, int],
                 pooled_dim: int | None, dtype: torch.dtype, device: torch.device) -> "StepBuffers":
        def z(*shape, dt=torch.float32):
            return torch.zeros(shape, dtype=dt, device=device)
        sdxl = pooled_dim is not None
        return cls(
            x=z(rows, *latent_shape), d_prev=z(rows, *latent_shape), noise=z(rows, *latent_shape),
            coefs=z(rows, NUM_COEFS), guidance=z(rows),
            cond=z(rows, *embed_shape, dt=dtype), uncond=z(rows, *embed_shape, dt=dtype),
            pooled_cond=z(rows, pooled_dim, dt=dtype) if sdxl else None,
            pooled_uncond=z(rows, pooled_dim, dt=dtype) if sdxl else None,
            time_ids=z(rows, 6, dt=dtype) if sdxl else None,
        )

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def move_rows(self, src: int, dst: int, count: int) -> None:
        """Copies rows [src, src+count) to [dst, dst+count) in every buffer (compaction)."""
        if src == dst or count == 0:
            return
        for t in self.tensors().values():
            t[dst:dst + count] = t[src:src + count].clone()


def whole_step(unet: torch.nn.Module, buf: StepBuffers, n: int) -> None:
    """One denoising step for rows [0, n): x <- a*x + b*D + c*D_prev + d*noise, D <- p*x + q*out."""
    x = buf.x[:n]
    co = buf.coefs[:n]

    def col(c: Coef) -> torch.Tensor:
        return co[:, int(c)].view(n, 1, 1, 1)

    dtype = buf.cond.dtype
    x_in = (x * col(Coef.C_IN)).to(dtype)
    t = co[:, int(Coef.T)]
    added = None
    if buf.pooled_cond is not None:
        time_ids = buf.time_ids[:n]
        added = {"text_embeds": torch.cat([buf.pooled_uncond[:n], buf.pooled_cond[:n]]),
                 "time_ids": torch.cat([time_ids, time_ids])}
    out = unet(
        torch.cat([x_in, x_in]), torch.cat([t, t]),
        encoder_hidden_states=torch.cat([buf.uncond[:n], buf.cond[:n]]),
        added_cond_kwargs=added, return_dict=False,
    )[0].float()
    out_uncond, out_cond = out.chunk(2)
    guided = out_uncond + buf.guidance[:n].view(n, 1, 1, 1) * (out_cond - out_uncond)
    denoised = col(Coef.P) * x + col(Coef.Q) * guided
    x_next = col(Coef.A) * x + col(Coef.B) * denoised + col(Coef.C) * buf.d_prev[:n] + col(Coef.D) * buf.noise[:n]
    x.copy_(x_next)
    buf.d_prev[:n].copy_(denoised)
