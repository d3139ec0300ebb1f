"""`TokenFamily`: the host half every transformer family over packed latent tokens shares (Flux, Z-Image, Qwen-Image).

Such a model reads an image's latents as tokens, `patch` x `patch` latent cells each; its attention does not care how
the tokens were laid out on the grid as long as each carries its position. So its rows group by token count, not by
size: the group key is (text slot, image tokens rounded up to `token_bucket`), and rows of different aspect ratios
(and, with padding, of different sizes) of one bucket share step buffers, steps and graphs. The text slot is 0 for a
family whose rows always read `text_tokens` prompt tokens (FLUX.2 puts its rows' reference-token bucket there
instead: flux2.py `group_key`); a family with `text_buckets` reads only the group's slot
(the smallest bucket that holds the row's longest prompt, template included), so short prompts do not pay for the
longest one's tokens: rows of prompts of one bucket share the replay. Each row carries, from its own size,
its tokens' grid positions (`rows.positions`, [tokens, 2] as (row, column), padding at (-1, -1)) and which tokens are
its image's (`rows.image_mask`); padding tokens hold zeros, the step's update keeps them there (the family's denoiser
returns 0 for them), and `unpack` drops them.

Its text side reads variable-length prompts: a row holds `text_tokens` prompt tokens with a mask (the conditioning
fields `embeds` and `mask`), so prompts of different lengths share a step; the family's `encode` pads each prompt
(`pad_tokens`).

Its samplers are flow matching's (sampling/flow.py: Euler, its stochastic form, DPM-Solver++(2M)) over the scheduler
config's `FlowSchedule`, the time shift from the row's own token count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from typing import Any, Mapping

import torch

from ... import safe_files
from ...request import GroupKey, ParamError, Size, tiling_refusal
from ...sampling.flow import FLOW_SAMPLERS, FLOW_SCHEDULES, FlowSchedule, flow_noising, flow_plan
from ...sampling.samplers import SamplerPlan
from ..qwen_tokenizer import check_chat_template, qwen_tokenizer
from ..model import DiffusionModel
from .base import Conditioning, FamilyAdapter, Planner

TOKEN_GROUP = 0  # the first element of a token family's group key without text buckets (a UNet family's: a height)
FOLDER_PARTS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")


@contextlib.contextmanager
def random_modules(device: torch.device, dtype: torch.dtype):
    """Modules made inside are random from a fixed seed, in `dtype`, on `device` (a family's random presets)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def materialised(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`module` built with its parameters on meta (stream_load.meta_parameters), each made on `device` in `dtype` one
    at a time from a fixed seed (matrices and kernels normal with std 1 / sqrt(fan-in), 1-d scales one, biases zero),
    so a full-size random preset never holds more than itself and one tensor, and never on the host."""
    from ..stream_load import assign

    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in list(module.named_parameters()):
        if not param.is_meta:
            continue
        value = torch.empty(param.shape, dtype=dtype, device=device)
        if param.ndim > 1:
            value.normal_(0.0, math.prod(param.shape[1:]) ** -0.5, generator=generator)
        else:
            value.fill_(0.0 if name.endswith("bias") else 1.0)
        assign(module, name, value)
    return module


def qwen3_folder_parts(folder: str, pipeline_class: str, dtype: torch.dtype) -> tuple[Any, Any, dict[str, Any]]:
    """(text encoder, tokenizer, scheduler config) of a diffusers folder of a transformer pipeline with a Qwen3 text
    encoder (its base model: the pipelines read hidden states only), after checking it has every part; the
    tokenizer's chat template must be the shipped Qwen3 one (the prompt string is rendered from it, no folder's Jinja
    runs). A folder without `tokenizer/` reads prompts with the shipped Qwen3 tokenizer (the same vocabulary: the
    trained `digits-zimage` ships that way, saving the tokenizer's megabytes). Each problem is a ValueError naming
    the folder and what to do."""
    from transformers import AutoModel, AutoTokenizer

    from ..stream_load import load_part

    for sub in FOLDER_PARTS:
        if sub != "tokenizer" and not os.path.isdir(os.path.join(folder, sub)):
            raise ValueError(f"{folder!r} is a {pipeline_class} folder but lacks its '{sub}' subfolder; point "
                             "diffgraph at a complete diffusers folder (e.g. saved with save_pretrained)")
    encoder = load_part(AutoModel, folder, f"model folder {folder!r}", "text_encoder", dtype)
    if not os.path.isdir(os.path.join(folder, "tokenizer")):
        return encoder, qwen_tokenizer("qwen3"), folder_scheduler_config(folder)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer"), local_files_only=True)
    try:
        check_chat_template(tokenizer.chat_template or "", "qwen3")
    except ValueError as e:
        raise ValueError(f"model folder {folder!r}: tokenizer: {e}") from None
    return encoder, tokenizer, folder_scheduler_config(folder)


def folder_scheduler_config(folder: str) -> dict[str, Any]:
    """A diffusers folder's scheduler/scheduler_config.json; a ValueError naming the folder where it is unusable."""
    try:
        return safe_files.read_json(os.path.join(folder, "scheduler", "scheduler_config.json"), 1 << 20)[0]
    except safe_files.UnusableFile as e:
        raise ValueError(f"model folder {folder!r}: scheduler/scheduler_config.json {e}") from None


class TokenFamily(FamilyAdapter):
    """A transformer family over packed latent tokens: subclass it, set `name`, `pipeline_classes`, `patch`,
    `token_bucket`, `text_tokens`, implement loading, `cond_spec` / `encode` and `denoise` (rows in the packed layout,
    padding tokens out as 0); override `pack` / `unpack` where its token order differs from Flux's."""

    patch: int = 2                 # latent cells per token side
    token_bucket: int = 256        # image tokens of a group: a multiple of this
    channels_innermost: bool = False  # a token's features as (patch row, patch column, channel): Z-Image's order
    text_tokens: int = 512         # prompt tokens a row holds (masked)
    text_buckets: tuple[int, ...] = ()  # the text slots its groups read (ascending, the last `text_tokens`); ()
    #                                     every row reads all `text_tokens`
    samplers = FLOW_SAMPLERS
    schedules = FLOW_SCHEDULES
    default_sampler = FLOW_SAMPLERS[0]
    default_schedule = FLOW_SCHEDULES[0]
    prompt_syntaxes = ("plain",)
    plan_options = False
    tiled_vae = True
    supports_tiling = False  # a transformer over tokens: no convolutions to pad circularly

    # -- groups and layout -------------------------------------------------------------------------
    def grid(self, model: DiffusionModel, size: Size) -> tuple[int, int]:
        """Tokens per column and per row of an image of `size`."""
        cell = model.vae_scale_factor * self.patch
        return size[0] // cell, size[1] // cell

    def group_key(self, model: DiffusionModel, size: Size, text_tokens: int = 0,
                  prepared: Mapping[str, Any] | None = None, tiling: bool = False) -> GroupKey:
        """(text slot, image tokens): the slot is the smallest text bucket of at least `text_tokens` (0: the
        largest, which any prompt fits), TOKEN_GROUP for a family without text buckets. Tiling is refused."""
        if tiling:
            raise ParamError("tiling", tiling_refusal(self.name))
        h, w = self.grid(model, size)
        image = math.ceil(h * w / self.token_bucket) * self.token_bucket
        if not self.text_buckets:
            return (TOKEN_GROUP, image)
        fits = [b for b in self.text_buckets if b >= text_tokens] if text_tokens else []
        return (fits[0] if fits else self.text_buckets[-1], image)

    def group_keys(self, model: DiffusionModel, size: Size) -> tuple[GroupKey, ...]:
        key = self.group_key(model, size)
        return tuple((slot, key[1]) for slot in self.text_buckets) or (key,)

    def text_slot(self, key: GroupKey) -> int:
        """The prompt tokens rows of group `key` read."""
        if key[0] not in ((TOKEN_GROUP,) if not self.text_buckets else self.text_buckets):
            raise ValueError(f"group {key} is not a token bucket of family {self.name!r}")
        return key[0] or self.text_tokens

    def latent_shape(self, model: DiffusionModel, key: GroupKey) -> tuple[int, ...]:
        self.text_slot(key)
        return (key[1], model.latent_channels * self.patch ** 2)

    def pack(self, model: DiffusionModel, latents: torch.Tensor, size: Size, key: GroupKey) -> torch.Tensor:
        """[n, C, h, w] -> [n, bucket tokens, C * p * p]: row-major tokens, each token's features in Flux's order
        (channel, patch row, patch column) or, with `channels_innermost`, Z-Image's (patch row, patch column,
        channel); zero padding after the image's tokens."""
        n = latents.shape[0]
        tokens = self.patchify(model, latents)
        out = tokens.new_zeros((n, *self.latent_shape(model, key)))
        out[:, :tokens.shape[1]] = tokens
        return out

    def patchify(self, model: DiffusionModel, latents: torch.Tensor) -> torch.Tensor:
        """[n, C, h, w] -> [n, h/p * w/p, C * p * p]: the image's tokens, row-major, unpadded (see `pack`)."""
        n, c, h, w = latents.shape
        p = self.patch
        order = (0, 2, 4, 3, 5, 1) if self.channels_innermost else (0, 2, 4, 1, 3, 5)
        return latents.reshape(n, c, h // p, p, w // p, p).permute(*order).reshape(n, -1, c * p * p)

    def unpack(self, model: DiffusionModel, rows: torch.Tensor, size: Size, key: GroupKey) -> torch.Tensor:
        gh, gw = self.grid(model, size)
        p, n = self.patch, rows.shape[0]
        c = rows.shape[2] // (p * p)
        if self.channels_innermost:
            tokens = rows[:, :gh * gw].reshape(n, gh, gw, p, p, c).permute(0, 5, 1, 3, 2, 4)
        else:
            tokens = rows[:, :gh * gw].reshape(n, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return tokens.reshape(n, c, gh * p, gw * p)

    def row_spec(self, model: DiffusionModel, key: GroupKey, size: Size | None = None) -> dict[str, torch.Tensor]:
        """Each token's grid position (row, column) and whether it is the image's; padding at (-1, -1), False. With
        text buckets also `text_positions`, the prompt token positions 0..slot-1 the group's rows read (its length
        is the slot: the denoiser reads the conditioning's first `slot` tokens), and the family's rotary tables of
        such a row (`rope_rows`)."""
        total = key[1]
        slot = {"text_positions": torch.arange(self.text_slot(key), device=model.device)} if self.text_buckets \
            else {}
        positions = torch.full((total, 2), -1, dtype=torch.int64)
        mask = torch.zeros(total, dtype=torch.bool)
        if size is not None:
            gh, gw = self.grid(model, size)
            rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
            positions[:gh * gw] = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1)
            mask[:gh * gw] = True
        spec = {"positions": positions.to(model.device), "image_mask": mask.to(model.device), **slot}
        return {**spec, **self.rope_rows(model, spec)}

    def rope_rows(self, model: DiffusionModel, spec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The family's rotary tables of a row of the group and size of `spec` (`row_spec`'s fields), made once per
        (group, size) as the other per-size fields are, so that a step only gathers them by row; {}: none."""
        return {}

    # -- sampling ------------------------------------------------------------------------------------
    def planner(self, model: DiffusionModel) -> Planner:
        """Flow Euler over the model's flow schedule, shifted by each row's own token count."""
        schedule_config = FlowSchedule.from_config(model.scheduler_config)

        @functools.lru_cache(maxsize=256)
        def plan(sampler: str, schedule: str, steps: int, size: Size) -> SamplerPlan:
            self.check(sampler, schedule, size)
            h, w = self.grid(model, size)
            return flow_plan(sampler, schedule, schedule_config, steps, h * w)
        return plan

    def flow_schedules(self, model: DiffusionModel) -> dict[str, FlowSchedule]:
        """The flow schedule of each of the family's schedule names (the model's scheduler config's)."""
        return dict.fromkeys(self.schedules, FlowSchedule.from_config(model.scheduler_config))

    def shifted_plan(self, model: DiffusionModel, sampler: str, schedule: str, steps: int, key: GroupKey,
                     shift: float) -> SamplerPlan:
        """`schedule` at the fixed time shift `shift` for every size (exp(mu) of a dynamic shift), its terminal
        stretch kept."""
        self.check(sampler, schedule, key)
        h, w = self.grid(model, key)
        flow = dataclasses.replace(self.flow_schedules(model)[schedule], use_dynamic_shifting=False, shift=shift)
        return flow_plan(sampler, schedule, flow, steps, h * w)

    def noising(self, plan: SamplerPlan) -> tuple[float, float]:
        return flow_noising(float(plan.sigmas[0]))

    def extra_channels(self, model: DiffusionModel) -> int:
        return 0

    # -- text -----------------------------------------------------------------------------------------
    def token_lengths(self, model: DiffusionModel) -> list[int]:
        return [self.text_tokens] * len(model.tokenizers)

    def needs_attention_mask(self, model: DiffusionModel) -> bool:
        return True

    def encoder_layers(self, model: DiffusionModel) -> int:
        return 0  # clip_skip is CLIP's: refused

    def embedding_dims(self, model: DiffusionModel) -> dict[str, int]:
        return {}

    def pad_tokens(self, model: DiffusionModel, embeds: torch.Tensor, mask: torch.Tensor) -> Conditioning:
        """An encoder's [n, L, D] hidden states and [n, L] mask (L <= text_tokens) -> the rows' `embeds` and `mask`
        fields at `text_tokens`, padding zeroed."""
        n, length, dim = embeds.shape
        if length > self.text_tokens:
            raise ValueError(f"{length} prompt tokens are more than the {self.text_tokens} a row holds")
        out = embeds.new_zeros((n, self.text_tokens, dim))
        keep = mask.to(torch.bool)
        out[:, :length] = embeds * keep.unsqueeze(-1)
        full = torch.zeros((n, self.text_tokens), dtype=torch.bool, device=embeds.device)
        full[:, :length] = keep
        return {"embeds": out.to(model.dtype), "mask": full}

    def tokenize_padded(self, model: DiffusionModel, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask) [n, L] of the prompts on the model's device, L the longest's, each cut to
        `text_tokens` (the prompt's preparation warned of what is dropped: text/prepared.py)."""
        tokenizer = model.tokenizers[0]
        out = tokenizer(prompts, padding="longest", max_length=self.text_tokens, truncation=True,
                        padding_side="right", return_tensors="pt")  # real tokens first (pad_tokens keeps a prefix)
        return out.input_ids.to(model.device), out.attention_mask.to(model.device)
