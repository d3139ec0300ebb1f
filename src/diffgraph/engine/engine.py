"""`Engine`: the public facade. Validates requests, runs them on the worker, returns images.

One request's rows share the step loop here: per step the host builds the rows' coefficient table
from the request's precomputed SamplerPlan, draws ancestral noise from the request's own CPU
generator (in diffusers' order), and the worker runs one whole step. Finished latents are decoded
and turned into PIL images.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..config import GraphConfig
from ..models.loader import DiffusionModel, load_model
from ..request import GenerationRequest, GenerationResult
from ..sampling.samplers import SamplerPlan, make_plan
from .worker import Worker

logger = logging.getLogger(__name__)


def to_pil(arrays: np.ndarray) -> list[Image.Image]:
    """Float pixels [n, H, W, 3] in [0, 1] -> PIL images, rounding as diffusers' numpy_to_pil does."""
    return [Image.fromarray(a) for a in (arrays * 255).round().astype("uint8")]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Engine:
    """Generates images with an SD1.x/SD2.x/SDXL model.

    >>> engine = Engine(model="random:tiny", device="cpu")
    >>> images = engine.generate("a red fox", seed=1)
    """

    def __init__(self, model: str = "random:tiny", device: str | None = None, dtype: str | None = None,
                 mode: str | None = None, graphs: GraphConfig | None = None, max_rows: int = 16):
        device = device or default_device()
        cuda = torch.device(device).type == "cuda"
        dtype = dtype or ("fp16" if cuda else "fp32")
        mode = mode or ("graph" if cuda else "eager")
        if mode not in ("graph", "eager"):
            raise ValueError(f"mode {mode!r} is unknown; allowed: graph, eager")
        if mode == "graph" and not cuda:
            raise ValueError("mode 'graph' needs a CUDA device; use mode='eager' on the CPU")
        t0 = time.perf_counter()
        self.model: DiffusionModel = load_model(model, device=device, dtype=dtype)
        self.mode = mode
        self.worker = Worker(self.model, max_rows=max_rows, mode=mode, graphs=graphs)
        if mode == "graph" and self.worker.graph_config.prewarm:
            self.worker.prewarm()
        self.ready_s = time.perf_counter() - t0  # load to ready (prewarm graphs captured)

    def graph_table(self) -> list[dict[str, Any]]:
        """Per graph key: status, capture ms, pool MiB added, replays, eager fallbacks, verification diff."""
        return [] if self.worker.runner is None else self.worker.runner.table()

    # -- requests ------------------------------------------------------------------------------
    def make_request(self, prompt: Any, *, negative_prompt: Any = None, width: Any = None, height: Any = None,
                     num_inference_steps: Any = 20, guidance_scale: Any = None, sampler: Any = "euler",
                     schedule: Any = "default", seed: Any = None, num_images: Any = 1,
                     request_id: str | None = None) -> GenerationRequest:
        size = self.model.native_size
        return GenerationRequest.create(
            prompt, negative_prompt=negative_prompt,
            width=size if width is None else width, height=size if height is None else height,
            num_inference_steps=num_inference_steps,
            guidance_scale=self.model.default_guidance if guidance_scale is None else guidance_scale,
            sampler=sampler, schedule=schedule, seed=seed, num_images=num_images, request_id=request_id)

    def generate(self, prompt: Any, **params: Any) -> GenerationResult:
        """Generates `num_images` images for one prompt. The result is a list-like of PIL images
        with `.seed`, `.timings` and `.arrays` (float pixels) attached. Invalid parameters raise ValueError."""
        return self.run(self.make_request(prompt, **params))

    def run(self, request: GenerationRequest) -> GenerationResult:
        t0 = time.perf_counter()
        worker = self.worker
        model = self.model
        key = (request.height, request.width)
        n = request.num_images
        if n > worker.max_rows:
            raise ValueError(f"num_images {n} exceeds this engine's max_rows {worker.max_rows}")
        plan: SamplerPlan = make_plan(worker.noise_schedule, request.sampler, request.schedule,
                                      request.num_inference_steps)
        cond = worker.encode([request.prompt])
        uncond = worker.encode_negative([request.negative_prompt])
        t_encode = time.perf_counter()

        generator = torch.Generator("cpu").manual_seed(request.seed)
        shape = (n, *worker.latent_shape(key))
        # diffusers draws the initial latents in the model dtype on the CPU generator, then scales them
        latents = torch.randn(shape, generator=generator, dtype=model.dtype).float() * plan.init_noise_sigma
        worker.write_rows(key, 0, latents, cond, uncond, request.guidance_scale)
        for i in range(plan.num_steps):
            noise = [(0, torch.randn(shape, generator=generator, dtype=model.dtype))] if plan.draws_noise else None
            worker.step(key, n, np.broadcast_to(plan.coefs[i], (n, plan.coefs.shape[1])), noise)
        final = worker.read_latents(key, 0, n)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        t_denoise = time.perf_counter()
        arrays = worker.decode(key, final)
        t_decode = time.perf_counter()
        timings = {"encode_ms": (t_encode - t0) * 1e3, "denoise_ms": (t_denoise - t_encode) * 1e3,
                   "decode_ms": (t_decode - t_denoise) * 1e3, "total_ms": (t_decode - t0) * 1e3}
        return GenerationResult(request_id=request.request_id, images=to_pil(arrays), arrays=arrays,
                                seed=request.seed, timings=timings, request=request)

    # -- diffusers interop ---------------------------------------------------------------------
    def diffusers_pipeline(self, sampler: str | None = None, schedule: str = "default"):
        """The equivalent diffusers pipeline built on the same loaded modules (no copies).

        With `sampler`, its scheduler is the diffusers scheduler equivalent to (sampler, schedule);
        otherwise EulerDiscreteScheduler from the model's scheduler config."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

        from ..sampling.oracle import diffusers_scheduler

        m = self.model
        config = {k: v for k, v in m.scheduler_config.items() if not k.startswith("_")}
        scheduler = (diffusers_scheduler(config, sampler, schedule) if sampler
                     else EulerDiscreteScheduler.from_config(config))
        if m.family == "sdxl":
            pipe = StableDiffusionXLPipeline(
                vae=m.vae, text_encoder=m.text_encoders[0], text_encoder_2=m.text_encoders[1],
                tokenizer=m.tokenizers[0], tokenizer_2=m.tokenizers[1], unet=m.unet, scheduler=scheduler,
                force_zeros_for_empty_prompt=m.force_zeros_for_empty_prompt)
        else:
            pipe = StableDiffusionPipeline(
                vae=m.vae, text_encoder=m.text_encoders[0], tokenizer=m.tokenizers[0], unet=m.unet,
                scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe
