"""FLUX.2 [klein] (Black Forest Labs' klein 4B and 9B, step-distilled and base): an MMDiT (double-stream blocks, then
single-stream ones) over the FLUX.2 VAE's 32-channel latents patchified 2x2 into 128 channels, with a Qwen3 text
encoder, on flow matching.

What diffusers' `Flux2KleinPipeline` does, and how rows of different prompts and sizes share one step here:
  * text: each prompt is wrapped in Qwen3's chat template with thinking off (one user message, the generation
    prompt: the shipped template, models/qwen_tokenizer.py, which a folder's must equal), tokenised and padded to 512
    tokens, encoded with its attention mask, and the hidden states after layers 9, 18 and 27 concatenated per token
    (3 x the encoder's width: the transformer's joint width). All 512 tokens, padding included, are the row's
    `embeds`: the transformer attends to every one (FLUX.2 does not trim the padding), so a row has no text mask.
    Layers past 27 never reach the output and are dropped at load;
  * latents: the image's latents live patchified, [128, H/16, W/16], normalised by the VAE's batch-norm statistics;
    the seed's noise is drawn in that shape. So here the latent cell is 16 px (`vae_scale_factor`), a token is one
    cell (`patch` 1) with its 128 channels, in row-major order (the pipeline's `_pack_latents`); the decode
    denormalises, unpatchifies to [32, H/8, W/8] and runs the VAE;
  * the transformer reads text tokens then image tokens with 4-axis RoPE positions (t, h, w, l): text token k at
    (0, 0, 0, k), image token (r, c) at (0, r, c, 0). Each row carries their RoPE tables, made once per size
    (`rope_rows`; its references' at admission), and `denoise` runs the blocks with those per-row tables and the
    bucket's padding tokens masked out of attention (`Flux2Transformer2DModel.forward` takes one set of ids for the
    whole batch), so a row's output never depends on its companions and one replay serves any mix;
  * reference images (`reference_images`, flux2_refs.py): each reference's VAE tokens follow the image's in the image
    stream at (10 + 10 i, r, c, 0), attending and attended, their outputs dropped. The group key's first element,
    a text slot in other token families (every row here reads all 512 text tokens), is the rows' reference tokens
    rounded up to a slot of `token_bucket`s (references.py `reference_bucket`): rows whose references fill one slot
    share a step, their padding masked; in graph mode each slot of a graphed size replays graphs of its own;
  * step caching (`step_cache`, token_cache.py and first_block_cache.py, as Z-Image's): TaylorSeer rows forecast the
    whole transformer's output; first-block rows run the first double block, and the other double blocks and the
    single ones only where its image residual moved (`blocks`); a row's references are gathered with it;
  * image-to-image (an edit's `image` below strength 1; Flux2KleinInpaintPipeline with an all-white mask): the image,
    resized to the request's size, is encoded to its posterior's mode (no draw from the seed), patchified and
    normalised as the latents are (`image_latents`), and noised to the step the strength selects, (1 - sigma) x0 +
    sigma * noise with the seed's noise of a text-to-image row (engine/edits.py; the "flow" strength rule: the full
    schedule, mu included, cut by strength). That pipeline also reads the image as its first reference: the routes
    send it in `reference_images` (the init images, the image parts), a Python caller where it wants it;
  * timesteps: the model reads sigma (as t / 1000, times 1000 inside) and predicts the velocity;
  * the schedule: sigmas linspace(1, 1 / steps) shifted by exp(mu) with the pipeline's empirical mu, which depends
    on the image's token count and the step count (`empirical_mu`);
  * guidance: the step-distilled checkpoints (the pipeline's `is_distilled`) run none, one denoiser row; the base
    ones run classifier-free guidance `neg + g (pos - neg)` above 1, diffgraph's own scale, so a request's value is
    the pipeline's `guidance_scale` unchanged. The pipeline's negative prompt is "" unless embeddings are given; a
    request's `negative_prompt` is encoded as the prompt is.

Checkpoints of one architecture differ in their defaults (distilled: 4 steps, no guidance; base: 50 steps at 4):
`CHECKPOINTS`, chosen by the folder's `is_distilled` where it says (a split file: its sidecar's `preset`), else by
its name.
LoRA files: diffusers / PEFT (`transformer.*`, split q/k/v), ai-toolkit's and ComfyUI's original layout
(`diffusion_model.double_blocks.*`, fused qkv; lora_A/B or lora_down/up with alphas) and Kohya's (`lora_unet_*`), read
by Flux2KleinPipeline's converter after `lora_keys`.
Split files (ComfyUI's transformer, Qwen3 encoder and FLUX.2 VAE): `load_split`. The transformer may be a GGUF
quantisation (city96 / ComfyUI-GGUF's converter, as orabazes' and unsloth's files are made: BFL's names), each tensor
dequantised to the compute dtype on the device as it is read; the Qwen3 encoder may be llama.cpp's GGUF (unsloth's
Qwen3-4B / 8B: gguf_llm.py names it as transformers does).
FLUX.2 [dev] (`Flux2Pipeline`: a Mistral encoder, embedded guidance) is this family with its own text side:
flux2_dev.py. Not here yet: BFL's single files, fp8 kept as fp8.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ...lora.targets import DENOISER, LoraLayout
from ...features.capability import Capability
from ...request import GroupKey, Size
from ...sampling.flow import FlowSchedule, flow_plan
from ...sampling.samplers import SamplerPlan
from ..qwen_tokenizer import chat_prompt, qwen_tokenizer
from ..model import DiffusionModel
from .base import Conditioning, CondSpec, Planner
from .first_block_cache import Blocks, run_blocks
from .flux2_refs import ReferenceImages, normalised, rotary
from .references import NAME as REFERENCES, checked_slot, reference_bucket
from .token_cache import TokenStepCache, cached_denoise
from .tokens import TokenFamily, qwen3_folder_parts, random_modules

MAX_TEXT_TOKENS = 512           # the pipeline's max_sequence_length: every prompt padded to it (template included)
TEXT_LAYERS = (9, 18, 27)       # the encoder's hidden states the pipeline concatenates (text_encoder_out_layers)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
FLUX2_VAE = dict(in_channels=3, out_channels=3, latent_channels=32, block_out_channels=(128, 256, 512, 512),
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 layers_per_block=2, use_quant_conv=True, use_post_quant_conv=True, batch_norm_eps=1e-4,
                 sample_size=1024)
KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, tie_word_embeddings=True)
# the layers LoRA files for it train: the double blocks' attention (both streams) and feed-forwards, the single
# blocks' fused qkv+MLP input and output, and the embedders and output projection some adapters add
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                "ff_context.linear_out", "attn.to_qkv_mlp_proj", "attn.to_out", "x_embedder", "context_embedder",
                "proj_out")
# Kohya's `lora_unet_` names of FLUX.2's layers (BFL's original names, flattened): what the pipeline's converter reads
KOHYA_FLUX2 = ("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_unet_img_in.", "lora_unet_txt_in.",
               "lora_unet_time_in_", "lora_unet_final_layer_")


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint's defaults (its model card) and whether it is step-distilled (no guidance)."""

    name: str
    steps: int
    guidance: float      # diffgraph's scale (1: no guidance)
    distilled: bool


CHECKPOINTS = {"flux.2-klein": Checkpoint("flux.2-klein", 4, 1.0, True),
               "flux.2-klein-base": Checkpoint("flux.2-klein-base", 50, 4.0, False)}


def checkpoint_of(path: str, distilled: bool | None = None, preset: str | None = None) -> Checkpoint:
    """The checkpoint at `path`: `preset` (a split file's sidecar's, a CHECKPOINTS key) if given, else by `distilled`
    (a folder's `is_distilled`) where given, else by the last part of the path that names klein (FLUX.2-klein-4B,
    FLUX.2-klein-base-9B; a hub cache's snapshot folder sits under the repository's name); else a ValueError saying
    what to name it."""
    if preset is not None:
        key = preset.strip().lower()
        if key not in CHECKPOINTS:
            raise ValueError(f"FLUX.2 klein preset {preset!r} is unknown; use one of {', '.join(CHECKPOINTS)}")
        return CHECKPOINTS[key]
    if distilled is not None:
        return CHECKPOINTS["flux.2-klein" if distilled else "flux.2-klein-base"]
    for part in reversed(os.path.normpath(os.path.abspath(path)).lower().replace("_", "-").split(os.sep)):
        if "klein" in part:
            return CHECKPOINTS["flux.2-klein-base" if "base" in part else "flux.2-klein"]
    raise ValueError(f"cannot tell which FLUX.2 klein checkpoint {os.path.basename(path)!r} is; keep the published "
                     "name (FLUX.2-klein-4B, FLUX.2-klein-base-4B, ...) in its folder or file name, set `is_distilled` "
                     f"in its model_index.json, or set `preset` in a split file's sidecar to one of "
                     f"{', '.join(CHECKPOINTS)}")


def lora_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LoRA files made readable by Flux2KleinPipeline's converter, which takes Kohya's `lora_unet_*` with alphas and
    the other layouts with `lora_A` / `lora_B` and no alphas: a `lora_down` / `lora_up` pair outside Kohya's names
    (ComfyUI's `diffusion_model.*`) becomes lora_A / lora_B, and an `alpha` there is folded into the down weight
    (alpha / rank). A Kohya key the converter does not know (it would drop it with a log line) is a ValueError: the
    file was made for another model."""
    foreign = [k for k in state if k.startswith("lora_unet_") and not k.startswith(KOHYA_FLUX2)]
    if foreign:
        raise ValueError(f"its Kohya keys are not FLUX.2's ({foreign[0]}, ...): it was made for another model")
    out, alphas = {}, {}
    for key, value in state.items():
        if key.startswith("lora_unet_"):
            out[key] = value
        elif key.endswith(".alpha"):
            alphas[key[:-len(".alpha")]] = float(value)
        else:
            out[key.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B.")] = value
    for module, alpha in alphas.items():
        down = out.get(f"{module}.lora_A.weight")
        if down is None:
            raise ValueError(f"{module}.alpha has no down weight ({module}.lora_down.weight or .lora_A.weight)")
        out[f"{module}.lora_A.weight"] = down * (alpha / down.shape[0])
    return out


def empirical_mu(image_tokens: int, steps: int) -> float:
    """The FLUX.2 pipelines' time-shift exponent (`compute_empirical_mu`): two lines in the token count, fitted at
    10 and 200 steps, interpolated in the step count; beyond 4300 tokens the 200-step line alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    m_200 = a2 * image_tokens + b2
    if image_tokens > 4300:
        return float(m_200)
    m_10 = a1 * image_tokens + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + m_200 - 200.0 * a)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [n, S, heads, D] with per-row tables [n, S, D] (diffusers' interleaved real form, in fp32)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
           keys: torch.Tensor) -> torch.Tensor:
    """Attention over [n, S, heads, D] after RoPE, keys where `keys` [n, 1, 1, S] is set -> [n, S, heads * D]."""
    q, k = rotate(q, *rope), rotate(k, *rope)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keys)
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)


def double_block(block: Any, h: torch.Tensor, c: torch.Tensor, mod_img: torch.Tensor, mod_txt: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Flux2TransformerBlock.forward` with per-row RoPE and a key mask: image stream h, text stream c."""
    (shift, scale, gate), (shift2, scale2, gate2) = split_mod(mod_img, 2)
    (c_shift, c_scale, c_gate), (c_shift2, c_scale2, c_gate2) = split_mod(mod_txt, 2)
    attn = block.attn
    nh = (1 + scale) * block.norm1(h) + shift
    nc = (1 + c_scale) * block.norm1_context(c) + c_shift

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (-1, attn.head_dim))
    q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(nc))), attn.norm_q(heads(attn.to_q(nh)))], dim=1)
    k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(nc))), attn.norm_k(heads(attn.to_k(nh)))], dim=1)
    v = torch.cat([heads(attn.add_v_proj(nc)), heads(attn.to_v(nh))], dim=1)
    out = attend(q, k, v, rope, keys)
    text = c.shape[1]
    h = h + gate * attn.to_out[0](out[:, text:])
    h = h + gate2 * block.ff(block.norm2(h) * (1 + scale2) + shift2)
    c = c + c_gate * attn.to_add_out(out[:, :text])
    c = c + c_gate2 * block.ff_context(block.norm2_context(c) * (1 + c_scale2) + c_shift2)
    if c.dtype == torch.float16:
        c = c.clip(-65504, 65504)
    return h, c


def single_block(block: Any, u: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 keys: torch.Tensor) -> torch.Tensor:
    """`Flux2SingleTransformerBlock.forward` (text and image tokens in one stream) with per-row RoPE and a key mask."""
    ((shift, scale, gate),) = split_mod(mod, 1)
    attn = block.attn
    proj = attn.to_qkv_mlp_proj((1 + scale) * block.norm(u) + shift)
    qkv, mlp = torch.split(proj, [3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    out = attend(attn.norm_q(q), attn.norm_k(k), v, rope, keys)
    u = u + gate * attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
    if u.dtype == torch.float16:
        u = u.clip(-65504, 65504)
    return u


def blocks(net: Any, tokens: int, length: int) -> Blocks:
    """The transformer's blocks as the first-block cache splits them (first_block_cache.py): the state is the image
    stream h (the image's `tokens` tokens, then the references') and the text stream c (`length` tokens); the first
    double block, then the other double blocks and the single ones over [c, h], to the image's tokens."""
    def first(state: tuple[torch.Tensor, torch.Tensor], mod_img: torch.Tensor, mod_txt: torch.Tensor,
              mod_single: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return double_block(net.transformer_blocks[0], *state, mod_img, mod_txt, (cos, sin), keys)

    def rest(state: tuple[torch.Tensor, torch.Tensor], mod_img: torch.Tensor, mod_txt: torch.Tensor,
             mod_single: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        h, c = state
        for block in net.transformer_blocks[1:]:
            h, c = double_block(block, h, c, mod_img, mod_txt, (cos, sin), keys)
        u = torch.cat([c, h], dim=1)
        for block in net.single_transformer_blocks:
            u = single_block(block, u, mod_single, (cos, sin), keys)
        return u[:, length:length + tokens]
    return Blocks(first, rest, lambda state: state[0][:, :tokens])


def split_mod(mod: torch.Tensor, sets: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    """A modulation [n, 3 * sets * dim] as `sets` (shift, scale, gate) triples of [n, 1, dim]."""
    parts = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return tuple(parts[3 * i:3 * i + 3] for i in range(sets))


def stacked_layers(model: DiffusionModel, ids: torch.Tensor, mask: torch.Tensor,
                   layers: tuple[int, ...]) -> torch.Tensor:
    """The text encoder on padded ids [n, 512] with their mask: the hidden states after `layers` side by side per
    token [n, 512, len(layers) x width], padding tokens included, in the model's dtype (the FLUX.2 pipelines' prompt
    embeddings)."""
    with torch.no_grad():
        hidden = model.text_encoders[0](input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                        output_hidden_states=True, use_cache=False).hidden_states
    return torch.cat([hidden[k] for k in layers], dim=-1).to(model.dtype)


class Flux2KleinFamily(TokenFamily):
    name = "flux2"
    title = "FLUX.2 klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    text_layers = TEXT_LAYERS  # the encoder's hidden states the pipeline stacks per token
    encoder_name = "Qwen3"
    default_guidance = 1.0
    patch = 1                  # a token is one cell of the patchified latents (the VAE's 2x2 folded into channels)
    token_bucket = 256
    fp8_linears = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                   "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                   "ff_context.linear_out", "attn.to_qkv_mlp_proj", "attn.to_out")
    text_tokens = MAX_TEXT_TOKENS
    size_multiple = 16
    edit_images = REFERENCES  # the edits route's image parts are references
    supports_edits = True          # image-to-image below strength 1 (Flux2KleinInpaintPipeline at a full mask)
    edit_strength = (0.8, 1.0)     # that pipeline's default strength; its packed rows take no inpainting mask
    edit_steps_rule = "flow"
    edit_samples_posterior = False  # the pipelines encode an image's posterior mode

    # -- loading ---------------------------------------------------------------------------------------
    def load_folder(self, folder: str, index: dict[str, Any], device: torch.device, dtype: torch.dtype,
                    name: str) -> DiffusionModel:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        from ..stream_load import load_part

        checkpoint = self.folder_checkpoint(name, index)
        encoder, tokenizer, scheduler_config = self.folder_text(folder, dtype)
        if scheduler_config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"model folder {folder!r}: scheduler time_shift_type "
                             f"{scheduler_config['time_shift_type']!r} is not the FLUX.2 pipelines' 'exponential'; "
                             "restore the published scheduler_config.json")
        label = f"model folder {folder!r}"
        transformer = load_part(Flux2Transformer2DModel, folder, label, "transformer", dtype, device=device)
        vae = load_part(AutoencoderKLFlux2, folder, label, "vae", dtype, device=device)
        return self._model(name, transformer, vae, encoder, tokenizer, scheduler_config, device, dtype, checkpoint)

    def folder_checkpoint(self, name: str, index: dict[str, Any]) -> Checkpoint:
        """The checkpoint a folder holds: its model_index.json's `is_distilled` where it says, else its name's."""
        distilled = index.get("is_distilled")
        return checkpoint_of(name, None if distilled is None else bool(distilled))

    def folder_text(self, folder: str, dtype: torch.dtype) -> tuple[Any, Any, dict[str, Any]]:
        """(text encoder, tokenizer, scheduler config) of a diffusers folder (tokens.py `qwen3_folder_parts`)."""
        return qwen3_folder_parts(folder, self.pipeline_classes[0], dtype)

    def load_split(self, files: Any, device: torch.device, dtype: torch.dtype, name: str) -> DiffusionModel:
        """ComfyUI's three files, each streamed into a module built on meta (split_stream.py; flux2_files.py: the
        transformer in BFL's layout, the FLUX.2 VAE by its key map; the text encoder and tokenizer: `split_parts`,
        `split_encoder`); the configs come from the weights' shapes."""
        from diffusers import AutoencoderKLFlux2

        from .. import flux2_files as ff, split_stream, zimage_files as zf
        checkpoint, tokenizer = self.split_parts(files)  # before any weight is read
        transformer = split_stream.load_flux2_transformer(files.diffusion_model, dtype, device)
        encoder = self.split_encoder(files, dtype, device)
        vae = split_stream.load_vae(AutoencoderKLFlux2, zf.vae_config(files.vae, FLUX2_VAE),
                                    lambda config: ff.read_vae(files.vae, config, dtype), dtype, device)
        return self._model(name, transformer, vae, encoder, tokenizer, dict(SCHEDULER), device, dtype, checkpoint)

    def split_parts(self, files: Any) -> tuple[Checkpoint, Any]:
        """(the checkpoint, the tokenizer) of split files, before any weight is read: klein's checkpoint from its
        sidecar's preset or else the transformer file's name, the shipped Qwen3 tokenizer."""
        return checkpoint_of(files.diffusion_model, preset=files.preset), qwen_tokenizer("qwen3")

    def split_encoder(self, files: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """The text encoder file streamed into its module (klein's: a Qwen3 as Z-Image's)."""
        from .. import split_stream

        return split_stream.load_text_encoder(files.text_encoder, dtype, device)[0]

    def _model(self, name: str, transformer: Any, vae: Any, encoder: Any, tokenizer: Any,
               scheduler_config: dict[str, Any], device: torch.device, dtype: torch.dtype,
               checkpoint: Checkpoint, is_random: bool = False) -> DiffusionModel:
        layers, read = int(encoder.config.num_hidden_layers), self.text_layers
        if layers < max(read):
            raise ValueError(f"the text encoder has {layers} layers; {self.title} reads the hidden states after layers "
                             f"{', '.join(map(str, read))}: use the checkpoint's own {self.encoder_name} encoder")
        width = len(read) * int(encoder.config.hidden_size)
        if int(transformer.config.joint_attention_dim) != width:
            raise ValueError(f"the transformer reads {transformer.config.joint_attention_dim}-wide text but the "
                             f"encoder gives {width} ({len(read)} layers of {encoder.config.hidden_size}); use the "
                             "checkpoint's own text encoder")
        encoder.layers = encoder.layers[:max(read) + 1]  # the later ones never reach a read hidden state
        for m in (transformer, vae, encoder):
            m.to(device=device, dtype=dtype).eval().requires_grad_(False)
        native = int(getattr(vae.config, "sample_size", 1024) or 1024)  # the VAE's (FLUX.2's: 1024)
        return DiffusionModel(name=name, family=self.name, adapter=self, denoiser=transformer, vae=vae,
                              text_encoders=[encoder], tokenizers=[tokenizer], scheduler_config=scheduler_config,
                              device=device, dtype=dtype, native_size=native, is_random=is_random,
                              extra={"checkpoint": checkpoint})

    # -- random presets ----------------------------------------------------------------------------------
    def random_presets(self) -> dict[str, str]:
        return {"random:flux2-klein-4b": "FLUX.2 klein 4B's true architecture (5 double + 20 single blocks, 3072 "
                                         "wide; Qwen3-4B; the FLUX.2 VAE), random weights, step-distilled, for GPU "
                                         "timing",
                "random:flux2-klein-tiny": "a tiny FLUX.2 klein (one block of each kind, a 28-layer 16-wide Qwen3), "
                                           "random weights, step-distilled, for CPU tests"}

    def build_random(self, name: str, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        if name not in self.random_presets():
            raise ValueError(f"family {self.name!r} has no random preset {name!r}")
        tiny = name == "random:flux2-klein-tiny"
        with random_modules(device, dtype):
            if tiny:
                transformer = Flux2Transformer2DModel(**tiny_transformer(text_width=16))
                encoder = Qwen3Model(Qwen3Config(**tiny_qwen3(151936)))
                vae = AutoencoderKLFlux2(**tiny_vae())
            else:
                transformer = Flux2Transformer2DModel(**KLEIN_4B)
                encoder = Qwen3Model(Qwen3Config(**QWEN3_4B))
                vae = AutoencoderKLFlux2(**FLUX2_VAE)
        return self._model(name, transformer, vae, encoder, qwen_tokenizer("qwen3"), dict(SCHEDULER), device, dtype,
                           CHECKPOINTS["flux.2-klein"], is_random=True)

    # -- capabilities (references, step cache); the group key's first element is the reference-token bucket ---
    def capabilities(self) -> tuple[Capability, ...]:
        return (ReferenceImages(self.token_bucket), TokenStepCache(lambda m: int(m.denoiser.inner_dim)))

    def group_key(self, model: DiffusionModel, size: Size, text_tokens: int = 0,
                  prepared: Mapping[str, Any] | None = None, tiling: bool = False) -> GroupKey:
        """(reference tokens, image tokens): every row reads all 512 text tokens, so the first element, a text slot
        elsewhere, is the slot of the row's references' tokens (references.py `reference_bucket`; 0: none), the image
        tokens rounded up to `token_bucket`. A graphed size's groups with references replay graphs of their own
        (`graph_group`), captured on first use."""
        refs = (prepared or {}).get(REFERENCES, ())
        return (reference_bucket(refs, self.token_bucket), super().group_key(model, size, tiling=tiling)[1])

    def graph_group(self, key: GroupKey) -> GroupKey:
        return (0, key[1])

    def reference_group(self, key: GroupKey, slot: int) -> GroupKey:
        return (checked_slot(slot, self.token_bucket), key[1])

    def text_slot(self, key: GroupKey) -> int:
        if key[0] < 0 or key[0] % self.token_bucket:
            raise ValueError(f"group {key} is not a token bucket of family {self.name!r}")
        return self.text_tokens

    def row_spec(self, model: DiffusionModel, key: GroupKey, size: Size | None = None) -> dict[str, torch.Tensor]:
        """The token families' positions and image mask, and the group's reference slots, neutral (no reference:
        masked out); a request's references overwrite them at admission (flux2_refs.py `Flux2ReferenceRows`):
        `ref_tokens` [refs, 128], `ref_ids` [refs, 3] as (time, row, column), their RoPE tables `ref_cos` and
        `ref_sin` [refs, head_dim], `ref_mask` [refs]."""
        refs, device = key[0], model.device
        ids = torch.full((refs, 3), -1, dtype=torch.int64, device=device)
        cos, sin = rotary(model.denoiser, ids)
        return {**super().row_spec(model, key, size),
                "ref_tokens": torch.zeros((refs, model.latent_channels), dtype=model.dtype, device=device),
                "ref_ids": ids, "ref_cos": cos, "ref_sin": sin,
                "ref_mask": torch.zeros(refs, dtype=torch.bool, device=device)}

    def rope_rows(self, model: DiffusionModel, spec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A row's RoPE tables `rope_cos` and `rope_sin` [512 text + image tokens, head_dim] (text token k at (0, 0,
        0, k), image token (r, c) at (0, r, c, 0), its padding at 0), which depend on its size alone: made with its
        other per-size fields, gathered by the step."""
        net, positions = model.denoiser, spec["positions"]
        cos, sin = rotary(net, torch.cat([torch.zeros_like(positions[:, :1]), positions], dim=-1))
        k = torch.arange(self.text_tokens, device=positions.device)
        text_cos, text_sin = net.pos_embed(torch.stack([torch.zeros_like(k)] * 3 + [k], dim=-1))
        return {"rope_cos": torch.cat([text_cos, cos]), "rope_sin": torch.cat([text_sin, sin])}

    # -- the checkpoint's defaults and guidance ------------------------------------------------------------
    def default_steps(self, model: DiffusionModel) -> int | None:
        return model.extra["checkpoint"].steps

    def model_guidance(self, model: DiffusionModel) -> float:
        return model.extra["checkpoint"].guidance

    def guidance(self, model: DiffusionModel) -> str:
        """"none" for the step-distilled checkpoints (the pipeline ignores guidance there), else "cfg"."""
        return "none" if model.extra["checkpoint"].distilled else "cfg"

    def lora_layout(self, model: DiffusionModel) -> LoraLayout | None:
        """`transformer.*` (diffusers / PEFT), `diffusion_model.*` (ai-toolkit, ComfyUI) and `lora_unet_*` (Kohya)
        files, fused or split attention projections, read by the family's pipeline's converter (Flux2KleinPipeline's;
        dev: Flux2Pipeline's) after `lora_keys`."""
        return LoraLayout((("transformer", DENOISER),), LORA_TARGETS, pipeline_class=self.pipeline_classes[0],
                          prepare=lora_keys)

    # -- layout: the patchified latents [128, H/16, W/16], one token per cell ------------------------------
    def vae_scale_factor(self, model: DiffusionModel) -> int:
        return 2 ** (len(model.vae.config.block_out_channels) - 1) * 2  # the VAE's, times the 2x2 patchify

    def latent_channels(self, model: DiffusionModel) -> int:
        return int(model.denoiser.config.in_channels)  # the VAE's latent channels times 4

    def image_latents(self, model: DiffusionModel, encoder: Any, sample: torch.Tensor) -> torch.Tensor:
        """The VAE's latents [n, 32, H/8, W/8] -> the rows' [n, 128, H/16, W/16], patchified and normalised."""
        return normalised(encoder, sample)

    def decode(self, model: DiffusionModel, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """Patchified, normalised latents [n, 128, h, w] -> pixels: the batch-norm statistics undone, the 2x2 cells
        unfolded into [n, 32, 2h, 2w], the VAE's decode (the pipeline's order)."""
        latents = latents.to(self.vae_dtype(model))
        bn = decoder.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + decoder.config.batch_norm_eps).to(latents.dtype)
        latents = latents * std + mean
        n, c, h, w = latents.shape
        latents = latents.reshape(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c // 4, h * 2, w * 2)
        image = self.vae_decode(model, decoder, latents)
        return (image * 0.5 + 0.5).clamp(0, 1)

    # -- sampling: the pipeline's empirical shift -------------------------------------------------------
    def planner(self, model: DiffusionModel) -> Planner:
        """Flow Euler over the model's flow schedule, shifted by exp(`empirical_mu`) of each row's own token count
        and step count (a fixed-shift config shifts as the scheduler does)."""
        schedule_config = FlowSchedule.from_config(model.scheduler_config)

        @functools.lru_cache(maxsize=256)
        def plan(sampler: str, schedule: str, steps: int, size: Size) -> SamplerPlan:
            self.check(sampler, schedule, size)
            h, w = self.grid(model, size)
            return flow_plan(sampler, schedule, schedule_config, steps, h * w, mu=empirical_mu(h * w, steps))
        return plan

    # -- text --------------------------------------------------------------------------------------------
    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        width = len(self.text_layers) * int(model.text_encoders[0].config.hidden_size)
        return {"embeds": ((self.text_tokens, width), model.dtype)}

    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        """Each prompt in the template, padded to 512 tokens, read by the encoder with its mask; the hidden states
        after TEXT_LAYERS side by side per token, padding tokens included (the pipeline's
        `_get_qwen3_prompt_embeds`)."""
        texts = [chat_prompt(p, "qwen3", enable_thinking=False) for p in prompts]
        out = model.tokenizers[0](texts, padding="max_length", max_length=self.text_tokens, truncation=True,
                                  padding_side="right", return_tensors="pt")
        return {"embeds": stacked_layers(model, out.input_ids, out.attention_mask, self.text_layers)}

    def prompt_template(self, model: DiffusionModel) -> tuple[str, str] | None:
        before, _, after = chat_prompt("\0", "qwen3", enable_thinking=False).partition("\0")
        return before, after

    # -- the denoiser ------------------------------------------------------------------------------------
    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The velocity of rows x [n, image tokens, 128] at timesteps t (sigma * 1000) [n]:
        Flux2Transformer2DModel's blocks on [512 text tokens, image tokens] with each row's positions and its bucket
        padding masked (see the module's docstring); padding tokens out as 0. Step cache rows: token_cache.py."""
        cached = cached_denoise(lambda *a: self.denoise(model, *a), x, t, cond, rows)  # TaylorSeer rows
        if cached is not None:
            return cached
        net = model.denoiser
        image_mask, text = rows["image_mask"], cond["embeds"]
        n, tokens = image_mask.shape
        length = text.shape[1]

        # the rows' RoPE tables (`rope_rows`): text, image tokens, then the references' (written at admission)
        rope = tuple(torch.cat([rows[f"rope_{f}"], rows[f"ref_{f}"]], dim=1) for f in ("cos", "sin"))
        keys = torch.cat([torch.ones((n, length), dtype=torch.bool, device=x.device), image_mask, rows["ref_mask"]],
                         dim=1)
        keys = keys[:, None, None, :]

        # as the pipeline rounds it: t in the model's dtype, / 1000 there, * 1000 inside the forward
        timestep = (t.to(x.dtype) / 1000).to(net.dtype) * 1000
        guidance = rows.get("guidance")  # embedded guidance rows (dev): the scale, * 1000 as the forward does
        temb = net.time_guidance_embed(timestep, None if guidance is None else guidance[:, 0].to(net.dtype) * 1000)
        mod_img = net.double_stream_modulation_img(temb)
        mod_txt = net.double_stream_modulation_txt(temb)
        mod_single = net.single_stream_modulation(temb)

        h = net.x_embedder(torch.cat([x.to(net.dtype), rows["ref_tokens"].to(net.dtype)], dim=1))
        c = net.context_embedder(text.to(net.dtype))
        image = run_blocks(blocks(net, tokens, length), (h, c), (mod_img, mod_txt, mod_single, *rope, keys),
                           image_mask, rows.get("fbc.step"))  # first-block rows
        out = net.proj_out(net.norm_out(image, temb))  # the references' outputs dropped
        return out * image_mask.unsqueeze(-1)


def tiny_transformer(text_width: int) -> dict[str, Any]:
    """A Flux2Transformer2DModel config of the klein layout at test size (text `text_width` wide per layer)."""
    return dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=len(TEXT_LAYERS) * text_width,
                timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000,
                guidance_embeds=False)


def tiny_qwen3(vocab: int) -> dict[str, Any]:
    """A Qwen3Config of 28 layers (the last one read is 27), 16 wide, with Qwen3's RoPE theta (what a split file's
    config assumes)."""
    return dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=max(TEXT_LAYERS) + 1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                rope_theta=1000000.0)


def tiny_vae() -> dict[str, Any]:
    """An AutoencoderKLFlux2 config with the true latent layout (32 channels, 8x down) at test width, its sample size
    64 (the native size: a server warms up at it)."""
    return {**FLUX2_VAE, "block_out_channels": (16, 16, 16, 16), "layers_per_block": 1, "norm_num_groups": 8,
            "sample_size": 64}
