"""The worker owns the model on its device: prompt encoding, per-group row buffers, steps, VAE decode.

The engine (and later the scheduler) decides which rows run; the worker only executes: it writes a
request's rows into a group's static buffers, runs one whole step for rows [0, n) of a group (as a
CUDA-graph replay when a runner is attached and covers the shape, eagerly otherwise) and decodes
finished latents to float pixels. Nothing here knows about requests' lifetimes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..graphs.step import StepBuffers, whole_step
from ..models.conditioning import PromptEmbeddings, PromptEncoder, add_time_ids
from ..models.loader import DiffusionModel
from ..sampling.schedules import NoiseSchedule

GroupKey = tuple[int, int]  # (height, width) in pixels


class Worker:
    def __init__(self, model: DiffusionModel, max_rows: int = 16):
        self.model = model
        self.max_rows = max_rows
        self.encoder = PromptEncoder(model)
        self.noise_schedule = NoiseSchedule.from_config(model.scheduler_config)
        self.groups: dict[GroupKey, StepBuffers] = {}
        self.runner = None  # a GraphRunner, attached by the engine in graph mode

    # -- shapes --------------------------------------------------------------------------------
    def latent_shape(self, key: GroupKey) -> tuple[int, int, int]:
        f = self.model.vae_scale_factor
        return (self.model.latent_channels, key[0] // f, key[1] // f)

    def buffers(self, key: GroupKey) -> StepBuffers:
        """The static buffers of a resolution group, allocated once at max_rows."""
        buf = self.groups.get(key)
        if buf is None:
            unet_cfg = self.model.unet.config
            pooled = self.model.text_encoders[-1].config.projection_dim if self.model.family == "sdxl" else None
            seq = self.model.tokenizers[0].model_max_length
            buf = StepBuffers.allocate(self.max_rows, self.latent_shape(key), (seq, int(unet_cfg.cross_attention_dim)),
                                       pooled, self.model.dtype, self.model.device)
            self.groups[key] = buf
        return buf

    # -- rows ----------------------------------------------------------------------------------
    def write_rows(self, key: GroupKey, start: int, latents: torch.Tensor, cond: PromptEmbeddings,
                   uncond: PromptEmbeddings, guidance: float) -> None:
        """Fills rows [start, start+k) with initial latents and one prompt's embeddings (broadcast)."""
        buf = self.buffers(key)
        k = latents.shape[0]
        rows = slice(start, start + k)
        buf.x[rows] = latents.to(buf.x.device, torch.float32)
        buf.d_prev[rows] = 0
        buf.noise[rows] = 0
        buf.coefs[rows] = 0
        # diffusers skips CFG when guidance <= 1 (only the text branch runs): scale 1 selects it.
        buf.guidance[rows] = guidance if guidance > 1 else 1.0
        buf.cond[rows] = cond.embeds
        buf.uncond[rows] = uncond.embeds
        if buf.pooled_cond is not None:
            buf.pooled_cond[rows] = cond.pooled
            buf.pooled_uncond[rows] = uncond.pooled
            buf.time_ids[rows] = torch.tensor(add_time_ids(*key), dtype=buf.time_ids.dtype)

    def step(self, key: GroupKey, n: int, coefs: np.ndarray, noise: torch.Tensor | None,
             noise_rows: np.ndarray | None = None) -> None:
        """Runs one step for rows [0, n). coefs: [n, NUM_COEFS]; noise: [m, C, h, w] for rows noise_rows (or all)."""
        buf = self.buffers(key)
        buf.coefs[:n] = torch.from_numpy(np.ascontiguousarray(coefs, dtype=np.float32)).to(buf.coefs.device)
        if noise is not None:
            if noise_rows is None:
                buf.noise[:n] = noise.to(buf.noise.device, torch.float32)
            else:
                buf.noise[torch.as_tensor(noise_rows, device=buf.noise.device)] = noise.to(buf.noise.device, torch.float32)
        with torch.no_grad():
            if self.runner is not None and self.runner.can_run(key, n):
                self.runner.replay(key, n)
            else:
                if self.runner is not None:
                    self.runner.record_eager(key, n)
                whole_step(self.model.unet, buf, n)

    def read_latents(self, key: GroupKey, start: int, count: int) -> torch.Tensor:
        return self.buffers(key).x[start:start + count].clone()

    # -- decode --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents -> float pixels in [0, 1], [n, H, W, 3], as diffusers' VaeImageProcessor with output_type='np'."""
        vae = self.model.vae
        latents = latents.to(self.model.device, self.model.vae_dtype)
        mean = getattr(vae.config, "latents_mean", None)
        std = getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            c = latents.shape[1]
            mean_t = torch.tensor(mean, device=latents.device, dtype=latents.dtype).view(1, c, 1, 1)
            std_t = torch.tensor(std, device=latents.device, dtype=latents.dtype).view(1, c, 1, 1)
            latents = latents * std_t / vae.config.scaling_factor + mean_t
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        image = (image * 0.5 + 0.5).clamp(0, 1)
        return image.cpu().permute(0, 2, 3, 1).float().numpy()
