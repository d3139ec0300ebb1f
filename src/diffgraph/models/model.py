"""`DiffusionModel`: the loaded modules of one pipeline on one device in one dtype, and dtype names.

Owns no behaviour of its own beyond shapes: what the modules mean (conditioning, denoiser call, decode) is
its family adapter's (`model.adapter`, models/families/), which the loader picks from a registry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import DTYPE_NAMES

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.float32, torch.float16, torch.float16, torch.bfloat16,
                                torch.bfloat16)))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; use fp32, fp16 or bf16")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of fp32, fp16, bf16") from None


@dataclass
class DiffusionModel:
    """The loaded modules of one diffusion pipeline: `denoiser` is its UNet or transformer (`unet` is a deprecated
    alias of it)."""

    name: str
    family: str  # the adapter's name: "sd" | "sdxl" | a registered family
    adapter: Any  # its families.base.FamilyAdapter (not imported: the families import this module)
    denoiser: Any
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
    # its family's planner, made once (FamilyAdapter.plans); kept here, not on the adapter, so that it goes with the model
    sampler_plans: Callable[..., object] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def unet(self) -> Any:
        """Deprecated alias of `denoiser` (the denoiser need not be a UNet)."""
        warnings.warn("DiffusionModel.unet is deprecated; use DiffusionModel.denoiser", DeprecationWarning, stacklevel=2)
        return self.denoiser

    @unet.setter
    def unet(self, module: Any) -> None:
        warnings.warn("DiffusionModel.unet is deprecated; use DiffusionModel.denoiser", DeprecationWarning, stacklevel=2)
        self.denoiser = module

    @property
    def vae_scale_factor(self) -> int:
        return self.adapter.vae_scale_factor(self)

    @property
    def latent_channels(self) -> int:
        return self.adapter.latent_channels(self)

    @property
    def vae_dtype(self) -> torch.dtype:
        """The dtype the decoder runs in (the family decides: SDXL upcasts its fp16 VAE, as diffusers does)."""
        return self.adapter.vae_dtype(self)

    @property
    def default_guidance(self) -> float:
        return self.adapter.model_guidance(self)

    @property
    def default_steps(self) -> int | None:
        """Its checkpoint's steps, where its family has per-checkpoint defaults (None: the route's default)."""
        return self.adapter.default_steps(self)
