"""`LoraLayout`: what a model family's LoRA files name and which of its layers side paths wrap.

A family declares one (`FamilyAdapter.lora_layout`): the files' component names and the module each names (the
denoiser, or a text encoder by index), the layer-name ends of its denoiser's side paths (and those the `conv` option
adds), those of its text encoders, and the diffusers pipeline whose `lora_state_dict` reads its files' key layouts
(kohya, diffusers' old layout; None: the files are in PEFT's `component.module.lora_A.weight` layout as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")
# the `conv` option's UNet layers: what diffusers' LCM-LoRA training (and TCD's, Hyper-SD's) and kohya's LoCon target
# beyond UNET_TARGETS (ResNet blocks' 3x3 convs, time projection and 1x1 shortcut; the samplers' convs), and the
# conv_in / conv_out that some distilled adapters (DMD2) add
CONV_TARGETS = ("conv1", "conv2", "conv_shortcut", "time_emb_proj", "downsamplers.0.conv", "upsamplers.0.conv",
                "conv_in", "conv_out")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
DENOISER = "denoiser"  # a component's module: the denoiser; "text:<i>" the i-th text encoder


@dataclass(frozen=True)
class LoraLayout:
    components: tuple[tuple[str, str], ...]  # (the files' component name, DENOISER or "text:<i>"), in order
    denoiser: tuple[str, ...]                 # layer-name ends the denoiser's side paths wrap
    conv: tuple[str, ...] = ()                # and those the `conv` option adds (convolutions)
    text: tuple[str, ...] = ()                # the text encoders'
    pipeline_class: str | None = None         # the diffusers pipeline whose lora_state_dict reads the files
    # the component names its files may hold: its own, and its sibling models' (an SDXL file read for an SD model is
    # then refused as made for another model, not as unreadable); () its own
    reads: tuple[str, ...] = ()
    # the family's own key layouts made readable before `pipeline_class` reads them (fused projections split, names
    # its converter does not know): state dict -> state dict; None: none
    prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return self.reads or tuple(c for c, _ in self.components)

    @property
    def denoiser_component(self) -> str:
        return next(c for c, m in self.components if m == DENOISER)


def unet_layout(pipeline_class: str, text_encoders: int) -> LoraLayout:
    """The SD families': `unet` and `text_encoder`, `text_encoder_2`, ... in diffusers' names."""
    texts = tuple(("text_encoder" if i == 0 else f"text_encoder_{i + 1}", f"text:{i}") for i in range(text_encoders))
    return LoraLayout((("unet", DENOISER),) + texts, UNET_TARGETS, CONV_TARGETS, TEXT_TARGETS, pipeline_class,
                      reads=("unet", "text_encoder", "text_encoder_2"))
