"""FLUX.2 [dev] (Black Forest Labs' 32B guidance-distilled checkpoint): klein's MMDiT (flux2.py) at 8 double and 48
single blocks, 6144 wide, read as diffusers' `Flux2Pipeline` reads it. What differs from klein, and only that:

  * text: Mistral Small 3.1 (`Mistral3ForConditionalGeneration`; the pipeline reads its language model's hidden
    states only, so the vision tower and the LM head are dropped at load, and the layers past 30). Each prompt is BFL's
    system message and the prompt as one user turn in the processor's chat template (models/mistral_tokenizer.py
    `chat_prompt`), tokenised with no added special tokens and padded to 512 with the tokenizer's pad token and side;
    the hidden states after layers 10, 20 and 30 stacked per token (3 x 5120: the joint width 15360). All 512 tokens
    are the row's text, as klein's; a longer prompt is refused naming its count;
  * guidance: embedded, one denoiser row. The transformer has a guidance embedder (`guidance_embeds`), and a row's
    `guidance_scale` goes in beside its timestep (times 1000, as the forward does) through the embedded-guidance row
    feature; rows of different scales share a step. There is no negative prompt: classifier-free guidance's
    parameters are refused by the model's guidance ("embedded");
  * defaults: the pipeline's and the card's, 50 steps at guidance 4.

Everything else is klein's: the 32-channel VAE and its packing, positions, the empirical shift, reference images,
image-to-image, step caching, LoRA files (read by Flux2Pipeline's converter). Loading: a diffusers folder with its
`tokenizer/` (no Mistral vocabulary is shipped), or ComfyUI's split files with that tokenizer folder given
(`split_parts`, `split_encoder`: the Mistral file read into the 30 layers dev runs); the transformer may be a GGUF
quantisation and the Mistral file llama.cpp's GGUF of Mistral Small 3.1 (written as `llama`, its query and key rows
permuted by the converter: gguf_llm.py puts them back), as klein's are. `random:flux2-dev` is a tiny
random model for CPU tests, `random:flux2-dev-full` the true architecture made on the device for GPU timing, both
with the byte-level Tekken tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...features.base import RowFeature
from ...features.embedded_guidance import EmbeddedGuidance
from ... import safe_files
from ..mistral_tokenizer import BOS, VOCAB_SIZE, chat_prompt, read_tokenizer, tekken_bytes_tokenizer, tokenizer_source
from ..model import DiffusionModel
from .base import Conditioning
from .flux2 import FLUX2_VAE, SCHEDULER, Checkpoint, Flux2KleinFamily, stacked_layers, tiny_transformer, tiny_vae
from .tokens import FOLDER_PARTS, folder_scheduler_config, materialised, random_modules

TEXT_LAYERS = (10, 20, 30)  # the pipeline's text_encoder_out_layers
DEV = Checkpoint("flux.2-dev", 50, 4.0, distilled=False)
# black-forest-labs/FLUX.2-dev's transformer/config.json (diffusers' Flux2Transformer2DModel defaults): 8 double and
# 48 single blocks, 48 heads of 128 (6144 wide), three Mistral layers of 5120 as its text width, the guidance embedder
DEV_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                       num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                       axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True)
FULL = "random:flux2-dev-full"


def guidance_value(scale: float) -> torch.Tensor:
    """A row's embedded guidance: its scale, as the pipeline passes it (fp32; the forward scales it by 1000)."""
    return torch.tensor([scale], dtype=torch.float32)


def full_modules(device: torch.device) -> tuple[Any, Any, Any]:
    """FLUX.2 dev's true architecture with its parameters on meta (buffers on `device`): the transformer
    (`DEV_TRANSFORMER`), the 30 layers of Mistral Small 3.1's language model it reads (flux2_files' `mistral_reader`),
    the FLUX.2 VAE."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from ..flux2_files import MISTRAL_SMALL_31, mistral_reader
    from ..stream_load import meta_parameters

    with meta_parameters(), torch.device(device):
        return (Flux2Transformer2DModel(**DEV_TRANSFORMER), mistral_reader(MISTRAL_SMALL_31),
                AutoencoderKLFlux2(**FLUX2_VAE))


def tiny_mistral3(vocab: int = VOCAB_SIZE) -> dict[str, Any]:
    """A Mistral3Config of a 31-layer 16-wide language model (the last one read is 30) with Mistral Small 3.1's RoPE
    theta, norm epsilon and vocabulary size (what a split file's config assumes), and a one-layer vision tower the
    pipeline never runs."""
    return dict(text_config=dict(model_type="mistral", vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=max(TEXT_LAYERS) + 1, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=8, max_position_embeddings=1024, rope_theta=1000000000.0, rms_norm_eps=1e-5,
                                 sliding_window=None),
                vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, head_dim=8, image_size=32, patch_size=16))


class Flux2DevFamily(Flux2KleinFamily):
    name = "flux2-dev"
    title = "FLUX.2 dev"
    pipeline_classes = ("Flux2Pipeline",)
    text_layers = TEXT_LAYERS
    encoder_name = "Mistral Small 3.1"
    default_guidance = DEV.guidance

    # -- loading ---------------------------------------------------------------------------------------
    def folder_checkpoint(self, name: str, index: dict[str, Any]) -> Checkpoint:
        return DEV

    def folder_text(self, folder: str, dtype: torch.dtype) -> tuple[Any, Any, dict[str, Any]]:
        """The folder's Mistral3 language model, its tokenizer (required: none is shipped; its chat template must
        render the prompt as `chat_prompt` does) and its scheduler config; each problem a ValueError naming it."""
        from transformers import Mistral3ForConditionalGeneration

        from ..stream_load import load_part

        label = f"model folder {folder!r}"
        for sub in FOLDER_PARTS:
            if not os.path.isdir(os.path.join(folder, sub)):
                raise ValueError(f"{label} is a Flux2Pipeline folder but lacks its '{sub}' subfolder (FLUX.2 dev reads "
                                 "prompts with the checkpoint's own tokenizer); point diffgraph at a complete folder")
        try:
            kind = safe_files.read_json(os.path.join(folder, "text_encoder", "config.json"), 1 << 20)[0]
        except safe_files.UnusableFile as e:
            raise ValueError(f"{label}: text_encoder/config.json {e}") from None
        if kind.get("model_type") != "mistral3":
            raise ValueError(f"{label}: its text encoder is {kind.get('model_type')!r}; FLUX.2 dev reads Mistral "
                             "Small 3.1 ('mistral3'): use the checkpoint's own text_encoder folder")
        encoder = load_part(Mistral3ForConditionalGeneration, folder, label, "text_encoder", dtype)
        tokenizer = read_tokenizer(os.path.join(folder, "tokenizer"), f"{label}: tokenizer")
        return encoder.model.language_model, tokenizer, folder_scheduler_config(folder)

    def split_parts(self, files: Any) -> tuple[Checkpoint, Any]:
        """dev's checkpoint and the tokenizer of the folder given (`SplitFiles.tokenizer`: --tokenizer or the
        sidecar's `tokenizer`; none is a one-line error naming both), the text encoder file's header checked to be a
        Mistral of at least 30 layers: all before any weight is read. ComfyUI's text encoder file carries Tekken's
        tekken.json (`tekken_model`), which is not read: no conversion of it is shown to give the folder's ids."""
        from .. import zimage_files as zf
        from ..flux2_files import MISTRAL_READ
        from ..split_files import header_shapes, missing_tokenizer

        if files.tokenizer is None:
            raise ValueError(f"{os.path.basename(files.diffusion_model)}: "
                             f"{missing_tokenizer(files.kind, files.diffusion_model)}")
        try:
            shapes = header_shapes(files.text_encoder)
        except safe_files.UnusableFile as e:
            raise ValueError(f"{files.text_encoder} {e}") from None
        zf.check_kind(files.text_encoder, "mistral_text_encoder", shapes, {"num_hidden_layers": MISTRAL_READ})
        folder = tokenizer_source(files.tokenizer)[0]
        return DEV, read_tokenizer(folder, f"tokenizer folder {folder!r}")

    def split_encoder(self, files: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """The Mistral file streamed into the 30 layers dev reads (split_stream.load_mistral_text_encoder), its head
        width the tokenizer's diffusers folder's config where one was given, else Mistral Small 3.1's published 128."""
        from .. import split_stream
        from ..flux2_files import MISTRAL_HEAD

        head = tokenizer_source(files.tokenizer)[1] or MISTRAL_HEAD
        return split_stream.load_mistral_text_encoder(files.text_encoder, dtype, device, head)

    # -- random preset -----------------------------------------------------------------------------------
    def random_presets(self) -> dict[str, str]:
        return {"random:flux2-dev": "a tiny FLUX.2 dev (one block of each kind with the guidance embedder, a 31-layer "
                                    "16-wide Mistral3 language model, byte-level Tekken tokenizer), random weights, "
                                    "for CPU tests",
                FULL: "FLUX.2 dev's true architecture (8 double + 48 single blocks, 6144 wide: 32.2B; the 30 layers of "
                      "Mistral Small 3.1 it reads: 17.3B; the FLUX.2 VAE; byte-level Tekken tokenizer), random "
                      "weights made on the device, for GPU timing (about 100 GB in bf16)"}

    def build_random(self, name: str, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        if name not in self.random_presets():
            raise ValueError(f"family {self.name!r} has no random preset {name!r}")
        if name == FULL:
            transformer, encoder, vae = (materialised(m, device, dtype) for m in full_modules(device))
        else:
            with random_modules(device, dtype):
                transformer = Flux2Transformer2DModel(**{**tiny_transformer(text_width=16), "guidance_embeds": True})
                encoder = Mistral3ForConditionalGeneration(Mistral3Config(**tiny_mistral3())).model.language_model
                vae = AutoencoderKLFlux2(**tiny_vae())
        return self._model(name, transformer, vae, encoder, tekken_bytes_tokenizer(), dict(SCHEDULER), device, dtype,
                           DEV, is_random=True)

    # -- guidance: embedded, one denoiser row ----------------------------------------------------------------
    def guidance(self, model: DiffusionModel) -> str:
        return "embedded"

    def features(self, model: DiffusionModel, *args: Any, **kwargs: Any) -> tuple[RowFeature, ...]:
        """The embedded guidance row feature (the denoiser's `guidance` input, [1] per row), then klein's."""
        return (EmbeddedGuidance("guidance", (1,), torch.float32, guidance_value),
                *super().features(model, *args, **kwargs))

    # -- text --------------------------------------------------------------------------------------------
    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        """Each prompt in the system + user template, padded to 512 tokens on the tokenizer's own side, read by the
        language model with its mask; the hidden states after layers 10, 20 and 30 side by side per token (the
        pipeline's `_get_mistral_3_small_prompt_embeds`)."""
        out = model.tokenizers[0]([chat_prompt(p) for p in prompts], add_special_tokens=False, padding="max_length",
                                  max_length=self.text_tokens, truncation=True, return_tensors="pt")
        return {"embeds": stacked_layers(model, out.input_ids, out.attention_mask, self.text_layers)}

    def prompt_template(self, model: DiffusionModel) -> tuple[str, str] | None:
        """The text around a prompt as the refusal counts it (with the tokenizer's added tokens): `<s>` left out
        where the tokenizer adds it itself, so that it is counted once."""
        before, _, after = chat_prompt("\0").partition("\0")
        tokenizer = model.tokenizers[0]
        if tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
            before = before[len(BOS):]
        return before, after
