"""The worker owns the model on its device: prompt encoding, per-group row buffers, steps, VAE decode.

The engine (later the scheduler) decides which rows run; the worker only executes: it writes a
request's rows into a group's static buffers, runs one whole step for rows [0, n) of a group and
decodes finished latents to float pixels. In graph mode each of these is a CUDA-graph replay when
the runner covers the shape (rows padded to the bucket), and eager otherwise, with identical results.
Per step the host fills one pinned coefficient table (double-buffered, guarded by an event) and
issues async copies: no allocation on the device and no synchronisation on the replay path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..config import GraphConfig
from ..graphs.graphables import StepGraph, TextGraph, VaeGraph
from ..graphs.runner import GraphRunner
from ..graphs.step import StepBuffers, whole_step
from ..models.conditioning import PromptEmbeddings, PromptEncoder, add_time_ids
from ..models.loader import DiffusionModel
from ..sampling.samplers import NUM_COEFS
from ..sampling.schedules import NoiseSchedule

GroupKey = tuple[int, int]  # (height, width) in pixels
VAE_BUCKETS = (1, 2, 4)     # decode in chunks of at most 4: a 16-image fp32 decode at 1024^2 needs tens of GB


@dataclass
class _Staging:
    """One pinned host slot: coefficient table and noise rows, with the event of its last copy."""

    coefs: torch.Tensor
    noise: torch.Tensor
    event: torch.cuda.Event | None = None


class Worker:
    def __init__(self, model: DiffusionModel, max_rows: int = 16, mode: str = "eager",
                 graphs: GraphConfig | None = None):
        self.model = model
        # the VAE that decodes: the model's own, or an fp32 copy where diffusers upcasts (SDXL in fp16)
        self.vae = model.vae if model.vae_dtype == model.dtype else copy.deepcopy(model.vae).to(model.vae_dtype)
        self.encoder = PromptEncoder(model)
        self.noise_schedule = NoiseSchedule.from_config(model.scheduler_config)
        self.groups: dict[GroupKey, StepBuffers] = {}
        self._staging: dict[GroupKey, list[_Staging]] = {}
        self._staging_turn: dict[GroupKey, int] = {}
        self._time_ids_cache: dict[GroupKey, torch.Tensor] = {}
        self.cuda = model.device.type == "cuda"
        self.runner: GraphRunner | None = None
        self.graph_config = graphs or GraphConfig()
        self.max_rows = max(max_rows, self.graph_config.max_bucket) if mode == "graph" else max_rows
        if mode == "graph":
            cfg = self.graph_config
            resolutions = cfg.resolutions or ((model.native_size, model.native_size),)
            cfg.check_prewarm(resolutions)
            self.runner = GraphRunner(cfg, model.device)
            self.runner.register(StepGraph(self, resolutions, cfg.batch_buckets))
            if cfg.capture_text_encoder and not self.encoder.needs_attention_mask:
                self.text_graph = TextGraph(self, cfg.batch_buckets)
                self.runner.register(self.text_graph)
            if cfg.capture_vae:
                self.vae_graph = VaeGraph(self, resolutions, tuple(b for b in VAE_BUCKETS if b <= cfg.max_bucket))
                self.runner.register(self.vae_graph)
        elif mode != "eager":
            raise ValueError(f"mode {mode!r} is unknown; allowed: graph, eager")

    # -- shapes and buffers --------------------------------------------------------------------
    def latent_shape(self, key: GroupKey) -> tuple[int, int, int]:
        f = self.model.vae_scale_factor
        return (self.model.latent_channels, key[0] // f, key[1] // f)

    def buffers(self, key: GroupKey) -> StepBuffers:
        """The static buffers of a resolution group, allocated once at max_rows."""
        buf = self.groups.get(key)
        if buf is None:
            pooled = self.model.text_encoders[-1].config.projection_dim if self.model.family == "sdxl" else None
            seq = self.model.tokenizers[0].model_max_length
            buf = StepBuffers.allocate(self.max_rows, self.latent_shape(key),
                                       (seq, int(self.model.unet.config.cross_attention_dim)),
                                       pooled, self.model.dtype, self.model.device)
            self.groups[key] = buf
        return buf

    def release_group(self, key: GroupKey) -> None:
        """Frees an idle group's buffers, unless graphs were captured over them (covered resolutions)."""
        if self.runner is not None and key in self.runner.kinds["step"].resolutions():
            return
        self.groups.pop(key, None)
        self._staging.pop(key, None)
        self._staging_turn.pop(key, None)
        self._time_ids_cache.pop(key, None)

    def _next_staging(self, key: GroupKey) -> _Staging:
        slots = self._staging.get(key)
        if slots is None:
            pin = self.cuda
            slots = [_Staging(torch.zeros((self.max_rows, NUM_COEFS), pin_memory=pin),
                              torch.zeros((self.max_rows, *self.latent_shape(key)), pin_memory=pin))
                     for _ in range(2)]
            self._staging[key] = slots
            self._staging_turn[key] = 0
        turn = self._staging_turn[key]
        self._staging_turn[key] = 1 - turn
        slot = slots[turn]
        if slot.event is not None:
            slot.event.synchronize()  # the copy issued from this slot two steps ago has been consumed
        return slot

    def prewarm(self) -> None:
        if self.runner is not None:
            for key in self.runner.kinds["step"].resolutions():
                self.buffers(key)
            self.runner.prewarm()

    # -- encode --------------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> PromptEmbeddings:
        """Encodes prompts, through the text-encoder graphs where they cover the batch."""
        runner = self.runner
        if runner is None or "text" not in runner.kinds:
            return self.encoder.encode(prompts)
        ids = self.encoder.tokenize(prompts)
        chunk = max(self.graph_config.batch_buckets)
        parts = []
        for start in range(0, len(prompts), chunk):
            part = [self._to_device(i[start:start + chunk]) for i in ids]
            n = part[0].shape[0]
            bucket = runner.bucket("text", 0, 0, n)
            if bucket is None:
                parts.append(self.encoder.encode_ids(part))
                continue
            self.text_graph.write(part, bucket)
            embeds, pooled = runner.replay("text", 0, 0, bucket)
            parts.append(PromptEmbeddings(embeds[:n].clone(), None if pooled is None else pooled[:n].clone()))
        if len(parts) == 1:
            return parts[0]
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        return PromptEmbeddings(torch.cat([p.embeds for p in parts]), pooled)

    def encode_negative(self, negative_prompts: list[str | None]) -> PromptEmbeddings:
        out = self.encode(["" if p is None else p for p in negative_prompts])
        return self.encoder.zero_missing(out, negative_prompts)

    # -- rows ----------------------------------------------------------------------------------
    def write_rows(self, key: GroupKey, start: int, latents: torch.Tensor, cond: PromptEmbeddings,
                   uncond: PromptEmbeddings, guidance: float) -> None:
        """Fills rows [start, start+k) with initial latents and one prompt's embeddings (broadcast)."""
        buf = self.buffers(key)
        k = latents.shape[0]
        rows = slice(start, start + k)
        buf.x[rows] = self._to_device(latents.float())
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
            buf.time_ids[rows] = self._time_ids(key)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without blocking the host: from pinned memory, asynchronously (a pageable copy
        would wait for the GPU queue to drain and leave it idle while the host catches up)."""
        if not self.cuda:
            return t
        return t.pin_memory().to(self.model.device, non_blocking=True)

    def _time_ids(self, key: GroupKey) -> torch.Tensor:
        cached = self._time_ids_cache.get(key)
        if cached is None:
            cached = torch.tensor(add_time_ids(*key), dtype=self.model.dtype, device=self.model.device)
            self._time_ids_cache[key] = cached
        return cached

    def step(self, key: GroupKey, n: int, coefs: np.ndarray,
             noise: list[tuple[int, torch.Tensor]] | None = None) -> bool:
        """Runs one step for rows [0, n). coefs: [n, NUM_COEFS]; noise: (first row, [k, C, h, w]) chunks
        for the rows that draw ancestral noise this step. Returns True when it ran as a graph replay."""
        buf = self.buffers(key)
        bucket = self.runner.bucket("step", key[0], key[1], n) if self.runner is not None else None
        rows = bucket or n
        slot = self._next_staging(key)
        slot.coefs[:n].numpy()[:] = coefs
        if rows > n:  # padding rows: zero state and all-zero coefficients keep them at x = 0, finite
            slot.coefs[n:rows] = 0
            buf.x[n:rows].zero_()
            buf.d_prev[n:rows].zero_()
        buf.coefs[:rows].copy_(slot.coefs[:rows], non_blocking=True)
        for first, rows_noise in noise or ():
            k = rows_noise.shape[0]
            slot.noise[first:first + k].copy_(rows_noise)
            buf.noise[first:first + k].copy_(slot.noise[first:first + k], non_blocking=True)
        if self.cuda:
            slot.event = torch.cuda.Event()
            slot.event.record()
        if bucket is not None:
            self.runner.replay("step", key[0], key[1], bucket)
            return True
        with torch.no_grad():
            whole_step(self.model.unet, buf, n)
        return False

    def read_latents(self, key: GroupKey, start: int, count: int) -> torch.Tensor:
        return self.buffers(key).x[start:start + count].clone()

    def move_rows(self, key: GroupKey, src: int, dst: int, count: int) -> None:
        self.buffers(key).move_rows(src, dst, count)

    # -- decode --------------------------------------------------------------------------------
    def decode_tensor(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels [n, 3, H, W] in [0, 1] on the device (diffusers' VAE scaling and denormalisation)."""
        vae = self.vae
        latents = latents.to(self.model.vae_dtype)
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
        return (image * 0.5 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def decode_async(self, key: GroupKey, latents: torch.Tensor) -> Callable[[], np.ndarray]:
        """Enqueues the decode and a copy of the pixels to pinned host memory; returns a waiter that
        gives float pixels [n, H, W, 3] in [0, 1] (as diffusers' VaeImageProcessor, output_type='np').
        The engine loop does not wait: the waiter runs on the image thread pool."""
        latents = latents.to(self.model.device)
        runner = self.runner
        chunk = max(VAE_BUCKETS) if runner is not None else latents.shape[0]
        n_total = latents.shape[0]
        host = None
        for start in range(0, n_total, chunk):
            part = latents[start:start + chunk]
            n = part.shape[0]
            bucket = runner.bucket("vae", key[0], key[1], n) if runner is not None and "vae" in runner.kinds else None
            if bucket is None:
                image = self.decode_tensor(part)
            else:
                self.vae_graph.write(key[0], key[1], part, bucket)
                image = runner.replay("vae", key[0], key[1], bucket)[:n]
            image = image.permute(0, 2, 3, 1)
            if host is None:
                host = torch.empty((n_total, *image.shape[1:]), dtype=image.dtype, pin_memory=self.cuda)
            host[start:start + n].copy_(image, non_blocking=self.cuda)  # consumed before any later replay
        if not self.cuda:
            arrays = host.float().numpy()
            return lambda: arrays
        event = torch.cuda.Event()
        event.record()

        def wait() -> np.ndarray:
            event.synchronize()
            return host.float().numpy()
        return wait

    def decode(self, key: GroupKey, latents: torch.Tensor) -> np.ndarray:
        """Latents -> float pixels [n, H, W, 3] in [0, 1], waiting for them."""
        return self.decode_async(key, latents)()
