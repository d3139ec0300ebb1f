"""Qwen-Image (Qwen's 20B MMDiT, Apache-2.0): a double-stream transformer over 2x2 patches of its own 16-channel VAE's
latents, with the Qwen2.5-VL language model as its text encoder, on flow matching; text-to-image.

What diffusers' `QwenImagePipeline` does, and how rows of different prompts and sizes share one step here:
  * text: each prompt is put in the pipeline's template (a system message asking for a description, the prompt as the
    user message, the assistant's turn opened), tokenised and read by the encoder with its mask; the last hidden state
    of its real tokens is kept after dropping the template's first 34 (the system message: `DROPPED`), so a row's
    `embeds` are the prompt and the template's tail at their own length, up to 1024 (`text_tokens`; the pipeline's
    `tokenizer_max_length`; its call keeps 512 by default, `max_sequence_length`), with their `mask`;
  * latents: [16, H/8, W/8] (the VAE is a one-frame video VAE: decode reads [n, 16, 1, h, w]), packed 2x2 into 64
    channels per token in Flux's order (channel, patch row, patch column), the seed's noise drawn in that shape;
  * the transformer reads text tokens then image tokens with 3-axis RoPE (frame, row, column), centred: image token
    (r, c) of an h x w grid at (0, r - (h - h // 2), c - (w - w // 2)), text token k at (m + k) on every axis, m =
    max(h // 2, w // 2). diffusers' embedder takes one image size per batch; each row carries the tables of its own
    grid, made once per size and text slot (`rope_rows`), and `denoise` runs the blocks with the text slot's
    padding and the bucket's slack masked out of attention, so a row's output never depends on its companions;
  * timesteps: the model reads sigma (t / 1000) and predicts the velocity;
  * the schedule: sigmas linspace(1, 1 / steps) shifted by exp(mu), mu linear in the image's tokens (the scheduler
    config's base / max shift and sequence lengths), stretched so the last is `shift_terminal` (0.02), as
    FlowMatchEulerDiscreteScheduler with the pipeline's mu (flow_dpmpp_2m: DPM-Solver's own spacing, no terminal; a
    one-step plan is left unstretched, where the scheduler divides by zero and the pipeline's image is NaN);
  * true classifier-free guidance: a row whose scale is above 1 runs two denoiser rows, combined as
    `neg + g (pos - neg)` and then rescaled per token to the prompt branch's norm over the packed channels
    (`TrueGuidance`); a request without a negative prompt guides with " " (the pipelines' documented usage:
    `empty_negative`). The request's `guidance_scale` is the pipeline's `true_cfg_scale`;
  * the VAE's latents are normalised per channel: decode reads latents * latents_std + latents_mean.
Split files (ComfyUI's transformer, Qwen2.5-VL encoder and VAE; the transformer also as a city96 GGUF, dequantised
as it is read): `load_split`, through qwen_image_files.py. A split Qwen-Image file is read by this family unless its
sidecar's preset or its name says Edit (split_files.py's variants; qwen_image_edit.py).
LoRA files per row: read by QwenImagePipeline's converter (`lora_layout`: diffusers / PEFT, Kohya, ComfyUI and
lightx2v keys), its side paths on the blocks' attention, feed-forwards and modulation.
The Lightning LoRAs' schedule (mu = log 3 at every size) is the request's `schedule` "lightning", per row, or their
sidecar's (features/slot_files.py); a request's `schedule_shift` fixes the shift of either schedule (`flow_schedules`).
Its Edit line (QwenImageEditPlusPipeline: input images through the vision tower and as reference tokens) is
qwen_image_edit.py, on this module's blocks: `denoise` appends a row's reference tokens (`rows.ref_*`) to its image
stream where the family declares them.
Not here yet: fp8 kept as fp8 from a file.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ... import safe_files
from ...features.base import RowFeature, StepView
from ...features.guidance import ClassifierFreeGuidance
from ...lora.targets import DENOISER, LoraLayout
from ...request import Size
from ...sampling.flow import FlowSchedule, flow_plan
from ...sampling.samplers import SamplerPlan
from ...text.prepared import VisionImage
from ..model import DiffusionModel
from ..qwen_tokenizer import qwen_tokenizer
from .base import Conditioning, CondSpec, Planner
from .flux2 import rotate
from .tokens import FOLDER_PARTS, TokenFamily, random_modules

# the pipeline's prompt_template_encode, around the prompt, and its prompt_template_encode_start_idx
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
            "<|im_end|>\n<|im_start|>assistant\n")
DROPPED = 34
IMAGE_PAD = "<|image_pad|>"  # Qwen2.5-VL's placeholder: one token per merged vision patch
MAX_TEXT_TOKENS = 1024      # the pipeline's tokenizer_max_length (after the dropped tokens)
ROPE_THETA = 10000
# Qwen/Qwen-Image's scheduler/scheduler_config.json
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
             "time_shift_type": "exponential"}
# Qwen-Image-Lightning's scheduler (its release's FlowMatchEulerDiscreteScheduler config): the exponential shift at
# mu = log 3 for every size, no terminal stretch; the family's schedule "lightning"
LIGHTNING = {**SCHEDULER, "base_shift": math.log(3), "max_shift": math.log(3), "shift_terminal": None}
QWEN_IMAGE_20B = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
QWEN25_VL_7B = dict(text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                                       temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]))
# the layers LoRA files for it train: both streams' attention and feed-forwards, and the blocks' modulation
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2", "img_mod.1", "txt_mod.1")
FP8_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
               "txt_mlp.net.2")


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint's defaults: the pipeline's steps and true CFG scale, the model card's native size."""

    name: str
    steps: int
    guidance: float     # diffgraph's scale (the pipeline's true_cfg_scale)
    native: int = 1328


QWEN_IMAGE = Checkpoint("qwen-image", 50, 4.0)


class TrueGuidance(ClassifierFreeGuidance):
    """QwenImagePipeline's true CFG: where a row guides, `neg + g (pos - neg)` rescaled per token to the prompt
    branch's norm over the packed channels (`comb * |cond| / |comb|`); a row with one branch is its output as is."""

    def combine(self, view: StepView, main: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
        guided = super().combine(view, main, alt)
        cond = torch.linalg.vector_norm(main.float(), dim=-1, keepdim=True)
        comb = torch.linalg.vector_norm(guided.float(), dim=-1, keepdim=True)
        ratio = torch.where(comb > 0, cond / comb.clamp(min=1e-30), torch.ones_like(comb))  # padding tokens: 0
        return torch.where(view.column("guidance") != 1, guided * ratio.to(guided.dtype), guided)


def axis_angles(net: Any, positions: torch.Tensor) -> torch.Tensor:
    """Rotary angles [..., head_dim / 2] of 3-axis positions [..., 3] (QwenEmbedRope's `rope_params` per axis)."""
    parts = []
    for axis, dim in enumerate(net.config.axes_dims_rope):
        inv = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, device=positions.device).float().div(dim))
        parts.append(positions[..., axis:axis + 1].float() * inv)
    return torch.cat(parts, dim=-1)


def rope_tables(net: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., head_dim] of 3-axis positions [..., 3], each angle twice (diffusers' interleaved form)."""
    angles = axis_angles(net, positions).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def row_rope(net: Any, positions: torch.Tensor, image_mask: torch.Tensor, text: int,
             offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n, text + tokens, head_dim] of each row's text then image tokens, from its grid `positions`
    [n, tokens, 2] (padding at -1): the pipeline's centred image positions and text after the largest half extent of
    the row's images (the image's, or `offset` where the row's reference images reach further)."""
    grid = positions.amax(dim=1) + 1                              # [n, 2]: the row's grid height and width
    half = grid // 2
    start = (grid - half).unsqueeze(1)                            # rows above / columns left of the centre
    image = torch.cat([torch.zeros_like(positions[..., :1]), positions - start], dim=-1)
    image = torch.where(image_mask.unsqueeze(-1), image, torch.zeros_like(image))
    k = torch.arange(text, device=positions.device)
    offset = half.amax(dim=1, keepdim=True).clamp(min=offset)     # [n, 1]
    words = (offset + k).unsqueeze(-1).expand(-1, -1, 3)
    return rope_tables(net, torch.cat([words, image], dim=1))


def modulate(x: torch.Tensor, mod: torch.Tensor, ref_mod: torch.Tensor | None = None,
             tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x * (1 + scale) + shift and the gate, from a [n, 3 * dim] modulation (QwenImageTransformerBlock's order); with
    `ref_mod` (Edit-2511's `zero_cond_t`) the tokens past the first `tokens` (the references) take that one."""
    shift, scale, gate = mod.unsqueeze(1).chunk(3, dim=-1)
    if ref_mod is not None:
        first = (torch.arange(x.shape[1], device=x.device) < tokens)[None, :, None]
        shift, scale, gate = (torch.where(first, a, b) for a, b in zip((shift, scale, gate),
                                                                       ref_mod.unsqueeze(1).chunk(3, dim=-1)))
    return x * (1 + scale) + shift, gate


def joint_attention(attn: Any, img: torch.Tensor, txt: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenDoubleStreamAttnProcessor2_0 with per-row RoPE tables (text first) and a key mask [n, 1, 1, S]."""
    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (attn.heads, -1))
    q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(txt))), attn.norm_q(heads(attn.to_q(img)))], dim=1)
    k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(txt))), attn.norm_k(heads(attn.to_k(img)))], dim=1)
    v = torch.cat([heads(attn.add_v_proj(txt)), heads(attn.to_v(img))], dim=1)
    q, k = rotate(q, *rope), rotate(k, *rope)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keys)
    out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
    text = txt.shape[1]
    return attn.to_out[0](out[:, text:].contiguous()), attn.to_add_out(out[:, :text].contiguous())


def block_step(block: Any, h: torch.Tensor, c: torch.Tensor, temb: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, ref_temb: torch.Tensor | None = None,
               tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`QwenImageTransformerBlock.forward` with per-row RoPE and a key mask: image stream h, text stream c; with
    `ref_temb` (zero_cond_t) the image stream's tokens past the first `tokens` modulated by it."""
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    ref1, ref2 = block.img_mod(ref_temb).chunk(2, dim=-1) if ref_temb is not None else (None, None)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    img, img_gate = modulate(block.img_norm1(h), img_mod1, ref1, tokens)
    txt, txt_gate = modulate(block.txt_norm1(c), txt_mod1)
    img_out, txt_out = joint_attention(block.attn, img, txt, rope, keys)
    h = h + img_gate * img_out
    c = c + txt_gate * txt_out
    img, img_gate = modulate(block.img_norm2(h), img_mod2, ref2, tokens)
    h = h + img_gate * block.img_mlp(img)
    txt, txt_gate = modulate(block.txt_norm2(c), txt_mod2)
    c = c + txt_gate * block.txt_mlp(txt)
    if c.dtype == torch.float16:
        c = c.clip(-65504, 65504)
    if h.dtype == torch.float16:
        h = h.clip(-65504, 65504)
    return h, c


class QwenImageFamily(TokenFamily):
    name = "qwen-image"
    pipeline_classes = ("QwenImagePipeline",)
    default_guidance = QWEN_IMAGE.guidance
    patch = 2
    token_bucket = 256
    text_tokens = MAX_TEXT_TOKENS
    text_buckets = (128, 256, 512, MAX_TEXT_TOKENS)
    size_multiple = 16
    fp8_linears = FP8_LINEARS
    schedules = ("default", "lightning")
    empty_negative = " "
    template_dropped = DROPPED
    template = TEMPLATE       # the pipeline's prompt template around the prompt (its first `template_dropped` dropped)
    checkpoint = QWEN_IMAGE   # a folder's or split files' defaults
    reads_zero_cond_t = False  # Edit-2511's reference-token modulation (an Edit family's)

    # -- loading ---------------------------------------------------------------------------------------
    def load_folder(self, folder: str, index: dict[str, Any], device: torch.device, dtype: torch.dtype,
                    name: str) -> DiffusionModel:
        """A QwenImagePipeline folder: its transformer, VAE, Qwen2.5-VL encoder and scheduler config; its tokenizer
        if it has one, else the shipped Qwen2.5 tokenizer (the same vocabulary)."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        from ..stream_load import load_part

        for sub in FOLDER_PARTS:
            if sub != "tokenizer" and not os.path.isdir(os.path.join(folder, sub)):
                raise ValueError(f"{folder!r} is a QwenImagePipeline folder but lacks its '{sub}' subfolder; point "
                                 "diffgraph at a complete diffusers folder (e.g. saved with save_pretrained)")
        label = f"model folder {folder!r}"
        try:
            scheduler = safe_files.read_json(os.path.join(folder, "scheduler", "scheduler_config.json"), 1 << 20)[0]
        except safe_files.UnusableFile as e:
            raise ValueError(f"{label}: scheduler/scheduler_config.json {e}") from None
        if scheduler.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"{label}: scheduler time_shift_type {scheduler['time_shift_type']!r} is not "
                             "Qwen-Image's 'exponential'; restore the published scheduler_config.json")
        tokenizer_dir = os.path.join(folder, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True) \
            if os.path.isdir(tokenizer_dir) else qwen_tokenizer("qwen2.5")
        encoder = load_part(Qwen2_5_VLForConditionalGeneration, folder, label, "text_encoder", dtype, device=device)
        transformer = load_part(QwenImageTransformer2DModel, folder, label, "transformer", dtype, device=device)
        vae = load_part(AutoencoderKLQwenImage, folder, label, "vae", dtype, device=device)
        return self._model(name, transformer, vae, encoder, tokenizer, scheduler, device, dtype, self.checkpoint)

    def _model(self, name: str, transformer: Any, vae: Any, encoder: Any, tokenizer: Any,
               scheduler_config: dict[str, Any], device: torch.device, dtype: torch.dtype,
               checkpoint: Checkpoint, is_random: bool = False) -> DiffusionModel:
        """The modules in `dtype` on `device`; the encoder without its language-model head (only hidden states are
        read)."""
        encoder = getattr(encoder, "model", encoder)  # Qwen2_5_VLForConditionalGeneration's base model
        width = text_width(encoder)
        if int(transformer.config.joint_attention_dim) != width:
            raise ValueError(f"the transformer reads {transformer.config.joint_attention_dim}-wide text but the "
                             f"encoder gives {width}; use the checkpoint's own text encoder")
        variants = ("use_layer3d_rope", "guidance_embeds", "use_additional_t_cond") + \
            (() if self.reads_zero_cond_t else ("zero_cond_t",))
        if any(getattr(transformer.config, k, False) for k in variants):
            raise ValueError("this Qwen-Image transformer is an Edit-2511, Layered or guidance-distilled variant, "
                             "which diffgraph does not read yet; use a QwenImagePipeline checkpoint")
        for m in (transformer, vae, encoder):
            m.to(device=device, dtype=dtype).eval().requires_grad_(False)
        return DiffusionModel(name=name, family=self.name, adapter=self, denoiser=transformer, vae=vae,
                              text_encoders=[encoder], tokenizers=[tokenizer], scheduler_config=scheduler_config,
                              device=device, dtype=dtype, native_size=checkpoint.native, is_random=is_random,
                              extra={"checkpoint": checkpoint})

    def load_split(self, files: Any, device: torch.device, dtype: torch.dtype, name: str) -> DiffusionModel:
        """ComfyUI's three files, each streamed into a module built on meta (split_stream.py; qwen_image_files.py:
        the transformer in diffusers' names, safetensors or GGUF, the Qwen2.5-VL file's language model, the VAE in Wan
        2.1's layout); the configs come from the weights' shapes, the tokenizer is the shipped Qwen2.5 one, the
        scheduler the published one."""
        from diffusers import AutoencoderKLQwenImage

        from .. import qwen_image_files as qf, split_stream
        transformer, encoder = split_stream.load_qwen_image(files.diffusion_model, files.text_encoder, dtype, device,
                                                            **self.split_reading(files))
        vae = split_stream.load_vae(AutoencoderKLQwenImage, qf.vae_config(files.vae),
                                    lambda config: qf.read_vae(files.vae, config, dtype), dtype, device)
        return self._model(name, transformer, vae, encoder, qwen_tokenizer("qwen2.5"), dict(SCHEDULER), device, dtype,
                           self.checkpoint)

    def split_reading(self, files: Any) -> dict[str, bool]:
        """How `load_split` reads the files for this family (split_stream's `load_qwen_image` keywords): text-to-image
        reads the encoder's language model alone."""
        return {}

    # -- random presets ----------------------------------------------------------------------------------
    def random_presets(self) -> dict[str, str]:
        return {"random:qwen-image": "Qwen-Image's true architecture (20B MMDiT, Qwen2.5-VL-7B, its VAE), random "
                                     "weights, for GPU timing",
                "random:qwen-image-tiny": "a tiny Qwen-Image (two blocks, a two-layer Qwen2.5-VL, a narrow VAE), "
                                          "random weights, for CPU tests"}

    def build_random(self, name: str, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        """The true architecture (the family's checkpoint's defaults), or its "-tiny" preset at test size (native
        size 128)."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        if name not in self.random_presets():
            raise ValueError(f"family {self.name!r} has no random preset {name!r}")
        tiny = name.endswith("-tiny")
        with random_modules(device, dtype):
            transformer = QwenImageTransformer2DModel(**(tiny_transformer() if tiny else QWEN_IMAGE_20B))
            encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**(tiny_encoder() if tiny else
                                                                               QWEN25_VL_7B)))
            vae = AutoencoderKLQwenImage(**(tiny_vae() if tiny else {}))
        base = self.checkpoint
        checkpoint = Checkpoint(f"{base.name}-tiny", base.steps, base.guidance, native=128) if tiny else base
        return self._model(name, transformer, vae, encoder, qwen_tokenizer("qwen2.5"), dict(SCHEDULER), device,
                           dtype, checkpoint, is_random=True)

    # -- guidance and the checkpoint's defaults ------------------------------------------------------------
    def features(self, model: DiffusionModel, *args: Any, **kwargs: Any) -> tuple[RowFeature, ...]:
        """The token families' features, with the pipeline's true CFG (per-token norm rescale) for CFG's."""
        return tuple(TrueGuidance(f._cond, f._sequence) if type(f) is ClassifierFreeGuidance else f
                     for f in super().features(model, *args, **kwargs))

    def default_steps(self, model: DiffusionModel) -> int | None:
        return model.extra["checkpoint"].steps

    def lora_layout(self, model: DiffusionModel) -> LoraLayout | None:
        """`transformer.*` (diffusers / PEFT) files and the layouts QwenImagePipeline's converter reads."""
        return LoraLayout((("transformer", DENOISER),), LORA_TARGETS, pipeline_class="QwenImagePipeline")

    def model_guidance(self, model: DiffusionModel) -> float:
        return model.extra["checkpoint"].guidance

    # -- sampling: the model's schedule, or the Lightning releases' ----------------------------------------
    def flow_schedules(self, model: DiffusionModel) -> dict[str, FlowSchedule]:
        return {"default": FlowSchedule.from_config(model.scheduler_config),
                "lightning": FlowSchedule.from_config(LIGHTNING)}

    def planner(self, model: DiffusionModel) -> Planner:
        """Flow samplers over the model's schedule ("default": its scheduler config's dynamic shift of the row's
        tokens, stretched to its terminal) or the Lightning LoRAs' ("lightning": mu = log 3 at every size)."""
        flows = self.flow_schedules(model)

        @functools.lru_cache(maxsize=256)
        def plan(sampler: str, schedule: str, steps: int, size: Size) -> SamplerPlan:
            self.check(sampler, schedule, size)
            h, w = self.grid(model, size)
            return flow_plan(sampler, schedule, flows[schedule], steps, h * w)
        return plan

    # -- layout and the VAE: a one-frame video VAE, latents normalised per channel ------------------------
    def vae_scale_factor(self, model: DiffusionModel) -> int:
        return 2 ** len(model.vae.config.temperal_downsample)

    def latent_channels(self, model: DiffusionModel) -> int:
        return int(model.vae.config.z_dim)

    def decode(self, model: DiffusionModel, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """Latents [n, 16, h, w] -> pixels in [0, 1]: latents * latents_std + latents_mean, the VAE's decode."""
        latents = latents.to(self.vae_dtype(model))
        shape = (1, latents.shape[1], 1, 1)
        mean = torch.tensor(decoder.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(decoder.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        image = self.vae_decode(model, decoder, latents * std + mean)
        return (image * 0.5 + 0.5).clamp(0, 1)

    def vae_decode(self, model: DiffusionModel, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """[n, 16, h, w] -> [n, 3, H, W] through the video VAE's one frame; above the native area in its own tiles
        (`tiled_decode`, as `enable_tiling()`)."""
        factor = self.vae_scale_factor(model)
        video = latents.unsqueeze(2)
        if self.tiles(model, (latents.shape[-2] * factor, latents.shape[-1] * factor)):
            return decoder.tiled_decode(video, return_dict=False)[0][:, :, 0]
        return decoder.decode(video, return_dict=False)[0][:, :, 0]

    # -- text --------------------------------------------------------------------------------------------
    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        dim = text_width(model.text_encoders[0])
        return {"embeds": ((self.text_tokens, dim), model.dtype), "mask": ((self.text_tokens,), torch.bool)}

    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        """Each prompt in the template, read by the encoder with its mask; the last hidden state of its tokens after
        the template's first `template_dropped` (the pipeline's `_get_qwen_prompt_embeds`)."""
        before, after = self.template
        return self.read(model, [before + p + after for p in prompts])

    def read(self, model: DiffusionModel, texts: list[str], images: tuple[VisionImage, ...] = ()) -> Conditioning:
        """Whole templated texts read by the Qwen2.5-VL encoder with their mask, and `images` (their placeholders'
        vision inputs, in order) through its vision tower at their tokens, with the model's multimodal positions
        (`mm_token_type_ids`: 1 at an image's tokens); the last hidden state of each text's tokens after the
        template's first `template_dropped`."""
        tokenizer = model.tokenizers[0]
        out = tokenizer(texts, padding="longest", max_length=self.text_tokens + self.template_dropped,
                        truncation=True, padding_side="right", return_tensors="pt")
        ids, mask = out.input_ids.to(model.device), out.attention_mask.to(model.device)
        vision = {}
        if images:
            encoder = model.text_encoders[0]
            vision = {"pixel_values": torch.from_numpy(np.concatenate([i.pixels for i in images])).to(
                          model.device, encoder.visual.dtype),
                      "image_grid_thw": torch.tensor([i.grid for i in images], device=model.device),
                      "mm_token_type_ids": (ids == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()}
        with torch.no_grad():
            hidden = model.text_encoders[0](input_ids=ids, attention_mask=mask, output_hidden_states=True,
                                            use_cache=False, **vision).hidden_states[-1]
        return self.pad_tokens(model, hidden[:, self.template_dropped:], mask[:, self.template_dropped:])

    def prompt_template(self, model: DiffusionModel) -> tuple[str, str] | None:
        return self.template

    def negative(self, model: DiffusionModel, cond: Conditioning, prompts: list[str | None]) -> Conditioning:
        return cond

    # -- the denoiser ------------------------------------------------------------------------------------
    def rope_rows(self, model: DiffusionModel, spec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A row's RoPE tables (`row_rope`: cos and sin [slot + tokens, head_dim], text first), which depend on its
        size and the group's text slot alone: made with its other per-size fields, gathered by the step."""
        cos, sin = row_rope(model.denoiser, spec["positions"][None], spec["image_mask"][None],
                            spec["text_positions"].shape[0])
        return {"rope_cos": cos[0], "rope_sin": sin[0]}

    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity of rows x [n, image tokens, 64] at timesteps t (sigma * 1000) [n]: the transformer's blocks
        on [the group's text slot, image tokens] with each row's RoPE tables and its padding masked (see the
        module's docstring); padding tokens out as 0."""
        net = model.denoiser
        image_mask = rows["image_mask"]
        slot = rows["text_positions"].shape[1]  # the group's text slot: the conditioning's first tokens
        text_mask, embeds = cond["mask"][:, :slot], cond["embeds"][:, :slot]
        rope = rows["rope_cos"], rows["rope_sin"]  # the rows' own tables (`rope_rows`)
        keys = torch.cat([text_mask, image_mask], dim=1)
        tokens = x.shape[1]
        if "ref_tokens" in rows:  # an Edit family's rows: their reference tokens after the image's, outputs dropped
            x = torch.cat([x, rows["ref_tokens"].to(x.dtype)], dim=1)
            rope = tuple(torch.cat([r, rows[f"ref_{f}"]], dim=1) for r, f in zip(rope, ("cos", "sin")))
            keys = torch.cat([keys, rows["ref_mask"]], dim=1)
        keys = keys[:, None, None, :]

        h = net.img_in(x.to(net.dtype))
        timestep = (t.to(x.dtype) / 1000).to(h.dtype)  # as the pipeline rounds it
        temb = net.time_text_embed(timestep, h)
        # Edit-2511 (`zero_cond_t`): the reference tokens modulated as at timestep 0
        ref_temb = net.time_text_embed(timestep * 0, h) if getattr(net, "zero_cond_t", False) else None
        c = net.txt_in(net.txt_norm(embeds.to(net.dtype)))
        for block in net.transformer_blocks:
            h, c = block_step(block, h, c, temb, rope, keys, ref_temb, tokens)
        out = net.proj_out(net.norm_out(h[:, :tokens], temb))
        return out * image_mask.unsqueeze(-1)

    def diffusers_pipeline(self, model: DiffusionModel, scheduler: Any, task: str = "text") -> Any:
        from diffusers import QwenImagePipeline

        if task != "text":
            raise NotImplementedError(f"family {self.name!r} has no {task} pipeline yet")
        return QwenImagePipeline(scheduler=scheduler, vae=model.vae, text_encoder=model.text_encoders[0],
                                 tokenizer=model.tokenizers[0], transformer=model.denoiser)


def text_width(encoder: Any) -> int:
    """The width of the encoder's hidden states (a Qwen2_5_VLModel's text config, or a Qwen2_5_VLTextModel's)."""
    return int(getattr(encoder.config, "text_config", encoder.config).hidden_size)


def tiny_transformer() -> dict[str, Any]:
    """A QwenImageTransformer2DModel config at test size: two blocks, 32 wide, reading 128-wide text; its RoPE axes
    split the head as the published model's (an eighth, then seven sixteenths twice: what split files assume)."""
    return dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
                num_attention_heads=1, joint_attention_dim=128, axes_dims_rope=(4, 14, 14))


def tiny_encoder() -> dict[str, Any]:
    """A Qwen2_5_VLConfig at test size: a two-layer 128-wide language model of one 128-wide head (Qwen2.5's head
    width and mrope sections: what split files assume) with Qwen's vocabulary, tied embeddings, a one-block vision
    tower of one 80-wide head attending in windows (the published towers' head width; their full-attention blocks
    start at the eighth: what split files assume)."""
    return dict(text_config=dict(vocab_size=151936, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=2048,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                tie_word_embeddings=True,
                vision_config=dict(depth=1, hidden_size=80, intermediate_size=32, num_heads=1, out_hidden_size=128,
                                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                   fullatt_block_indexes=[]))


def tiny_vae() -> dict[str, Any]:
    """An AutoencoderKLQwenImage config with the true latent layout (16 channels, 8x down) at test width."""
    return dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])

