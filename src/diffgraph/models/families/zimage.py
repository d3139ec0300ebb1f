"""Z-Image (Tongyi-MAI's Z-Image-Turbo and Z-Image): a single-stream DiT over 2x2 patches of Flux's 16-channel VAE
latents, with a Qwen3 text encoder, on flow matching.

What diffusers' `ZImagePipeline` does, and how rows of different prompts and sizes share one step here:
  * text: each prompt is wrapped in Qwen3's chat template (one user message, the generation prompt, thinking on:
    the shipped template, models/qwen_tokenizer.py, which a folder's must equal),
    tokenised, encoded, and the second-to-last hidden states of its real tokens kept (`encode`: the row's `embeds`
    with its `mask`, the prompt's own length, up to `text_tokens`);
  * the transformer reads a row as its image tokens (2x2 latent cells each, channels innermost: `pack`) padded to a
    multiple of 32 with a learnt pad token, then its caption tokens padded to a multiple of 32 with another; the pad
    tokens attend like real ones. RoPE positions are 3-axis: caption token k at (1 + k, 0, 0), image token (r, c) at
    (padded caption length + 1, r, c), image pad tokens at (0, 0, 0). diffusers builds that sequence from Python
    lengths; here each row carries its rotary tables and image keys, made once per size and text slot (`rope_rows`),
    and `denoise` gathers the one caption-dependent axis by the caption length of the row's mask, with the bucket's
    slack beyond each row's padded lengths masked out of attention, so a row's output never depends on its
    companions and one replay serves any mix;
  * timesteps: the model reads 1 - sigma (times `t_scale`) and predicts -velocity;
  * guidance as diffusers defines it, `pos + g' (pos - neg)` where g' > 0: diffgraph's `guidance_scale` keeps its
    one meaning across families (1 is off, CFG's `neg + g (pos - neg)`), so a request's g is the pipeline's g' + 1;
  * the VAE: latents / scaling_factor + shift_factor, then decode.

Checkpoints of one architecture differ in their defaults (Turbo: 8 steps without guidance; base: guided):
`CHECKPOINTS` names them, chosen from the folder's name or its sidecar's `preset`; a folder carries its own
scheduler config, split files get their checkpoint's (`Checkpoint.scheduler_config`: Turbo's shift 3, base's 6).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...errors import ParamError
from ...features.base import RowFeature, StepView
from ...features.capability import Capability, Param
from ...features.guidance import ClassifierFreeGuidance, guiding_steps
from ...lora.targets import DENOISER, LoraLayout
from ...request import GenerationRequest
from ..model import DiffusionModel
from ..qwen_tokenizer import chat_prompt, qwen_tokenizer
from .base import Conditioning, CondSpec
from .first_block_cache import run_blocks, sequential
from .token_cache import TokenStepCache, cached_denoise
from .tokens import TokenFamily, qwen3_folder_parts, random_modules

SEQ_MULTIPLE = 32           # the transformer pads caption and image tokens to multiples of this
MAX_TEXT_TOKENS = 512       # diffusers' max_sequence_length (template included)
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False, sample_size=1024)
# the layers LoRA files for it train (every block's attention and feed-forward, and the blocks' modulation)
LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0")


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint's defaults (its model card) and its scheduler's fixed shift (its repository's
    scheduler/scheduler_config.json: Turbo's 3.0, the base model's 6.0), what split files are sampled with."""

    name: str
    steps: int
    guidance: float      # diffgraph's scale (1: no guidance)
    shift: float = 3.0

    def scheduler_config(self) -> dict[str, Any]:
        """Its published scheduler config (FlowMatchEulerDiscreteScheduler's), for files that carry none."""
        return {"num_train_timesteps": 1000, "shift": self.shift, "use_dynamic_shifting": False}


CHECKPOINTS = {"z-image-turbo": Checkpoint("z-image-turbo", 8, 1.0, shift=3.0),
               "z-image": Checkpoint("z-image", 50, 5.0, shift=6.0),
               "digits-zimage": Checkpoint("digits-zimage", 8, 3.0)}  # shipped: tools/train_digits_zimage.py


def checkpoint_of(path: str, preset: str | None = None) -> Checkpoint:
    """The checkpoint at `path` (a folder or a file): `preset` (a sidecar's) if given, else the last part of the path
    that names Z-Image (a hub cache's snapshot folder sits under the repository's name); else a ValueError naming
    the choices."""
    if preset is not None:
        key = preset.strip().lower()
        if key not in CHECKPOINTS:
            raise ValueError(f"Z-Image preset {preset!r} is unknown; use one of {', '.join(CHECKPOINTS)}")
        return CHECKPOINTS[key]
    for part in reversed(os.path.normpath(os.path.abspath(path)).lower().replace("_", "-").split(os.sep)):
        if part in CHECKPOINTS:
            return CHECKPOINTS[part]
        if "z-image" in part or "zimage" in part:
            return CHECKPOINTS["z-image-turbo" if "turbo" in part else "z-image"]
    raise ValueError(f"cannot tell which Z-Image checkpoint {os.path.basename(path)!r} is; keep the published name "
                     f"(Z-Image-Turbo or Z-Image) in its folder or file name, or set `preset` in its sidecar to one "
                     f"of {', '.join(CHECKPOINTS)}")


def lora_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LoRA files in the original layout (ComfyUI's, `diffusion_model.` / `lora_unet_` keys) made readable by diffusers'
    converter: a fused `attention.qkv` adapter becomes three (the down weight shared, the up weight's rows split in
    thirds: Z-Image's q, k and v are equally wide) and `attention.out` is `attention.to_out.0`."""
    out = {}
    for key, value in state.items():
        for fused in (".attention.qkv.", "_attention_qkv."):
            if fused not in key:
                continue
            up = ".lora_B." in key or ".lora_up." in key
            for i, name in enumerate(("to_q", "to_k", "to_v")):
                part = value.chunk(3, dim=0)[i] if up else value
                out[key.replace(fused, fused.replace("qkv", name))] = part.contiguous()
            break
        else:
            out[key.replace(".attention.out.", ".attention.to_out.0.")] = value
    return out


class GuidanceShaping(Capability):
    """ZImagePipeline's two guidance options, per request: `cfg_truncation` (guide only while the normalised time
    1 - sigma is at most it; 1: every step) and `cfg_normalization` (a guided prediction's norm at most this many
    times the prompt branch's; 0: no clamp). Checked here; the family's guidance feature (`ZImageGuidance`) reads them
    from the request in the step."""

    name = "cfg_shaping"
    params = (Param("cfg_truncation", 1.0, float, "guide only while 1 - sigma <= this (ZImagePipeline's)"),
              Param("cfg_normalization", 0.0, float, "clamp a guided prediction's norm to this times the prompt "
                                                     "branch's; 0: off (ZImagePipeline's)"))

    def applies(self, model: Any) -> bool:
        return isinstance(model.adapter, ZImageFamily)

    def check(self, values: dict[str, Any], settings: Any) -> None:
        truncation, norm = values["cfg_truncation"], values["cfg_normalization"]
        if not 0.0 <= truncation <= 1.0:
            raise ParamError("cfg_truncation", f"cfg_truncation {truncation:g} is out of range; allowed: 0..1 (1 "
                                               "guides every step)")
        if not 0.0 <= norm <= 100.0:
            raise ParamError("cfg_normalization", f"cfg_normalization {norm:g} is out of range; allowed: 0 (off) "
                                                  "or a ratio up to 100")


def _option(request: GenerationRequest, param: Param) -> float:
    value = dict(request.extras).get(param.name)
    return param.neutral if value is None else float(value)


class ZImageGuidance(ClassifierFreeGuidance):
    """Classifier-free guidance as ZImagePipeline applies it: a row guides at a step where its scale is above 1, the
    step is in its `guidance_interval` and 1 - sigma <= its cfg_truncation; with cfg_normalization > 0 the guided
    prediction's norm (over the row's tokens) is clamped to that ratio of the prompt branch's."""

    def __init__(self, base: ClassifierFreeGuidance, sigmas: Callable[[GenerationRequest], np.ndarray]):
        super().__init__(base._cond, base._sequence)
        self._sigmas = sigmas

    def columns(self) -> tuple[str, ...]:
        return super().columns() + ("cfg_normalization",)

    def _on(self, request: GenerationRequest, index: np.ndarray) -> np.ndarray:
        truncation = _option(request, GuidanceShaping.params[0])
        times = 1.0 - self._sigmas(request)[np.asarray(index)]
        return guiding_steps(request, index) & (times <= truncation)

    def plan_columns(self, request: GenerationRequest, index: np.ndarray) -> dict[str, np.ndarray]:
        on = self._on(request, index)
        return {"guidance": np.where(on, request.guidance_scale, 1.0),
                "guidance_rescale": np.where(on, request.guidance_rescale, 0.0),
                "cfg_normalization": np.where(on, _option(request, GuidanceShaping.params[1]), 0.0)}

    def branches(self, request: GenerationRequest, index: np.ndarray) -> np.ndarray:
        return np.where(self._on(request, index), 2, 1)

    def combine(self, view: StepView, main: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
        guided = super().combine(view, main, alt)
        ratio = view.column("cfg_normalization")
        dims = list(range(1, main.dim()))
        limit = ratio * torch.linalg.vector_norm(main.float(), dim=dims, keepdim=True)
        norm = torch.linalg.vector_norm(guided.float(), dim=dims, keepdim=True)
        scale = torch.where((ratio > 0) & (norm > limit), limit / norm.clamp(min=1e-30), torch.ones_like(norm))
        return guided * scale.to(guided.dtype)


def ceil_to(n: torch.Tensor, multiple: int) -> torch.Tensor:
    return (n + multiple - 1) // multiple * multiple


class ZImageFamily(TokenFamily):
    name = "zimage"
    pipeline_classes = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")
    default_guidance = 1.0
    patch = 2
    channels_innermost = True      # its tokens' features: (patch row, patch column, channel)
    token_bucket = 256
    text_tokens = MAX_TEXT_TOKENS
    text_buckets = (128, 256, MAX_TEXT_TOKENS)  # a short prompt's rows read 128 text tokens, not 512
    size_multiple = 16
    supports_edits = True          # image-to-image (ZImageImg2ImgPipeline); its packed rows take no inpainting mask
    edit_strength = (0.6, 1.0)     # ZImageImg2ImgPipeline's default strength
    edit_steps_rule = "flow"
    fp8_linears = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                   "feed_forward.w2", "feed_forward.w3")

    # -- loading ---------------------------------------------------------------------------------------
    def load_folder(self, folder: str, index: dict[str, Any], device: torch.device, dtype: torch.dtype,
                    name: str) -> DiffusionModel:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel

        from ..stream_load import load_part

        encoder, tokenizer, scheduler_config = qwen3_folder_parts(folder, "ZImagePipeline", dtype)
        label = f"model folder {folder!r}"
        transformer = load_part(ZImageTransformer2DModel, folder, label, "transformer", dtype, device=device)
        vae = load_part(AutoencoderKL, folder, label, "vae", dtype, device=device)
        return self._model(name, transformer, vae, encoder, tokenizer, scheduler_config, device, dtype,
                           checkpoint_of(name))

    def _model(self, name: str, transformer: Any, vae: Any, encoder: Any, tokenizer: Any,
               scheduler_config: dict[str, Any], device: torch.device, dtype: torch.dtype,
               checkpoint: Checkpoint, is_random: bool = False) -> DiffusionModel:
        for m in (transformer, vae, encoder):
            m.to(device=device, dtype=dtype).eval().requires_grad_(False)
        transformer.rope_embedder(torch.zeros((1, 3), dtype=torch.int64, device=device))  # its tables, on the device
        native = int(getattr(vae.config, "sample_size", 1024) or 1024)  # the VAE's (Flux's: 1024)
        return DiffusionModel(name=name, family=self.name, adapter=self, denoiser=transformer, vae=vae,
                              text_encoders=[encoder], tokenizers=[tokenizer], scheduler_config=scheduler_config,
                              device=device, dtype=dtype, native_size=native, is_random=is_random,
                              extra={"checkpoint": checkpoint})

    def load_split(self, files: Any, device: torch.device, dtype: torch.dtype, name: str) -> DiffusionModel:
        """ComfyUI's three files, each streamed into a module built on meta (split_stream.py: zimage_files' checked
        reading, any of its layouts and fp8 conventions); the configs come from the weights' shapes, the tokenizer
        is the shipped Qwen3's, the checkpoint (Turbo or base: its defaults and its scheduler's shift) its sidecar's
        preset or else its file name."""
        from diffusers import AutoencoderKL

        from .. import split_stream, zimage_files as zf
        checkpoint = checkpoint_of(files.diffusion_model, files.preset)  # before any weight is read
        transformer = split_stream.load_transformer(files.diffusion_model, dtype, device)[0]
        encoder = split_stream.load_text_encoder(files.text_encoder, dtype, device)[0]
        vae = split_stream.load_vae(AutoencoderKL, zf.vae_config(files.vae, FLUX_VAE),
                                    lambda config: zf.read_vae(files.vae, config, dtype), dtype, device)
        return self._model(name, transformer, vae, encoder, qwen_tokenizer("qwen3"), checkpoint.scheduler_config(),
                           device, dtype, checkpoint)

    # -- random presets ----------------------------------------------------------------------------------
    def random_presets(self) -> dict[str, str]:
        return {"random:zimage-turbo": "Z-Image-Turbo's true architecture (6.15B DiT, Qwen3-4B, Flux VAE), random "
                                       "weights, for GPU timing",
                "random:zimage-base": "Z-Image (base)'s true architecture, random weights, with the base checkpoint's "
                                      "defaults (50 steps, guidance 5, shift 6), for GPU timing",
                "random:zimage-tiny": "a tiny Z-Image (two layers, a two-layer Qwen3), random weights, for CPU tests"}

    def build_random(self, name: str, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        if name not in self.random_presets():
            raise ValueError(f"family {self.name!r} has no random preset {name!r}")
        tiny = name == "random:zimage-tiny"
        with random_modules(device, dtype):
            if tiny:
                transformer = ZImageTransformer2DModel(
                    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2,
                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12],
                    axes_lens=[1024, 256, 256])
                encoder = Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2,
                                                 num_key_value_heads=1, head_dim=16,
                                                 max_position_embeddings=1024))
                vae = AutoencoderKL(**{**FLUX_VAE, "block_out_channels": (16, 32, 32, 32), "layers_per_block": 1,
                                       "sample_size": 64, "norm_num_groups": 8})  # 8x, as Flux's
            else:
                transformer = ZImageTransformer2DModel()
                encoder = Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                                                 num_hidden_layers=36, num_attention_heads=32,
                                                 num_key_value_heads=8, head_dim=128,
                                                 max_position_embeddings=40960, rope_theta=1000000.0,
                                                 tie_word_embeddings=True))
                vae = AutoencoderKL(**FLUX_VAE)
        checkpoint = CHECKPOINTS["z-image" if name == "random:zimage-base" else "z-image-turbo"]
        return self._model(name, transformer, vae, encoder, qwen_tokenizer("qwen3"), checkpoint.scheduler_config(),
                           device, dtype, checkpoint, is_random=True)

    # -- guidance ---------------------------------------------------------------------------------------------
    def capabilities(self) -> tuple[Capability, ...]:
        return (GuidanceShaping(), TokenStepCache(lambda m: int(m.denoiser.config.dim)))  # TaylorSeer and first-block rows (token_cache.py)

    def features(self, model: DiffusionModel, *args: Any, **kwargs: Any) -> tuple[RowFeature, ...]:
        """The token families' features, with ZImagePipeline's guidance (truncation, normalisation) for CFG's, which
        reads a request's sigmas from the model's planner (`plans`: the runner's, its plans made once for both)."""
        plan = self.plans(model)

        def sigmas(request: GenerationRequest) -> np.ndarray:
            return np.asarray(plan(request.sampler, request.schedule, request.num_inference_steps,
                                   (request.height, request.width)).sigmas)
        return tuple(ZImageGuidance(f, sigmas) if type(f) is ClassifierFreeGuidance else f
                     for f in super().features(model, *args, **kwargs))

    # -- the checkpoint's defaults ---------------------------------------------------------------------------
    def default_steps(self, model: DiffusionModel) -> int | None:
        return model.extra["checkpoint"].steps

    def model_guidance(self, model: DiffusionModel) -> float:
        return model.extra["checkpoint"].guidance

    def lora_layout(self, model: DiffusionModel) -> LoraLayout | None:
        """`transformer.*` (diffusers / PEFT), `diffusion_model.*` and `lora_unet_*` (Kohya, ComfyUI) files, fused
        or split attention projections, read by ZImagePipeline's converter."""
        return LoraLayout((("transformer", DENOISER),), LORA_TARGETS, pipeline_class="ZImagePipeline",
                          prepare=lora_keys)

    # -- layout ---------------------------------------------------------------------------------------------
    def latent_channels(self, model: DiffusionModel) -> int:
        return int(model.vae.config.latent_channels)

    # -- text --------------------------------------------------------------------------------------------
    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        dim = int(model.text_encoders[0].config.hidden_size)
        return {"embeds": ((self.text_tokens, dim), model.dtype), "mask": ((self.text_tokens,), torch.bool)}

    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        ids, mask = self.tokenize_padded(model, [chat_prompt(p, "qwen3", enable_thinking=True) for p in prompts])
        with torch.no_grad():
            hidden = model.text_encoders[0](input_ids=ids, attention_mask=mask.bool(),
                                            output_hidden_states=True).hidden_states[-2]
        return self.pad_tokens(model, hidden, mask)

    def prompt_template(self, model: DiffusionModel) -> tuple[str, str] | None:
        before, _, after = chat_prompt("\0", "qwen3", enable_thinking=True).partition("\0")
        return before, after

    def negative(self, model: DiffusionModel, cond: Conditioning, prompts: list[str | None]) -> Conditioning:
        return cond

    # -- the denoiser ------------------------------------------------------------------------------------
    def rope_rows(self, model: DiffusionModel, spec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A row's rotary tables and image keys, which depend on its size and the group's text slot alone:
        `grid_freqs` [tokens, axes 2 and 3] each image token's row and column (its pad tokens' at 0), `text_freqs`
        [slot, all axes] caption token k's at (1 + k, 0, 0) (those past a row's padded caption are never attended),
        `image_keys` [tokens] the image's tokens padded to SEQ_MULTIPLE. Only the first axis of the image tokens
        depends on the row's caption: the step gathers it."""
        rope, positions = model.denoiser.rope_embedder, spec["positions"]
        grid = torch.cat([torch.zeros_like(positions[:, :1]), positions.clamp(min=0)], dim=-1)
        k = spec["text_positions"]
        text = torch.stack([1 + k, torch.zeros_like(k), torch.zeros_like(k)], dim=-1)
        padded = ceil_to(spec["image_mask"].sum(), SEQ_MULTIPLE)
        return {"grid_freqs": rope(grid)[:, int(rope.axes_dims[0]) // 2:], "text_freqs": rope(text),
                "image_keys": torch.arange(positions.shape[0], device=positions.device) < padded}

    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity of rows x [n, image tokens, 64] at timesteps t (sigma * 1000) [n]: ZImageTransformer2DModel's
        forward on a sequence built from tensors (see the module's docstring), its output negated, padding 0."""
        cached = cached_denoise(lambda *a: self.denoise(model, *a), x, t, cond, rows)  # step cache rows
        if cached is not None:
            return cached
        net = model.denoiser
        image_mask, slot_positions = rows["image_mask"], rows["text_positions"]
        slot = slot_positions.shape[1]                      # the group's text slot: the conditioning's first tokens
        text_mask, embeds = cond["mask"][:, :slot], cond["embeds"][:, :slot]
        caption = ceil_to(text_mask.sum(dim=1, keepdim=True), SEQ_MULTIPLE)       # [n, 1] padded caption length
        image_keys, text_keys = rows["image_keys"], slot_positions < caption

        # the rows' rotary tables (`rope_rows`), the image tokens' first axis gathered at the caption's end
        real = image_mask.unsqueeze(-1)
        first = net.rope_embedder.freqs_cis[0][torch.where(image_mask, caption + 1, 0)]
        image_freqs = torch.cat([first, rows["grid_freqs"]], dim=-1)
        text_freqs = rows["text_freqs"]

        adaln = net.t_embedder((1000.0 - t.float()) / 1000.0 * net.t_scale).to(x.dtype)
        embed = net.all_x_embedder[f"{self.patch}-1"]
        h = embed(x.to(embed.weight.dtype))
        h = torch.where(real, h, net.x_pad_token.to(h.dtype))
        for layer in net.noise_refiner:
            h = layer(h, image_keys, image_freqs, adaln)

        c = net.cap_embedder(embeds.to(h.dtype))
        c = torch.where(text_mask.unsqueeze(-1), c, net.cap_pad_token.to(c.dtype))
        for layer in net.context_refiner:
            c = layer(c, text_keys, text_freqs)

        u = torch.cat([h, c], dim=1)
        keys = torch.cat([image_keys, text_keys], dim=1)
        freqs = torch.cat([image_freqs, text_freqs], dim=1)
        image = run_blocks(sequential(net.layers, image_mask.shape[1]), u, (keys, freqs, adaln), image_mask,
                           rows.get("fbc.step"))  # first-block rows
        out = net.all_final_layer[f"{self.patch}-1"](image, c=adaln)
        return -out * real

