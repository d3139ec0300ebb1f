"""Qwen-Image-Edit (the Edit Plus layout of 2509 and 2511: `QwenImageEditPlusPipeline`): Qwen-Image (qwen_image.py) that reads
one to three input images, through the Qwen2.5-VL encoder's vision tower beside the prompt and as reference tokens
beside the image's.

What the pipeline does with a request's input images (`reference_images`; the edits route's image parts and
AUTOMATIC1111's init images fill it: `edit_images`), and how rows of different inputs share one step here:
  * on the submitting thread (`prepare_inputs`): each image at the pipeline's condition resolution (its aspect ratio
    at `CONDITION_IMAGE_SIZE` pixels of area, sides rounded to multiples of 32, Lanczos) read as the Qwen2-VL image
    processor reads it (resized to multiples of 28 within its pixel bounds, bicubic; CLIP's mean and std; 14 px
    patches of two frames, merged 2x2: `vision_image`), and at its VAE resolution (`VAE_IMAGE_SIZE` pixels of area,
    the same rounding) in -1..1 (`VaeImageProcessor.preprocess`);
  * text: the prompt in the Edit template (its own system message, 64 tokens dropped), after "Picture i:
    <|vision_start|>" and one `<|image_pad|>` per merged vision patch "<|vision_end|>" for each image; the encoder
    reads the vision tower's output at those tokens with the model's multimodal positions (`mm_token_type_ids`, as
    transformers' processor marks them: the pipeline under transformers 5 leaves them out and reads
    the images at plain sequence positions, which diffusers' open fix adds back). The vision placeholders count
    against the 1024 tokens a row holds (a longer prompt is refused naming its count). The negative prompt (" " where
    the request has none) is read with the same images. The images are part of the prompt (`PromptInputs`), so the
    prompt cache keeps the encoder's output by the images' content and the prompt;
  * reference tokens (`EditRows`, on the shared reference machinery: references.py): each image's VAE latents (the
    posterior's mode, normalised by latents_mean / latents_std) packed 2x2 as the image's are, after the image's
    tokens in the image stream, attending and attended, their outputs dropped; image i (the output is 0) at frame i
    with its own centred rows and columns, and the text after the largest half extent of every image of the row
    (QwenEmbedRope over the row's img_shapes): the row's text tables are rewritten at admission where its inputs
    reach further than its image;
  * Edit-2511 (its transformer's `zero_cond_t`): the reference tokens are modulated by the timestep embedding of 0,
    the image's and the text's by the step's (qwen_image.py `block_step`);
  * the group key's first element is (text slot, reference tokens rounded up to a slot of `token_bucket`s:
    references.py `reference_bucket`): rows of one text slot whose inputs round to one slot share a step, their
    padding masked, and in graph mode replay graphs of that slot where the text rows of their text slot and image
    tokens have graphs (`graph_group`); true CFG, the schedule (mu of the output's tokens) and the decode are the
    text family's.
Input images are checked on the submitting thread (at most `MAX_INPUTS`; an image, not too thin for either
resolution): a ParamError naming `reference_images`.
Preprocessing is the family's own (PIL and numpy, no torchvision), equal to transformers' `Qwen2VLImageProcessorPil`
(tests/test_qwen_image_edit.py); the settings ship in assets/qwen/qwen2_vl_preprocessor.json and a folder's
`processor/preprocessor_config.json` must agree with them.
An output without a size takes the last input's aspect ratio at 1024 x 1024 pixels of area, as the pipeline's
(`edit_images_area`; request.py `area_size`).
Split files (ComfyUI's diffusion model, Qwen2.5-VL encoder and VAE: `load_split`, as Qwen-Image's): the transformer
file (safetensors, fp8 or a QuantStack / city96 GGUF) has Qwen-Image's layout, so a split file is Edit's when its
sidecar's `preset` says so ("qwen-image-edit", "qwen-image-edit-2509", "qwen-image-edit-2511") or else its file name
holds "edit" (split_files.py's variants of the "qwen-image" kind); a file with ComfyUI's `__index_timestep_zero__`
marker is Edit-2511's (a split kind of its own). Edit-2511's `zero_cond_t` is on where that marker, the preset or
the name (both "edit" and "2511") says 2511: the weights are the same as 2509's. The encoder file is read with its
vision tower (`visual.`); one without is refused naming the file, before any weight is read. The tokenizer and the
image processor settings are the shipped ones. The first Edit's files (QwenImageEditPipeline's, named "edit" without
2509 / 2511) are read as Edit Plus reads its inputs: the pipeline diffgraph serves.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ... import safe_files
from ...features.base import Admission, RowFeature
from ...features.capability import Capability
from ...request import GroupKey, Size, area_size
from ...text.prepared import PromptInputs, VisionImage
from ..model import DiffusionModel
from ..qwen_tokenizer import ASSETS
from .base import Conditioning
from .qwen_image import IMAGE_PAD, Checkpoint, QwenImageFamily, rope_tables, row_rope
from .references import (NAME, Reference, ReferenceRows, checked, checked_slot, grid_ids, param, reference,
                         reference_bucket)

# the pipeline's module constants (pixels of area of an input image as the vision tower and as the VAE read it)
CONDITION_IMAGE_SIZE = 384 * 384
VAE_IMAGE_SIZE = 1024 * 1024
MAX_INPUTS = 3
PARAM = param(MAX_INPUTS, "input images")  # the request's `reference_images`: its limit and the items' name
# QwenImageEditPlusPipeline's prompt_template_encode around the prompt, and its prompt_template_encode_start_idx
TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
            "background), then explain how the user's text instruction should alter or modify the image. Generate a "
            "new image that meets the user's requirements while maintaining consistency with the original input "
            "where appropriate.<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
DROPPED = 64
PICTURE = "Picture {}: <|vision_start|>{}<|vision_end|>"
PROCESSOR = "qwen2_vl_preprocessor.json"  # the Qwen2-VL image processor's settings (assets/qwen/)
QWEN_IMAGE_EDIT = Checkpoint("qwen-image-edit", 40, 4.0, native=1024)  # 2509 and 2511 model cards: 40 steps, true CFG 4
EDIT_2511 = "qwen-image-edit-2511"  # its split kind's and its preset's name (split_files.py, sidecar.py)


def processor_settings(folder: str | None = None) -> dict[str, Any]:
    """The Qwen2-VL image processor's settings: the shipped ones, checked against a pipeline folder's `processor/`
    where given (its `preprocessor_config.json`, or transformers 5's `processor_config.json` with its
    `image_processor`, pixel bounds as `size`): a ValueError naming the first setting that differs (the family
    preprocesses with the shipped ones)."""
    shipped = safe_files.read_json(os.path.join(ASSETS, PROCESSOR), 1 << 16)[0]
    for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = os.path.join(folder or "", "processor", name)
        if folder is None or not os.path.isfile(path):
            continue
        try:
            given = safe_files.read_json(path, 1 << 20)[0]
        except safe_files.UnusableFile as e:
            raise ValueError(f"{path}: {e}") from None
        given = dict(given.get(section) or {}) if section else given
        size = given.get("size") if isinstance(given.get("size"), dict) else {}
        given.setdefault("min_pixels", size.get("shortest_edge"))
        given.setdefault("max_pixels", size.get("longest_edge"))
        for key, value in shipped.items():
            if given.get(key) is not None and given[key] != value:
                raise ValueError(f"{path}: {key} is {given[key]!r}, but Qwen-Image-Edit's processor reads images with "
                                 f"{value!r}; restore the published processor settings")
        break
    return shipped


def is_2511(files: Any) -> bool:
    """Whether split files (split_files.SplitFiles) are Edit-2511's: ComfyUI's marker made them its kind, or their
    sidecar's preset or their name says 2511 (`preset_of`)."""
    return EDIT_2511 in (files.kind.name, files.preset)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL processor's size of an image: sides multiples of `factor`, area within the bounds, aspect kept."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                             * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def vision_image(image: Any, settings: Mapping[str, Any]) -> VisionImage:
    """A PIL RGB image as the vision tower reads it (Qwen2VLImageProcessorPil's `_preprocess`): resized (bicubic) to
    `smart_resize`'s size, scaled to 0..1 and normalised by the settings' mean and std, cut into patch x patch
    squares of `temporal_patch_size` identical frames, ordered by 2x2 merge groups."""
    from PIL import Image

    patch, merge, frames = settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]
    h, w = smart_resize(image.size[1], image.size[0], patch * merge, settings["min_pixels"], settings["max_pixels"])
    pixels = np.asarray(image.resize((w, h), Image.BICUBIC), dtype=np.float32).transpose(2, 0, 1)
    pixels = (pixels * np.float32(1 / 255) - np.asarray(settings["image_mean"], np.float32)[:, None, None]) / \
        np.asarray(settings["image_std"], np.float32)[:, None, None]
    gh, gw = h // patch, w // patch
    patches = pixels.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], frames, patch, patch))
    return VisionImage(np.ascontiguousarray(patches.reshape(gh * gw, 3 * frames * patch * patch)), (1, gh, gw))


@dataclass(frozen=True, eq=False)
class InputImages:
    """A request's input images prepared: their reference pixels (VAE resolution) and what the encoder reads."""

    references: tuple[Reference, ...]
    vision: PromptInputs


def check_input(image: Any) -> None:
    """A ValueError where an input is too thin for the pipeline's resolutions (a side rounds to 0) or for the vision
    processor (an aspect ratio beyond 200)."""
    w, h = image.size
    cw, ch = area_size(CONDITION_IMAGE_SIZE, w / h)
    vw, vh = area_size(VAE_IMAGE_SIZE, w / h)
    if min(cw, ch, vw, vh) < 32 or max(cw, ch) / min(cw, ch) > 200:
        raise ValueError(f"a {w}x{h} image is too thin for the model's vision encoder; send one of aspect ratio "
                         f"within {min(200, CONDITION_IMAGE_SIZE // 256)}:1")


def prepare_inputs(images: tuple[Any, ...], settings: Mapping[str, Any]) -> InputImages:
    """The pipeline's preprocessing of the input images (see the module's docstring), on the submitting thread."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=16)
    refs, vision, text = [], [], []
    for i, img in enumerate(checked(images, PARAM, check_input)):
        cw, ch = area_size(CONDITION_IMAGE_SIZE, img.size[0] / img.size[1])
        vw, vh = area_size(VAE_IMAGE_SIZE, img.size[0] / img.size[1])
        vision.append(vision_image(processor.resize(img, ch, cw), settings))
        refs.append(reference(processor.preprocess(img, vh, vw)))
        count = vision[-1].pixels.shape[0] // settings["merge_size"] ** 2
        text.append(PICTURE.format(i + 1, IMAGE_PAD * count))
    key = "|".join(hashlib.sha256(v.pixels.tobytes()).hexdigest() for v in vision)
    return InputImages(tuple(refs), PromptInputs("".join(text), key, tuple(vision)))


class EditImages(Capability):
    """`reference_images` on Qwen-Image-Edit: one to three input images (PIL or uint8 RGB arrays) a row edits."""

    name = NAME
    params = (PARAM,)

    def __init__(self, bucket: int):
        self.bucket = bucket
        self.processor = processor_settings()  # read once: every request's images are read with them

    def check(self, values: dict[str, Any], settings: Any) -> None:
        checked(tuple(values[NAME]), PARAM, check_input)

    def prepare(self, values: dict[str, Any], settings: Any) -> InputImages:
        return prepare_inputs(tuple(values[NAME]), self.processor)

    def feature(self, model: Any, settings: Any) -> RowFeature:
        return EditRows(model, self.bucket, model.latent_channels * 4)


def centred(ref: Reference, frame: int) -> torch.Tensor:
    """A reference's token ids [tokens, 3] as QwenEmbedRope places image `frame`: rows and columns centred."""
    h, w = ref.grid
    return grid_ids(ref, frame, -(h - h // 2), -(w - w // 2))


class EditRows(ReferenceRows):
    """The input images' reference tokens in a row (references.py `ReferenceRows`): the VAE's normalised latents
    packed 2x2, input i at frame i + 1 centred, their RoPE tables `rows.ref_cos` / `rows.ref_sin`, and the row's text
    and image tables again where an input's half extent passes the image's (the text starts after the largest)."""

    def references(self, admission: Admission) -> tuple[Reference, ...]:
        inputs = admission.prepared.get(NAME)
        return () if inputs is None else inputs.references

    def encode(self, ref: Reference) -> torch.Tensor:
        model = self.model
        vae = model.vae
        with torch.no_grad():
            posterior = vae.encode(ref.pixels.to(model.device, vae.dtype).unsqueeze(2)).latent_dist
            latents = posterior.mode()[:, :, 0]                                  # [1, 16, h, w]
        shape = (1, latents.shape[1], 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        tokens = model.adapter.patchify(model, (latents - mean) / std)
        return tokens[0].to(model.dtype)

    def positions(self, index: int, ref: Reference) -> torch.Tensor:
        return centred(ref, index + 1)

    def tables(self, admission: Admission, refs: tuple[Reference, ...],
               ids: torch.Tensor) -> dict[str, torch.Tensor]:
        model = self.model
        cos, sin = rope_tables(model.denoiser, ids)
        out = {"rows.ref_cos": cos, "rows.ref_sin": sin}
        reach = max(max(h // 2, w // 2) for h, w in (r.grid for r in refs))
        if reach > max(h // 2 for h in model.adapter.grid(model, admission.request.key)):
            spec = model.adapter.size_rows(model, admission.group, admission.request.key)
            cos, sin = row_rope(model.denoiser, spec["positions"][None], spec["image_mask"][None],
                                spec["text_positions"].shape[0], reach)
            out.update({"rows.rope_cos": cos, "rows.rope_sin": sin})
        return out


class QwenImageEditFamily(QwenImageFamily):
    name = "qwen-image-edit"
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    default_guidance = QWEN_IMAGE_EDIT.guidance
    template = TEMPLATE
    template_dropped = DROPPED
    checkpoint = QWEN_IMAGE_EDIT
    reads_zero_cond_t = True
    edit_images = NAME  # the edits route's image parts and AUTOMATIC1111's init images are its input images
    edit_images_area = 1024 * 1024  # an output without a size: the last input's aspect ratio (the pipeline's)

    # -- loading ---------------------------------------------------------------------------------------
    def load_folder(self, folder: str, index: dict[str, Any], device: torch.device, dtype: torch.dtype,
                    name: str) -> DiffusionModel:
        """A QwenImageEditPlusPipeline folder: Qwen-Image's parts, and its processor's settings checked against the
        shipped ones (`processor_settings`)."""
        try:
            processor_settings(folder)
        except ValueError as e:
            raise ValueError(f"model folder {folder!r}: {e}") from None
        return super().load_folder(folder, index, device, dtype, name)

    def split_reading(self, files: Any) -> dict[str, bool]:
        """The encoder file with its vision tower (one without is refused naming it, from its header), Edit-2511's
        `zero_cond_t` where the file's kind or its preset says 2511 (see the module's docstring)."""
        from .. import qwen_image_files as qf

        qf.check_vision(files.text_encoder)
        return {"vision": True, "zero_cond_t": is_2511(files)}

    def _model(self, name: str, transformer: Any, vae: Any, encoder: Any, *args: Any, **kwargs: Any
               ) -> DiffusionModel:
        """Qwen-Image's, the encoder's vision tower checked to read the patches the shipped processor settings cut."""
        if getattr(getattr(encoder, "model", encoder), "visual", None) is None:
            raise ValueError("Qwen-Image-Edit reads its input images with the Qwen2.5-VL encoder's vision tower, which "
                             "this text encoder lacks; use the checkpoint's own text_encoder")
        vision, settings = encoder.config.vision_config, processor_settings()
        for key, setting in (("patch_size", "patch_size"), ("spatial_merge_size", "merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
            if getattr(vision, key) != settings[setting]:
                raise ValueError(f"the text encoder's vision tower has {key} {getattr(vision, key)}, but "
                                 f"Qwen-Image-Edit cuts its input images with {setting} {settings[setting]} "
                                 "(Qwen2.5-VL's); use the checkpoint's own Qwen2.5-VL text encoder")
        return super()._model(name, transformer, vae, encoder, *args, **kwargs)

    def random_presets(self) -> dict[str, str]:
        return {"random:qwen-image-edit": "Qwen-Image-Edit-2509's true architecture (Qwen-Image's 20B MMDiT, "
                                          "Qwen2.5-VL-7B with its vision tower), random weights, for GPU timing",
                "random:qwen-image-edit-tiny": "a tiny Qwen-Image-Edit (two blocks, a two-layer Qwen2.5-VL with a "
                                               "one-block vision tower), random weights, for CPU tests"}

    # -- its input images: a capability, read beside the prompt and as reference rows -------------------
    def capabilities(self) -> tuple[Capability, ...]:
        return (EditImages(self.token_bucket),)

    def prompt_inputs(self, model: DiffusionModel, prepared: Mapping[str, Any]) -> PromptInputs | None:
        inputs = prepared.get(NAME)
        return None if inputs is None else inputs.vision

    def encode_with_inputs(self, model: DiffusionModel, prompts: list[str],
                           inputs: list[PromptInputs | None]) -> Conditioning:
        """Each prompt in the template after its inputs' placeholders, the inputs' images through the vision tower
        (`read`)."""
        before, after = self.template
        texts = [before + ("" if i is None else i.text) + p + after for p, i in zip(prompts, inputs)]
        return self.read(model, texts, tuple(img for i in inputs if i is not None for img in i.images))

    # -- groups: (text slot, reference tokens), image tokens ------------------------------------------
    def group_key(self, model: DiffusionModel, size: Size, text_tokens: int = 0,
                  prepared: Mapping[str, Any] | None = None, tiling: bool = False) -> GroupKey:
        slot, image = super().group_key(model, size, text_tokens, tiling=tiling)
        inputs = (prepared or {}).get(NAME)
        return (slot, reference_bucket(inputs.references if inputs else (), self.token_bucket)), image

    def group_keys(self, model: DiffusionModel, size: Size) -> tuple[GroupKey, ...]:
        return tuple(((slot, 0), key[1]) for slot, key in zip(self.text_buckets, super().group_keys(model, size)))

    def graph_group(self, key: GroupKey) -> GroupKey:
        return ((key[0][0], 0), key[1])

    def reference_group(self, key: GroupKey, slot: int) -> GroupKey:
        return ((key[0][0], checked_slot(slot, self.token_bucket)), key[1])

    def text_slot(self, key: GroupKey) -> int:
        first = key[0]
        if not isinstance(first, tuple) or first[0] not in self.text_buckets or first[1] % self.token_bucket:
            raise ValueError(f"group {key} is not a (text slot, reference tokens) bucket of family {self.name!r}")
        return first[0]

    def row_spec(self, model: DiffusionModel, key: GroupKey, size: Size | None = None) -> dict[str, torch.Tensor]:
        """Qwen-Image's row fields, and the group's reference slots, neutral (no input: masked out); a request's
        inputs overwrite them at admission (`EditRows`): `ref_tokens` [refs, 64], `ref_ids` [refs, 3] (frame, row,
        column), their RoPE tables `ref_cos` / `ref_sin` [refs, head_dim], `ref_mask` [refs]."""
        refs, device = key[0][1], model.device
        cos, sin = rope_tables(model.denoiser, torch.zeros((refs, 3), dtype=torch.int64, device=device))
        return {**self.size_rows(model, key, size),
                "ref_tokens": torch.zeros((refs, self.latent_channels(model) * 4), dtype=model.dtype, device=device),
                "ref_ids": torch.full((refs, 3), -1, dtype=torch.int64, device=device), "ref_cos": cos,
                "ref_sin": sin, "ref_mask": torch.zeros(refs, dtype=torch.bool, device=device)}

    def size_rows(self, model: DiffusionModel, key: GroupKey, size: Size | None) -> dict[str, torch.Tensor]:
        """The fields of a row of `size` that do not depend on its inputs (Qwen-Image's)."""
        return super().row_spec(model, key, size)

    def diffusers_pipeline(self, model: DiffusionModel, scheduler: Any, task: str = "text") -> Any:
        """QwenImageEditPlusPipeline on the same modules, its processor the Qwen2-VL processor with the PIL image
        processor at the shipped settings, without its video half (`images_processor`). (It reads images at plain sequence positions under transformers 5: a
        caller wanting the model's multimodal positions forwards `mm_token_type_ids` to its text encoder.)"""
        from diffusers import QwenImageEditPlusPipeline

        if task != "text":
            raise NotImplementedError(f"family {self.name!r} has no {task} pipeline yet")
        processor = images_processor(processor_settings(), model.tokenizers[0])
        return QwenImageEditPlusPipeline(scheduler=scheduler, vae=model.vae, text_encoder=model.text_encoders[0],
                                         tokenizer=model.tokenizers[0], processor=processor,
                                         transformer=model.denoiser)



def images_processor(settings: Mapping[str, Any], tokenizer: Any) -> Any:
    """transformers' Qwen2VLProcessor (the pipeline's `processor`) with its PIL image processor at `settings` and no
    video processor: the video half needs torchvision, which diffgraph does not depend on, and the pipeline reads
    no video."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, **kwargs: Any):
            self.image_token, self.video_token = IMAGE_PAD, "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImagesOnly(Qwen2VLImageProcessorPil(**settings), tokenizer)
