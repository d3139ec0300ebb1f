"""One loader for every model: local diffusers folders (offline) and presets.

`load_model(name_or_path, device, dtype)` returns a `DiffusionModel`: the UNet, VAE, text encoders
and tokenizers of an SD1.x/SD2.x or SDXL-base pipeline, its scheduler config and its family. Nothing
is ever downloaded: folders are read with local_files_only, presets are built in code.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import DTYPE_NAMES
from . import presets as P

logger = logging.getLogger(__name__)

SUPPORTED_PIPELINES = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
}
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float32, torch.float16, torch.float16, torch.bfloat16,
                                torch.bfloat16)))


@dataclass
class DiffusionModel:
    """The loaded modules of one SD-family pipeline, on one device in one dtype."""

    name: str
    family: str  # "sd" | "sdxl"
    unet: Any
    vae: Any
    text_encoders: list[Any]
    tokenizers: list[Any]
    scheduler_config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    native_size: int
    force_zeros_for_empty_prompt: bool = False
    is_random: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def vae_dtype(self) -> torch.dtype:
        """The dtype the VAE decodes in. SDXL's VAE overflows in fp16: StableDiffusionXLPipeline upcasts it
        to fp32 (config.force_upcast), and so does the worker (with its own fp32 copy; `vae` itself stays
        in the model dtype, as diffusers keeps it). SD1.x/2.x pipelines decode in the model dtype."""
        if self.family == "sdxl" and self.dtype == torch.float16 and getattr(self.vae.config, "force_upcast", False):
            return torch.float32
        return self.dtype

    @property
    def default_guidance(self) -> float:
        return 5.0 if self.family == "sdxl" else 7.5


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; use fp32, fp16 or bf16")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of fp32, fp16, bf16") from None


def _supported_message() -> str:
    names = ", ".join(P.available_presets())
    return (f"supported: a local diffusers folder of {' or '.join(SUPPORTED_PIPELINES)} "
            f"(with model_index.json), or a preset: {names}")


def load_model(model: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32") -> DiffusionModel:
    """Loads a preset or a local diffusers folder. Errors list what is supported."""
    device = torch.device(device)
    torch_dtype = parse_dtype(dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available; use device='cpu'")
    if model in P.RANDOM_PRESETS:
        return _build_random(P.RANDOM_PRESETS[model], device, torch_dtype)
    if model in P.SHIPPED_PRESETS:
        folder = P.shipped_preset_folder(model)
        if folder is None:
            raise ValueError(f"preset {model!r} is not shipped in this install; {_supported_message()}")
        return _load_folder(folder, device, torch_dtype, name=model)
    if os.path.isdir(model):
        return _load_folder(model, device, torch_dtype, name=model)
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file, not a diffusers folder; {_supported_message()}")
    raise ValueError(f"model {model!r} is neither a local folder nor a known preset; {_supported_message()}")


def _build_random(preset: P.RandomPreset, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .tokenizer import preset_tokenizer

    logger.warning("model %s has random weights: its images are noise (use it for tests and timing)", preset.name)
    # Build on the target device (fast init for the full-size models), from a fixed seed: the same
    # preset gives the same weights on every run of one torch version and device type.
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        with torch.device(device):
            unet = UNet2DConditionModel(**preset.unet)
            vae = AutoencoderKL(**preset.vae)
            encoders = []
            for cfg in preset.text_encoders:
                config = CLIPTextConfig(**cfg)
                cls = CLIPTextModelWithProjection if "projection_dim" in cfg else CLIPTextModel
                encoders.append(cls(config))
    finally:
        torch.random.set_rng_state(gen_state)
    model = DiffusionModel(
        name=preset.name, family=preset.family, unet=unet, vae=vae, text_encoders=encoders,
        tokenizers=[preset_tokenizer(pad) for pad in preset.tokenizer_pads],
        scheduler_config=dict(P.SD_SCHEDULER_CONFIG), device=device, dtype=dtype,
        native_size=preset.native_size, force_zeros_for_empty_prompt=preset.family == "sdxl", is_random=True,
    )
    return _finish(model)


def _place(module: Any, device: torch.device, dtype: torch.dtype) -> None:
    # Cast only when needed: diffusers warns on every dtype cast, even a no-op one.
    first = next(module.parameters())
    if first.dtype != dtype:
        module.to(dtype=dtype)
    if first.device != device:
        module.to(device=device)
    module.eval().requires_grad_(False)


def _finish(model: DiffusionModel) -> DiffusionModel:
    _place(model.unet, model.device, model.dtype)
    _place(model.vae, model.device, model.dtype)
    for enc in model.text_encoders:
        _place(enc, model.device, model.dtype)
    return model


def _load_folder(folder: str, device: torch.device, dtype: torch.dtype, name: str) -> DiffusionModel:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"{folder!r} has no model_index.json, so it is not a diffusers pipeline folder; "
                         f"{_supported_message()}")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    cls_name = index.get("_class_name")
    if cls_name not in SUPPORTED_PIPELINES:
        raise ValueError(f"{folder!r} holds a {cls_name}, which is not supported; {_supported_message()}")
    family = SUPPORTED_PIPELINES[cls_name]
    for sub in ("unet", "vae", "scheduler", "text_encoder", "tokenizer") + (("text_encoder_2", "tokenizer_2") if family == "sdxl" else ()):
        if not os.path.isdir(os.path.join(folder, sub)):
            raise ValueError(f"{folder!r} is a {cls_name} folder but lacks its '{sub}' subfolder; "
                             "point diffgraph at a complete diffusers folder (e.g. saved with save_pretrained)")

    def variant(sub: str) -> str | None:
        files = os.listdir(os.path.join(folder, sub))
        plain = any(f.endswith((".safetensors", ".bin")) and f.count(".") == 1 for f in files)
        return None if plain or not any(".fp16." in f for f in files) else "fp16"

    import importlib.util

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no per-file progress bars on every load
    common = dict(local_files_only=True, torch_dtype=dtype,
                  low_cpu_mem_usage=importlib.util.find_spec("accelerate") is not None)
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", variant=variant("unet"), **common)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", variant=variant("vae"), **common)
    tcommon = dict(local_files_only=True, dtype=dtype)
    encoders = [CLIPTextModel.from_pretrained(os.path.join(folder, "text_encoder"), **tcommon)]
    tokenizers = [CLIPTokenizer.from_pretrained(os.path.join(folder, "tokenizer"), local_files_only=True)]
    if family == "sdxl":
        encoders.append(CLIPTextModelWithProjection.from_pretrained(os.path.join(folder, "text_encoder_2"), **tcommon))
        tokenizers.append(CLIPTokenizer.from_pretrained(os.path.join(folder, "tokenizer_2"), local_files_only=True))
    with open(os.path.join(folder, "scheduler", "scheduler_config.json"), encoding="utf-8") as f:
        scheduler_config = json.load(f)
    native = int(unet.config.sample_size) * 2 ** (len(vae.config.block_out_channels) - 1)
    model = DiffusionModel(
        name=name, family=family, unet=unet, vae=vae, text_encoders=encoders, tokenizers=tokenizers,
        scheduler_config=scheduler_config, device=device, dtype=dtype, native_size=native,
        force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", family == "sdxl")),
    )
    return _finish(model)
