"""Model-family adapters: what the models of one family mean to the engine, behind one interface.

An adapter owns, for its family (one module per family: sd.py, sdxl.py):
  * loading: the diffusers pipeline classes it reads (`pipeline_classes`), its subfolders and module classes;
  * conditioning: tokenization, the capturable text-encoder call (`encode_ids`), the per-row conditioning
    fields kept in the step buffers for both CFG branches (`cond_spec`), per-row resolution conditioning
    (`row_spec`: SDXL's time ids) and how a missing negative prompt is conditioned (`negative`);
  * the denoiser call inside the whole step (`denoise`: tensors in, tensor out, capturable);
  * the sampler plan (`planner`): (sampler, schedule, steps, (height, width)) -> per-step coefficients, which also
    say how the model output becomes the denoised prediction (epsilon, v, or a flow velocity: D = x - sigma * v);
    the resolution is there for families whose schedule depends on it (Flux's time shift);
  * what a request may ask of it (`check`): its sampler and schedule names (`samplers`, `schedules`) and defaults
    (`default_sampler`, `default_schedule`), its size multiple (`size_multiple`: 8 for an SD VAE, 16 for a 2x2
    patched transformer); the engine's `ModelInfo` carries them to the request's validation and to `/info`;
  * image-to-image: whether it takes images (`supports_edits`), whether its image latents are a posterior sample or
    its mode (`edit_samples_posterior`) and how a clean latent is noised to a plan's first state (`noising`: SD's
    samplers' add_noise, or a flow's (1 - sigma) x0 + sigma * noise);
  * the latent shape, the decoder and its dtype, the decode to pixels and the image latents (the VAE's
    `scaling_factor`, `shift_factor`, `latents_mean` / `latents_std`, as diffusers' pipelines apply them);
  * defaults (guidance) and the equivalent diffusers pipeline (the test oracle).

What a new family implements: subclass `FamilyAdapter`, set `name` and `pipeline_classes`, implement
`load_folder` (if its folder is not UNet + VAE + CLIP encoders), `cond_spec`, `encode_ids`, `denoise`, and
`planner` when it is not trained on the SD noise schedule (a flow-matching model is not: then also list its
`samplers` / `schedules` / defaults, call `self.check` in its planner, and give its `noising`); override
`latent_shape` / `decode` if they differ. Register it in a `FamilyRegistry` and pass that to `load_model` /
`Engine(families=...)`: the engine core, scheduler, model runner and server need no edit (tests/test_families.py
does exactly this with a toy flow-matching family). Adapters hold no state: every method takes the model.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from functools import partial
from typing import Any, Callable, Mapping

import torch

from ... import safe_files
from ...features.base import RowFeature
from ...features.context import PromptContext, lcm_all
from ...features.control import ControlRows, ControlSlots
from ...features.image_prompt import ImagePromptSource
from ...features.edit import edit_rows
from ...features.embedded_guidance import EmbeddedGuidance, lcm_embedding
from ...features.guidance import ClassifierFreeGuidance
from ...features.history import SamplerHistory
from ...features.lora import LoraRows, SidePathRows
from ...lora.targets import LoraLayout, unet_layout
from ...request import (SIZE_MULTIPLE, TILING, GroupKey, ParamError, Size, check_family_params,
                        tiling_refusal)
from ...sampling.names import DEFAULT_SAMPLER, DEFAULT_SCHEDULE, HISTORY_SAMPLERS, SAMPLERS, SCHEDULES
from ...sampling.samplers import PlanOptions, SamplerPlan, make_plan, noising
from ...sampling.schedules import NoiseSchedule
from ...text.prepared import PromptInputs
from ..model import DiffusionModel

logger = logging.getLogger(__name__)

Conditioning = dict[str, torch.Tensor]        # field name -> [rows, ...] (one row per prompt)
CondSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]  # field name -> (per-row shape, dtype)
# (sampler, schedule, steps, (height, width)[, options]) -> plan; a planner that takes no PlanOptions (timestep
# spacing, eta) has four parameters, and requests giving them are refused for its family
Planner = Callable[..., SamplerPlan]


def select_row(cond: Conditioning, index: int) -> Conditioning:
    return {k: v[index:index + 1] for k, v in cond.items()}


def owned(cond: Conditioning, index: int) -> Conditioning:
    """Row `index` of a batch, in storage of its own (a cached row must not keep its whole batch alive)."""
    return {k: v[index:index + 1].clone() for k, v in cond.items()}


def concat(parts: list[Conditioning]) -> Conditioning:
    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def final_layer_norm(encoder: Any) -> torch.nn.Module:
    """A CLIP text encoder's final layer norm (transformers 5 keeps it on the model, 4 on its `text_model`)."""
    return getattr(encoder, "text_model", encoder).final_layer_norm


@contextlib.contextmanager
def spliced(encoders: list[Any], vectors: list[torch.Tensor | None], mask: torch.Tensor | None):
    """Textual-inversion vectors in place of the token embeddings where `mask` [n, tokens] is set: each encoder's
    input embedding output [n, tokens, dim] takes `vectors[i]` there (a forward hook for the calls inside the
    block; the tokenizer and the embedding matrix stay as they are)."""
    if mask is None:
        yield
        return
    hooks = []
    keep = mask.unsqueeze(-1)
    for encoder, v in zip(encoders, vectors):
        if v is None:
            continue
        def hook(module, args, output, v=v):
            return torch.where(keep, v.to(output.dtype), output)
        hooks.append(encoder.get_input_embeddings().register_forward_hook(hook))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def truncated_token_count(tokenizer: Any, prompt: str) -> int:
    """How many tokens CLIP drops from `prompt` (beyond max length, start/end tokens excluded)."""
    ids = tokenizer(prompt, padding=False, truncation=False).input_ids
    return max(0, len(ids) - tokenizer.model_max_length)


class FamilyAdapter:
    """The interface, with the behaviour SD-style (UNet + VAE + CLIP) families share."""

    name: str = ""
    pipeline_classes: tuple[str, ...] = ()
    default_guidance: float = 7.5
    # (encoder subfolder, tokenizer subfolder, transformers class) per text encoder, in order
    text_parts: tuple[tuple[str, str, str], ...] = (("text_encoder", "tokenizer", "CLIPTextModel"),)
    force_zeros_default: bool = False  # SDXL: a missing negative prompt is all zeros (unless the index says no)
    # its single-file layouts (original_layout.py): layout name -> each text part's key prefix and its layout ("hf":
    # transformers' CLIP, "openclip"), in text_parts' order
    original_layouts: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    supports_edits: bool = False       # image-to-image and inpainting (a VAE encoder, the family's `noising` and its
                                       # plans' KNOWN columns for the inpainting blend): SD and SDXL say True
    edit_strength: tuple[float, float] = (0.8, 1.0)  # diffusers' defaults: (image-to-image, inpainting)
    # above the native area (native_size squared) its VAE decodes and encodes in diffusers' tiles (`tiles`): the
    # token families say True; SD and SDXL decode whole at every size
    tiled_vae: bool = False
    # AUTOMATIC1111's tiling (`GenerationRequest.tiling`): circular padding in the denoiser's and the VAE's
    # convolutions (models/circular.py), its rows a group of their own; a family without convolutions refuses it
    supports_tiling: bool = True
    # the capability parameter (a `Param.images` list) the edits route's image parts fill, every one of them (FLUX.2's
    # references); None: the first image is the image-to-image start
    edit_images: str | None = None
    # an output without a size takes the last of those images' aspect ratio at this many pixels (0: the native size)
    edit_images_area: int = 0
    edit_steps_rule: str = "sd"  # request_inputs.EDIT_STEP_RULES: how its pipelines' strength picks the steps run
    # an edit's image latents: a sample of the VAE posterior drawn from the request's generator before its noise (SD,
    # Z-Image), or the posterior's mode with no draw (FLUX.2's pipelines: `sample_mode="argmax"`)
    edit_samples_posterior: bool = True
    # the names its planner takes (the SD noise schedule's samplers: sampling/names.py), what a request that names
    # none gets (graph verification walks it too), and the multiple its sizes must be
    samplers: tuple[str, ...] = SAMPLERS
    schedules: tuple[str, ...] = SCHEDULES
    lora_pipeline_class: str | None = None  # the diffusers pipeline whose LoRA readers convert adapter files
    default_sampler: str = DEFAULT_SAMPLER
    default_schedule: str = DEFAULT_SCHEDULE
    # a schedule name -> the sampling schedule its plans walk on this family (sampling/names.py SCHEDULE_VARIANTS)
    schedule_variants: dict[str, str] = {}
    size_multiple: int = SIZE_MULTIPLE
    # AUTOMATIC1111's "Approx cheap" latent -> RGB factors of the family's VAE ([C][3], to [-1, 1]) for live
    # previews (engine/previews.py); None: fitted to each model's VAE
    preview_factors: tuple[tuple[float, ...], ...] | None = None
    # the compile tier's layout per family, measured with compile on (tools/probe_compile_layout.py,
    # tools/probe_mixed_fidelity.py): (convolution weights channels-last, attention backend first in line).
    # Channels-last is faster for SD1.5's UNet and within noise for SDXL's; cuDNN attention is barely faster and not
    # batch invariant (a row's image moves with the batch sizes it runs at, beyond the fp16 tolerance), so both
    # families keep PyTorch's choice (BENCHMARKS.md: Layout and attention with compile on).
    compile_layout: tuple[bool, str] = (True, "auto")
    # conditioning fields with a token axis (their first per-row dimension): long prompts make them longer
    sequence_fields: tuple[str, ...] = ()
    # what its denoiser takes beside its own path (engine/controlnets.py, engine/ip_adapters.py need its UNet's
    # residual inputs and cross-attention layers, and its `control` call): a subset of ("controlnet", "ip_adapter")
    side_paths: tuple[str, ...] = ()
    # its planner takes PlanOptions (a request's timestep spacing and eta) as a fifth argument; else they are refused
    plan_options: bool = True
    # the prompt syntaxes its text side reads (request.PROMPT_SYNTAXES: "a1111" needs CLIP's 75-token windows)
    prompt_syntaxes: tuple[str, ...] = ("plain", "a1111")
    # the textual-inversion key of each text encoder, in order (text/embeddings.py): "default" for one encoder
    embedding_keys: tuple[str, ...] = ("default",)
    # the denoiser's linears the fp8 tier quantises, by qualified-name suffix (its blocks' attention and feed-forward
    # layers; embedders, modulation and the final projection stay 16-bit); None: quantize/fp8.py's default
    # selection, the names of diffusers' UNet transformer blocks
    fp8_linears: tuple[str, ...] | None = None
    # the text its encoder reads for a request without a negative prompt (Qwen-Image's pipelines guide with " ")
    empty_negative: str = ""
    # the leading tokens of its `prompt_template` the encoder reads but the rows drop (Qwen-Image's system prompt):
    # not counted against `token_lengths`
    template_dropped: int = 0

    # -- loading ---------------------------------------------------------------------------------
    def load_folder(self, folder: str, index: dict[str, Any], device: torch.device, dtype: torch.dtype,
                    name: str) -> DiffusionModel:
        """A diffusers pipeline folder of this family (local files only)."""
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        from ..stream_load import load_part

        for sub in ("unet", "vae", "scheduler", *(p for part in self.text_parts for p in part[:2])):
            if not os.path.isdir(os.path.join(folder, sub)):
                raise ValueError(f"{folder!r} is a {index.get('_class_name')} folder but lacks its '{sub}' subfolder; "
                                 "point diffgraph at a complete diffusers folder (e.g. saved with save_pretrained)")

        def variant(sub: str) -> str | None:
            files = os.listdir(os.path.join(folder, sub))
            plain = any(f.endswith((".safetensors", ".bin")) and f.count(".") == 1 for f in files)
            return None if plain or not any(".fp16." in f for f in files) else "fp16"

        label = f"model folder {folder!r}"  # (weights streamed to the device: the host holds one chunk buffer)
        unet = load_part(UNet2DConditionModel, folder, label, "unet", dtype, variant("unet"), device)
        vae = load_part(AutoencoderKL, folder, label, "vae", dtype, variant("vae"), device)
        encoders, tokenizers = [], []
        classes = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}
        for enc_sub, tok_sub, cls_name in self.text_parts:
            encoders.append(load_part(classes[cls_name], folder, label, enc_sub, dtype, device=device))
            tokenizers.append(CLIPTokenizer.from_pretrained(os.path.join(folder, tok_sub), local_files_only=True))
        try:
            scheduler_config = safe_files.read_json(os.path.join(folder, "scheduler", "scheduler_config.json"),
                                                    1 << 20)[0]
        except safe_files.UnusableFile as e:
            raise ValueError(f"model folder {folder!r}: scheduler/scheduler_config.json {e}") from None
        native = int(unet.config.sample_size) * 2 ** (len(vae.config.block_out_channels) - 1)
        return DiffusionModel(
            name=name, family=self.name, adapter=self, denoiser=unet, vae=vae, text_encoders=encoders,
            tokenizers=tokenizers, scheduler_config=scheduler_config, device=device, dtype=dtype,
            native_size=native,
            force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", self.force_zeros_default)))

    def load_split(self, files: Any, device: torch.device, dtype: torch.dtype, name: str) -> DiffusionModel:
        """A split model of a kind this family reads (`files`: split_files.SplitFiles, its SplitKind naming this
        family): the diffusion model, text encoder and VAE files."""
        raise ValueError(f"family {self.name!r} loads no split files; point diffgraph at a diffusers folder")

    # -- random presets (tests and timing) -------------------------------------------------------------
    def random_presets(self) -> dict[str, str]:
        """The random-weight presets this family builds itself (name -> one-line description; tiny ones for the CPU
        tests, true architectures for GPU timing). The SD families' are the loader's table (presets.py)."""
        return {}

    def build_random(self, name: str, device: torch.device, dtype: torch.dtype) -> DiffusionModel:
        """One of `random_presets()`, its modules made from a fixed seed on `device` (`DiffusionModel.is_random`)."""
        raise ValueError(f"family {self.name!r} has no random preset {name!r}")

    # -- shapes and sampling -----------------------------------------------------------------------
    def vae_scale_factor(self, model: DiffusionModel) -> int:
        return 2 ** (len(model.vae.config.block_out_channels) - 1)

    def latent_channels(self, model: DiffusionModel) -> int:
        vae_config = getattr(model.vae, "config", None)
        if vae_config is not None and hasattr(vae_config, "latent_channels"):
            return int(vae_config.latent_channels)
        return int(model.denoiser.config.in_channels)

    def extra_channels(self, model: DiffusionModel) -> int:
        """Denoiser input channels beyond the latents: 0, or mask + masked-image latents (9-channel inpainting
        UNets, detected from the UNet config). Families without edits: 0."""
        if not self.supports_edits:
            return 0
        extra = int(model.denoiser.config.in_channels) - self.latent_channels(model)
        if extra not in (0, 1 + self.latent_channels(model)):
            raise ValueError(f"the UNet takes {model.denoiser.config.in_channels} input channels; diffgraph supports "
                             f"{self.latent_channels(model)} (the latents) or {2 * self.latent_channels(model) + 1} "
                             "(an inpainting UNet: latents, mask, masked-image latents)")
        return extra

    # -- groups and the rows' latent layout ------------------------------------------------------
    # A request's size (height, width) is its image's; its group key is the family's choice: rows of one key share
    # step buffers, steps and graphs. UNet families group by the size itself (convolutions need one shape); a
    # transformer family that packs latents into tokens may group every size of one token bucket (rows of different
    # aspect ratios in one step), its rows then carrying their own positions and image-token mask (`row_spec`).
    def group_key(self, model: DiffusionModel, size: Size, text_tokens: int = 0,
                  prepared: Mapping[str, Any] | None = None, tiling: bool = False) -> GroupKey:
        """The group rows of an image `size` whose longest prompt is `text_tokens` tokens run in (default: the size
        itself; 0 tokens: a prompt of any length); `prepared`: the request's capabilities' preparations by name (a
        family whose rows carry inputs of their own size groups by them: FLUX.2's reference images); `tiling`:
        rows whose convolutions pad circularly, (height, width, TILING), a group of their own."""
        if tiling:
            if not self.supports_tiling:
                raise ParamError("tiling", tiling_refusal(self.name))
            return (*size, TILING)
        return size

    def group_keys(self, model: DiffusionModel, size: Size) -> tuple[GroupKey, ...]:
        """Every group rows of `size` may run in, whatever their prompts (the groups graphs are made for)."""
        return (self.group_key(model, size),)

    def graph_group(self, key: GroupKey) -> GroupKey:
        """The group among `group_keys` whose graphs a group `key` extends: its step graphs are made for `key` too,
        captured on first use, where that group's are (a family whose rows carry reference tokens: the group of the
        same image and text tokens without references, so the reference slots of a graphed size get graphs); the
        key itself by default."""
        return key

    def reference_group(self, key: GroupKey, slot: int) -> GroupKey:
        """The group of rows of group `key` whose references hold `slot` tokens (the graph config's
        `reference_slots`); a ValueError saying how to fix where the family reads no reference images or `slot` is
        none of its slots."""
        raise ValueError(f"model family {self.name!r} reads no reference images; leave reference_slots out")

    def image_latent_shape(self, model: DiffusionModel, size: Size) -> tuple[int, ...]:
        """The VAE's latents of one image of `size`: the shape a request's seed draws its noise in (diffusers' order)
        and the decoder reads."""
        f = model.vae_scale_factor
        return (model.latent_channels, size[0] // f, size[1] // f)

    def latent_shape(self, model: DiffusionModel, key: GroupKey) -> tuple[int, ...]:
        """One row of a group's step buffers (default: the image latents of the size the key is)."""
        return self.image_latent_shape(model, key)

    def pack(self, model: DiffusionModel, latents: torch.Tensor, size: Size, key: GroupKey) -> torch.Tensor:
        """Image latents [n, *image_latent_shape(size)] -> step rows [n, *latent_shape(key)] (default: the same)."""
        return latents

    def unpack(self, model: DiffusionModel, rows: torch.Tensor, size: Size, key: GroupKey) -> torch.Tensor:
        """Step rows [n, *latent_shape(key)] -> image latents [n, *image_latent_shape(size)] (`pack`'s inverse)."""
        return rows

    def packs(self, model: DiffusionModel) -> bool:
        """Whether step rows differ from image latents (`pack` is not the identity): then several sizes may share a
        group, and what works on image latents in place (the inpainting blend, the latent previews) does not apply."""
        return type(self).pack is not FamilyAdapter.pack

    def check(self, sampler: str, schedule: str, key: GroupKey) -> None:
        """ParamError (naming `sampler`, `schedule`, `width` or `height`) unless this family takes the sampler,
        the schedule and the size; a planner calls it first, so a request is checked where its plan is made."""
        check_family_params(sampler, schedule, key, self.samplers, self.schedules, self.size_multiple, self.name)

    def planner(self, model: DiffusionModel) -> Planner:
        """The SD noise schedule of the model's scheduler config, walked by our samplers (sampling/); the SD
        families' plans do not depend on the resolution."""
        noise = NoiseSchedule.from_config(model.scheduler_config)

        @functools.lru_cache(maxsize=256)  # requests repeat their settings; a plan is read, never written
        def plan(sampler: str, schedule: str, steps: int, key: GroupKey,
                 options: PlanOptions | None = None) -> SamplerPlan:
            self.check(sampler, schedule, key)
            return make_plan(noise, sampler, self.schedule_variants.get(schedule, schedule), steps, options=options)
        return plan

    def shifted_plan(self, model: DiffusionModel, sampler: str, schedule: str, steps: int, key: GroupKey,
                     shift: float) -> SamplerPlan:
        """The plan of a request's `schedule_shift`: a flow-matching family's schedule at that fixed time shift;
        here (SD's noise schedules have no shift) a ParamError naming it."""
        raise ParamError("schedule_shift", f"model family {self.name!r} has no flow-matching schedule to shift; "
                                           "leave schedule_shift out")

    def plans(self, model: DiffusionModel) -> Planner:
        """The model's planner (`planner`), made on first use and kept with the model: the runner and the family's
        features that read a request's plan (Z-Image's guidance) share it, and so its cache of plans."""
        if model.sampler_plans is None:
            model.sampler_plans = self.planner(model)
        return model.sampler_plans

    def noising(self, plan: SamplerPlan) -> tuple[float, float]:
        """(k, e): an image-to-image row starts at k * image latents + e * noise, the plan's first state (SD's
        samplers: the add_noise of their diffusers scheduler; a flow-matching family: (1 - sigma, sigma))."""
        return noising(plan)

    def lora_layout(self, model: DiffusionModel) -> LoraLayout | None:
        """What its LoRA files name and which layers side paths wrap (lora/targets.py); None: it takes no LoRA. The
        SD families: the UNet's attention and feed-forward layers, CLIP's, read by `lora_pipeline_class`."""
        return None if self.lora_pipeline_class is None else unet_layout(self.lora_pipeline_class,
                                                                         len(model.text_encoders))

    def capabilities(self) -> tuple[Any, ...]:
        """The family's own request capabilities (features/capability.py `Capability`): their parameters, checks and
        preparation, registered on every engine of the family's models beside the engine's (their step half is in
        the family's `features`)."""
        return ()

    def default_steps(self, model: DiffusionModel) -> int | None:
        """The steps a request that names none runs on this model (its checkpoint's model card); None: the route's
        own default (the SD families: 20 for the Python and OpenAI APIs, AUTOMATIC1111's 50)."""
        return None

    def model_guidance(self, model: DiffusionModel) -> float:
        """The guidance scale a request that names none gets on this model (diffgraph's scale: 1 is off)."""
        return self.default_guidance

    def guidance(self, model: DiffusionModel) -> str:
        """How the model guides (`ModelInfo.guidance`): "embedded" for guidance-distilled UNets (LCM's
        `time_cond_proj_dim`), else "cfg" (classifier-free guidance, a second branch for the negative prompt); a family
        whose models run no guidance at all (step-distilled ones) says "none"."""
        return "embedded" if self._lcm_dim(model) is not None else "cfg"

    @staticmethod
    def _lcm_dim(model: DiffusionModel) -> int | None:
        dim = getattr(getattr(model.denoiser, "config", None), "time_cond_proj_dim", None)
        return None if dim is None else int(dim)

    def features(self, model: DiffusionModel, side_paths: SidePathRows | None = None,
                 max_chunks: int = 1, controls: ControlSlots | None = None,
                 image_prompts: ImagePromptSource | None = None) -> tuple[RowFeature, ...]:
        """The row features of this family's step, in order (features/): guidance (classifier-free, embedded for
        guidance-distilled UNets, or none where `guidance` says "none"), the samplers' history slots, edits' rows,
        LoRA rows (`side_paths`), ControlNet and image-prompt rows (`controls`, `image_prompts`), the prompt context
        (up to `max_chunks` 77-token windows). A family feature that reads a request's plan takes `plans(model)`."""
        dim = self._lcm_dim(model)
        out: list[RowFeature] = []
        if dim is not None:
            out.append(EmbeddedGuidance("timestep_cond", (dim,), model.dtype, partial(lcm_embedding, dim=dim)))
        elif self.guidance(model) == "cfg":  # "none": one branch always (step-distilled models)
            out.append(ClassifierFreeGuidance(self.row_cond_spec(model, max_chunks), self.sequence_fields))
        if set(self.samplers) & set(HISTORY_SAMPLERS):  # the history slots some of its samplers keep
            out.append(SamplerHistory())
        if self.supports_edits:
            out.append(edit_rows(self.extra_channels(model), model.dtype))
        if side_paths is not None:
            out.append(LoraRows(side_paths, side_paths.max_stack))
        if controls is not None:  # ControlNet rows (features/control.py): the nets in `controls`' slots
            out.append(ControlRows(model.denoiser.config, model.dtype, controls.run))
        if image_prompts is not None:  # IP-Adapter rows (features/image_prompt.py)
            out.append(image_prompts.feature())
        if max_chunks > 1 and self.sequence_fields:
            out.append(PromptContext(self.token_lengths(model)[0], max_chunks))
        return tuple(out)

    def max_chunks(self, model: DiffusionModel, wanted: int) -> int:
        """The prompt windows a row may hold: `wanted` where the family has sequence fields, else 1."""
        return wanted if self.sequence_fields else 1

    def row_cond_spec(self, model: DiffusionModel, max_chunks: int = 1) -> CondSpec:
        """`cond_spec` with room in each sequence field for lcm(1..max_chunks) prompt windows (features/context.py:
        a row's windows repeated, so a step of any of its rows' lengths reads a whole number of them), and one spare
        token never read: every prefix a step reads is then a strided view of the rows, one layout for the compiled
        step at every length (the whole field would be contiguous: another compile)."""
        if max_chunks == 1:
            return self.cond_spec(model)
        span = lcm_all(range(1, max_chunks + 1))
        return {k: (((shape[0] * span + 1, *shape[1:]) if k in self.sequence_fields else shape), dt)
                for k, (shape, dt) in self.cond_spec(model).items()}

    # -- conditioning ------------------------------------------------------------------------------
    def cond_spec(self, model: DiffusionModel) -> CondSpec:
        raise NotImplementedError

    def row_spec(self, model: DiffusionModel, key: GroupKey, size: Size | None = None) -> dict[str, torch.Tensor]:
        """Per-row values that depend only on the row's image size (the same for both CFG branches: SDXL's time ids,
        a transformer's token positions and image-token mask), on the model's device. `size` None: any size of the
        group (the buffers' allocation reads only the shapes)."""
        return {}

    def tokenize(self, model: DiffusionModel, prompts: list[str]) -> list[torch.Tensor]:
        """Token ids per tokenizer, [n, max_length] int64 on the CPU; warns when a prompt is truncated."""
        ids = []
        for tokenizer in model.tokenizers:
            for prompt in prompts:
                dropped = truncated_token_count(tokenizer, prompt)
                if dropped:
                    # counts only: prompt text never goes to a log (the request id is not known here)
                    logger.warning("prompt truncated: CLIP reads %d tokens, the prompt has %d, %d dropped",
                                   tokenizer.model_max_length, tokenizer.model_max_length + dropped, dropped)
            tokens = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                               truncation=True, return_tensors="pt")
            ids.append(tokens.input_ids)
        return ids

    def token_lengths(self, model: DiffusionModel) -> list[int]:
        return [t.model_max_length for t in model.tokenizers]

    def prompt_template(self, model: DiffusionModel) -> tuple[str, str] | None:
        """(text before, text after) the prompt where the encoder reads it in a template (an LLM's chat template):
        then a prompt longer than `token_lengths` is refused, naming its count, rather than truncated. None: CLIP's
        rule (truncated, with a warning)."""
        return None

    def needs_attention_mask(self, model: DiffusionModel) -> bool:
        """True when the encoders need the tokenizer's mask: then the text encoder is not captured."""
        return False

    def encode_ids(self, model: DiffusionModel, ids: list[torch.Tensor], clip_skip: int | None = None) -> Conditioning:
        """The text encoder(s) on token ids on the model's device: a pure tensor function (capturable).
        `clip_skip` in diffusers' numbering (None: the family's usual layer; 1: one layer before it)."""
        raise NotImplementedError

    def encoder_layers(self, model: DiffusionModel) -> int:
        """The most layers a request's `clip_skip` may skip (the shallowest encoder's layer count less one)."""
        layers = [getattr(getattr(e, "config", None), "num_hidden_layers", None) for e in model.text_encoders]
        return min(int(n) for n in layers) - 1 if layers and None not in layers else 0

    def embedding_dims(self, model: DiffusionModel) -> dict[str, int]:
        """What a textual-inversion vector must have per encoder key (its input embedding width)."""
        return {k: int(e.get_input_embeddings().embedding_dim)
                for k, e in zip(self.embedding_keys, model.text_encoders) if hasattr(e, "get_input_embeddings")}

    def encoder_widths(self, model: DiffusionModel) -> list[int]:
        """The width each encoder contributes to the `embeds` field (SDXL concatenates both), in order."""
        return [int(e.config.hidden_size) for e in model.text_encoders]

    def encode(self, model: DiffusionModel, prompts: list[str]) -> Conditioning:
        """One row per prompt, in the model's dtype, on its device (eager)."""
        with torch.no_grad():
            return self.encode_ids(model, [i.to(model.device) for i in self.tokenize(model, prompts)])

    def negative(self, model: DiffusionModel, cond: Conditioning, prompts: list[str | None]) -> Conditioning:
        """Negative prompts' conditioning (encoded with "" for None) as the family's pipeline uses it."""
        return cond

    def prompt_inputs(self, model: DiffusionModel, prepared: Mapping[str, Any]) -> PromptInputs | None:
        """What its encoder reads beside a request's prompts (a vision-language encoder's images), from the request's
        capability preparations (`prepared`, on the submitting thread); None: the text alone."""
        return None

    def encode_with_inputs(self, model: DiffusionModel, prompts: list[str],
                           inputs: list[PromptInputs | None]) -> Conditioning:
        """`encode`, each prompt with what the encoder reads beside it (`prompt_inputs`; None: nothing)."""
        if any(i is not None for i in inputs):
            raise ValueError(f"family {self.name!r} reads no inputs beside its prompts")
        return self.encode(model, prompts)

    # -- the step and the decode -------------------------------------------------------------------
    def denoise(self, model: DiffusionModel, x: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model output for model inputs x [2n, C, h, w] at timesteps t [2n] (both CFG branches)."""
        raise NotImplementedError

    def vae_dtype(self, model: DiffusionModel) -> torch.dtype:
        return model.dtype

    def decoder(self, model: DiffusionModel) -> Any:
        """The module that decodes: the model's VAE, or a copy in the decode dtype where the family upcasts."""
        if self.vae_dtype(model) == model.dtype:
            return model.vae
        import copy
        return copy.deepcopy(model.vae).to(self.vae_dtype(model))

    def decode(self, model: DiffusionModel, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels [n, 3, H, W] in [0, 1] on the device (diffusers' VAE scaling and denormalisation)."""
        latents = latents.to(self.vae_dtype(model))
        mean = getattr(decoder.config, "latents_mean", None)
        std = getattr(decoder.config, "latents_std", None)
        if mean is not None and std is not None:
            c = latents.shape[1]
            mean_t = torch.tensor(mean, device=latents.device, dtype=latents.dtype).view(1, c, 1, 1)
            std_t = torch.tensor(std, device=latents.device, dtype=latents.dtype).view(1, c, 1, 1)
            latents = latents * std_t / decoder.config.scaling_factor + mean_t
        else:
            latents = latents / decoder.config.scaling_factor
            shift = getattr(decoder.config, "shift_factor", None)
            if shift is not None:  # SD3 / Flux VAEs (diffusers' pipelines: latents / scaling + shift)
                latents = latents + shift
        image = self.vae_decode(model, decoder, latents)
        return (image * 0.5 + 0.5).clamp(0, 1)

    def tiles(self, model: DiffusionModel, size: Size) -> bool:
        """Whether an image of `size` (pixels) goes through the VAE in tiles: above the native area, for a family
        that opts in (`tiled_vae`) and a VAE with diffusers' tiles. Such a decode or encode runs eagerly, never in a
        graph."""
        return self.tiled_vae and hasattr(model.vae, "tiled_decode") and size[0] * size[1] > model.native_size ** 2

    def vae_decode(self, model: DiffusionModel, decoder: Any, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents [n, C, h, w] -> its output [n, 3, H, W] in [-1, 1]: whole, or in diffusers' tiles
        (`tiled_decode`, what `enable_tiling()` runs: tiles of the config's sample_size, overlapped and blended).
        A VAE without diffusers' tiled decode decodes whole."""
        if self.tiled_vae and hasattr(decoder, "tiled_decode"):
            factor = 2 ** (len(decoder.config.block_out_channels) - 1)
            if self.tiles(model, (latents.shape[-2] * factor, latents.shape[-1] * factor)):
                return decoder.tiled_decode(latents, return_dict=False)[0]
        return decoder.decode(latents, return_dict=False)[0]

    def encode_pixels(self, model: DiffusionModel, encoder: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [n, 3, H, W] in [-1, 1] -> the VAE posterior's parameters [n, 2C, h, w] (mean, log variance):
        a pure tensor function (capturable); sampling and scaling happen outside (`image_latents`). Above the
        native area of a tiling family, diffusers' tiled encode (as `enable_tiling()`)."""
        pixels = pixels.to(self.vae_dtype(model))
        if self.tiles(model, tuple(pixels.shape[-2:])) and hasattr(encoder, "_tiled_encode"):
            return encoder._tiled_encode(pixels)  # the moments tiled_encode wraps in its posterior
        return encoder.encode(pixels, return_dict=False)[0].parameters

    def image_latents(self, model: DiffusionModel, encoder: Any, sample: torch.Tensor) -> torch.Tensor:
        """A sample of the VAE posterior (fp32) scaled as the pipelines scale image latents."""
        cfg = encoder.config
        lmean, lstd = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if lmean is not None and lstd is not None:
            shape = (1, sample.shape[1], 1, 1)
            lmean_t = torch.tensor(lmean, device=sample.device).view(shape)
            return (sample - lmean_t) * cfg.scaling_factor / torch.tensor(lstd, device=sample.device).view(shape)
        shift = getattr(cfg, "shift_factor", None)
        if shift is not None:  # SD3 / Flux VAEs: (x - shift) * scaling
            return (sample - shift) * cfg.scaling_factor
        return cfg.scaling_factor * sample

    def diffusers_pipeline(self, model: DiffusionModel, scheduler: Any, task: str = "text") -> Any:
        """The equivalent diffusers pipeline on the same modules (the oracle): task "text", "img2img" or
        "inpaint"."""
        raise NotImplementedError(f"family {self.name!r} has no diffusers pipeline")


class FamilyRegistry:
    """Maps a pipeline folder's `_class_name` (and a family name) to its adapter. Make one with
    `default_registry()` and `register` more families on it; nothing is shared between registries."""

    def __init__(self, adapters: tuple[FamilyAdapter, ...] = ()):
        self._by_name: dict[str, FamilyAdapter] = {}
        for a in adapters:
            self.register(a)

    def register(self, adapter: FamilyAdapter) -> None:
        if not adapter.name:
            raise ValueError(f"{type(adapter).__name__} has no name; set the class attribute `name`")
        self._by_name[adapter.name] = adapter

    def by_name(self, name: str) -> FamilyAdapter:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"model family {name!r} is not registered; known: {', '.join(self._by_name)}") from None

    def for_pipeline(self, class_name: str | None) -> FamilyAdapter | None:
        return next((a for a in self._by_name.values() if class_name in a.pipeline_classes), None)

    def pipeline_classes(self) -> list[str]:
        return [c for a in self._by_name.values() for c in a.pipeline_classes]

    def adapters(self) -> tuple[FamilyAdapter, ...]:
        return tuple(self._by_name.values())

    def random_presets(self) -> dict[str, str]:
        """Every registered family's own random presets (name -> description)."""
        return {name: d for a in self._by_name.values() for name, d in a.random_presets().items()}

    def random_owner(self, name: str) -> FamilyAdapter | None:
        """The family that builds random preset `name` itself, if one does."""
        return next((a for a in self._by_name.values() if name in a.random_presets()), None)
